"""app/train/parallel.py and sharded checkpoints without Ray: the config, which modules are blocks,
activation checkpointing, and FSDP2 on a one-rank gloo group in this process (sharding, memory
accounting, sharded save and resume, the consolidated copy)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from app.config import ConfigError, dump, load_config
from app.models.cnn import ResNetCNN
from app.models.mlp import MLP
from app.models.transformer import TransformerClassifier
from app.train import checkpoint, consolidate, parallel
from app.train.loop import TrainState

pytestmark = pytest.mark.unit


def tiny_transformer() -> TransformerClassifier:
    return TransformerClassifier(
        50, 3, dim=16, layers=2, heads=2, ff_dim=32, max_length=8, dropout=0
    )


def batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.tensor([0, 1, 2, 0])


def train_config(*overrides: str):
    return load_config(None, ["data.source=synthetic_text", "model.name=transformer", *overrides])


def test_parallel_keys_default_to_plain_ddp():
    t = train_config().train
    assert (t.strategy, t.activation_checkpointing, t.compile, t.profile_steps) == (
        "ddp",
        False,
        False,
        0,
    )
    t = train_config("train.strategy=fsdp", "train.profile_steps=3", "train.compile=true").train
    assert (t.strategy, t.profile_steps, t.compile) == ("fsdp", 3, True)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.strategy=zero3", "train.strategy"),
        ("train.profile_steps=-1", "train.profile_steps"),
        ("train.activation_checkpointing=sometimes", "train.activation_checkpointing"),
    ],
)
def test_bad_parallel_keys_are_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        train_config(override)
    assert str(e.value).startswith(f"config error: {key}:")
    assert "\n" not in str(e.value)


def test_blocks_are_the_layers_or_blocks_container_else_none():
    model = tiny_transformer()
    assert parallel.find_blocks(model) == list(model.layers)
    cnn = ResNetCNN(1, 3, widths=[4, 8])
    assert parallel.find_blocks(cnn) == list(cnn.blocks)
    assert parallel.find_blocks(MLP(4, 3, hidden=[8])) == []  # wrapped at the root only


def test_activation_checkpointing_keeps_values_gradients_and_names():
    inputs, labels = batch()
    torch.manual_seed(0)
    plain = tiny_transformer()
    torch.manual_seed(0)
    recomputed = tiny_transformer()
    for block in parallel.find_blocks(recomputed):
        parallel.checkpoint_activations(block)
    for model in (plain, recomputed):
        F.cross_entropy(model(**inputs), labels).backward()
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank, in this process (no subprocess, no network peer)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fsdp_state(config) -> TrainState:
    torch.manual_seed(0)
    model = parallel.parallelize(tiny_transformer(), config.train, torch.device("cpu"))
    return TrainState.create(model, config, 10 * config.train.batch_size, world=1)


def step(state: TrainState) -> float:
    inputs, labels = batch()
    loss = F.cross_entropy(state.model(**inputs), labels)
    loss.backward()
    state.advance()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def test_fsdp_shards_every_block_and_the_root_and_counts_its_bytes(one_rank_group):
    from torch.distributed.tensor import DTensor

    config = train_config("train.strategy=fsdp", "train.activation_checkpointing=true")
    state = fsdp_state(config)
    assert parallel.is_sharded(state.model)
    assert all(parallel.is_sharded(b) for b in parallel.find_blocks(state.model))
    assert all(isinstance(p, DTensor) for p in state.model.parameters())
    meter = parallel.MemoryMeter(state.model, state.optimizer)
    step(state)
    params = sum(p.numel() * 4 for p in tiny_transformer().parameters())
    # One rank holds everything: fp32 params, grads, and AdamW's two moments (+ a step scalar
    # per parameter tensor).
    assert meter.peak["params"] == meter.peak["grads"] == params
    assert 2 * params <= meter.peak["optimizer"] <= 2 * params + 8 * 64
    assert meter.peak["total"] == sum(v for k, v in meter.peak.items() if k != "total")


def save_fsdp_checkpoint(state: TrainState, config, folder: str) -> None:
    """What a rank-0 FSDP worker writes: shards, consolidated weights, train state, meta."""
    checkpoint.save_sharded(folder, state.model, state.optimizer, rank=0)
    consolidate.write_consolidated(os.path.join(folder, checkpoint.WEIGHTS), state.model)
    meta = {
        "config": dump(config),
        "epoch": 1,
        "step": state.step,
        "metrics": {},
        "preprocessor": "{}",
    }
    checkpoint.save(folder, None, state.train_state(), meta)


def test_sharded_checkpoint_resumes_model_optimizer_schedule_and_rng(one_rank_group, tmp_path):
    config = train_config("train.strategy=fsdp", "train.warmup_fraction=0.5")
    state = fsdp_state(config)
    step(state)
    folder = str(tmp_path / "ckpt")
    save_fsdp_checkpoint(state, config, folder)
    saved = {n: p.full_tensor().detach().clone() for n, p in state.model.state_dict().items()}
    assert "optimizer" not in state.train_state()  # its shards live in `sharded/`
    # The second step's loss depends on the first update after the restart (AdamW moments,
    # the warm-up learning rate), the draw on the restored RNG.
    expected = [step(state), step(state)]
    draw = torch.rand(3)

    resumed = fsdp_state(config)  # fresh weights, empty optimizer, schedule at step 0
    resumed.restore(folder, rank=0)
    assert resumed.step == 1
    assert [step(resumed), step(resumed)] == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(torch.rand(3), draw)
    # The consolidated file is the plain model family with the trained values.
    loaded = tiny_transformer()
    checkpoint.load_weights(folder, loaded)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, saved[name], msg=name)


def test_a_ddp_checkpoint_is_not_resumed_by_an_fsdp_run_or_the_reverse(one_rank_group, tmp_path):
    fsdp = train_config("train.strategy=fsdp")
    state = fsdp_state(fsdp)
    step(state)
    folder = str(tmp_path / "fsdp")
    save_fsdp_checkpoint(state, fsdp, folder)
    torch.manual_seed(0)
    ddp = TrainState.create(tiny_transformer(), train_config(), 10 * 8, world=1)
    with pytest.raises(checkpoint.CheckpointError, match="train.strategy=fsdp"):
        ddp.restore(folder)


class TiedLM(torch.nn.Module):
    """The shape of a GPT: blocks, and an output head sharing the embedding matrix."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(20, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 20, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_consolidated_file_is_what_save_model_writes_and_keeps_tied_weights_tied(
    one_rank_group, tmp_path
):
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model, save_model

    torch.manual_seed(0)
    whole = TiedLM()
    config = train_config("train.strategy=fsdp")
    torch.manual_seed(0)
    model = parallel.parallelize(TiedLM(), config.train, torch.device("cpu"))
    streamed, saved = str(tmp_path / "streamed.safetensors"), str(tmp_path / "saved.safetensors")
    consolidate.write_consolidated(streamed, model)  # tensor by tensor, as a sharded run saves
    save_model(whole, saved)  # the unsplit model, as a DDP run saves
    got, expected = load_file(streamed), load_file(saved)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)
    with safe_open(streamed, "pt") as a, safe_open(saved, "pt") as b:
        assert a.metadata() == b.metadata()  # the dropped copy names the kept one
    loaded = TiedLM()
    load_model(loaded, streamed)
    assert loaded.head.weight is loaded.tokens.weight
    torch.testing.assert_close(loaded.head.weight, whole.tokens.weight)


def test_a_failed_consolidated_write_leaves_no_file(tmp_path):
    spec = consolidate.Spec("w", (2, 3), torch.float32)
    path = str(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="w: got"):
        consolidate.write_safetensors(path, [spec], iter([torch.zeros(3, 2)]), {})
    assert os.listdir(tmp_path) == []


# --- pipeline stages (app/train/pipelining.py; the schedules run in tests/integration) ----------


def test_pipeline_blocks_split_evenly_or_at_the_given_points():
    from app.train.pipelining import block_ranges

    assert block_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert block_ranges(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert block_ranges(12, 2, [3]) == [range(0, 3), range(3, 12)]
    assert [len(r) for r in block_ranges(12, 4, [1, 2, 11])] == [1, 1, 9, 1]


@pytest.mark.parametrize(
    "blocks, stages, points, words",
    [
        (4, 1, (), "1 stages for a model of 4 blocks"),
        (2, 3, (), "3 stages for a model of 2 blocks"),
        (4, 2, (0,), "split_points=[0]"),
        (4, 2, (4,), "split_points=[4]"),
        (4, 3, (2, 2), "2 increasing block indices between 1 and 3"),
        (4, 3, (2,), "split_points=[2]"),
    ],
)
def test_a_bad_pipeline_split_is_one_line_naming_the_key(blocks, stages, points, words):
    from app.train.pipelining import block_ranges

    with pytest.raises(ValueError, match="train.pipeline") as err:
        block_ranges(blocks, stages, points)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_pipeline_mesh_rows_and_columns():
    from app.train.pipelining import Mesh

    mesh = Mesh(stages=2, world=6, rank=3)
    assert (mesh.row, mesh.stage_rank, mesh.rows) == (1, 1, 3)
    assert mesh.pipeline_ranks(1) == [2, 3] and mesh.data_ranks(1) == [1, 3, 5]
    with pytest.raises(ValueError, match="the 3 workers must be a multiple of the stages"):
        Mesh(stages=2, world=3, rank=0)


def test_a_model_without_a_split_is_refused_naming_it():
    from app.train.splits import split_of

    with pytest.raises(ValueError, match="MLP has no split"):
        split_of(MLP(4, 2, [8]))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.batch_size=10"], "train.batch_size=10 must be a multiple of"),
        (["train.num_workers=3"], "train.num_workers=3: with train.strategy=pipeline a fixed"),
        (["train.num_workers=[2, 4]"], "a fixed multiple of train.pipeline.stages=2"),
        (
            ["train.pipeline.stages=8", "train.num_workers=8"],
            "schedule 1f1b on 8 stages needs at least 8",
        ),
        (
            [
                "train.pipeline.schedule=interleaved_1f1b",
                "train.pipeline.microbatches=5",
                "train.batch_size=10",
            ],
            "schedule interleaved_1f1b on 2 stages needs a multiple of 2",
        ),
        (["train.precision=fp16"], "runs fp32 or bf16 without train.compile"),
        (["train.compile=true"], "runs fp32 or bf16 without train.compile"),
        (["train.pipeline.schedule=zigzag"], "train.pipeline.schedule"),
        (["train.pipeline.stages=1"], "train.pipeline.stages"),
    ],
)
def test_pipeline_keys_that_cannot_run_are_one_line_naming_them(overrides, words):
    base = ["train.strategy=pipeline", "train.batch_size=8", "train.num_workers=2"]
    with pytest.raises(ConfigError) as err:
        train_config(*base, *overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_pipeline_stages_count_as_one_data_rank():
    t = train_config("train.strategy=pipeline", "train.num_workers=4").train
    assert (t.stages, t.pipeline.microbatches, t.pipeline.schedule) == (2, 4, "1f1b")
    assert train_config("train.pipeline.stages=4").train.stages == 1  # only under pipeline


def test_the_driver_refuses_a_task_or_model_a_pipeline_cannot_split():
    from app.models.gpt import GPT
    from app.registry import task_named
    from app.train.driver import check_pipeline

    config = train_config("train.strategy=pipeline")
    check_pipeline(config, task_named("classify"), tiny_transformer())
    with pytest.raises(ConfigError, match="task 'retrieval' does not train in pipeline stages"):
        check_pipeline(config, task_named("retrieval"), tiny_transformer())
    with pytest.raises(ConfigError, match="MLP has no split"):
        check_pipeline(config, task_named("classify"), MLP(4, 2, [8]))
    two_blocks = GPT(vocab_size=64, block_size=8, dim=16, layers=2, heads=2)
    check_pipeline(config, task_named("lm"), two_blocks)
    interleaved = train_config(
        "train.strategy=pipeline", "train.pipeline.schedule=interleaved_1f1b"
    )
    with pytest.raises(ConfigError, match="4 stages for a model of 2 blocks"):
        check_pipeline(interleaved, task_named("lm"), two_blocks)


def test_a_pipelines_stages_stream_their_rows_share_in_order():
    """Each stage of a row runs its own Ray Data stream of the row's share; in order, the
    seeded shuffle cuts the same batches for all (the first stage's inputs, the last's
    targets). Other strategies take blocks as they come."""
    from app.data.ingest import ingest_options

    def ordered(*overrides: str) -> bool:
        config = train_config("data.stream.max_cpus=1", *overrides)
        return ingest_options(config, workers=2).preserve_order

    assert ordered("train.strategy=pipeline")
    assert not ordered("train.strategy=ddp")


def test_a_checkpoint_of_a_looped_adamw_resumes_into_this_runs_fused_one(tmp_path):
    config = train_config()
    torch.manual_seed(0)
    state = TrainState.create(tiny_transformer(), config, 10 * 8, world=1)
    assert all(group["fused"] for group in state.optimizer.param_groups)
    step(state)
    saved = state.train_state()
    for group in saved["optimizer"]["param_groups"]:
        group["fused"] = None  # as a checkpoint from before fused AdamW holds it
    folder = str(tmp_path / "ckpt")
    meta = {"config": dump(config), "epoch": 1, "step": 1, "metrics": {}, "preprocessor": "{}"}
    checkpoint.save(folder, state.model, saved, meta)
    resumed = TrainState.create(tiny_transformer(), config, 10 * 8, world=1)
    resumed.restore(folder)
    assert all(group["fused"] for group in resumed.optimizer.param_groups)
    step(resumed)  # the fused step runs on the restored moments
