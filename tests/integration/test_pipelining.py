"""Pipeline parallelism on gloo ranks (plain torch.distributed, no Ray: the functions a Train
worker runs): a step's loss and every gradient equal the unsplit model's on the same batch for
each schedule and family, the tied embedding's two copies included, also accumulated over two
batches, and an epoch's short last batch filled with ignored rows; after an optimizer step the
stages gathered are the unsplit model after the same step. The library's own tests cover
NCCL only; each process group has a short timeout, so a hang fails loudly instead of waiting."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file

from app.models.bert import BertClassifier
from app.models.gpt import GPT
from app.models.transformer import TransformerClassifier
from app.models.vit import ViTClassifier
from app.tasks.lm.train import token_loss
from app.train.consolidate import write_consolidated
from app.train.pipelining import SCHEDULES, Mesh, Pipeline, PipelinedModel
from tests.gloo_ranks import leave_together

pytestmark = pytest.mark.integration
ROWS, MICROBATCHES, VOCAB, CLASSES = 8, 4, 64, 3
Inputs = dict[str, torch.Tensor]


def _gpt() -> torch.nn.Module:
    return GPT(vocab_size=VOCAB, block_size=16, dim=32, layers=4, heads=2)


def _bert() -> torch.nn.Module:
    return BertClassifier(VOCAB, CLASSES, dim=32, layers=4, heads=2, ff_dim=64, max_positions=16)


def _vit() -> torch.nn.Module:
    return ViTClassifier(CLASSES, image_size=8, patch_size=4, channels=3, dim=32, layers=4,
                         heads=2, ff_dim=64)  # fmt: skip


def _encoder() -> torch.nn.Module:
    return TransformerClassifier(VOCAB, CLASSES, dim=32, layers=4, heads=2, ff_dim=64,
                                 max_length=12, dropout=0.0)  # fmt: skip


def _tokens(g: torch.Generator) -> tuple[Inputs, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, 17), generator=g)
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def _text(g: torch.Generator) -> tuple[Inputs, torch.Tensor]:
    """Padded rows: the attention mask crosses the stages beside the hidden states."""
    ids = torch.randint(0, VOCAB, (ROWS, 12), generator=g)
    mask = (torch.arange(12) < torch.randint(3, 13, (ROWS, 1), generator=g)).long()
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(
        0, CLASSES, (ROWS,), generator=g
    )


def _images(g: torch.Generator) -> tuple[Inputs, torch.Tensor]:
    return {"x": torch.randn(ROWS, 3, 8, 8, generator=g)}, torch.randint(
        0, CLASSES, (ROWS,), generator=g
    )


def _labels_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


# family -> (model, batch, loss): the model built from seed 0 on every rank.
CASES = {
    "gpt": (_gpt, _tokens, token_loss),
    "bert": (_bert, _text, _labels_loss),
    "vit": (_vit, _images, _labels_loss),
    "transformer": (_encoder, _text, _labels_loss),
}


def model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CASES[family][0]()


def reference(family: str, inputs: Inputs, target: torch.Tensor):
    """The unsplit model after a backward and an SGD step (its gradients kept)."""
    whole = model(family).eval()  # dropout off: the split run is compared number for number
    loss = CASES[family][2](whole(**inputs), target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in whole.named_parameters()}
    torch.optim.SGD(whole.parameters(), lr=0.1).step()
    for name, param in whole.named_parameters():
        param.grad = grads[name]
    return whole, loss.detach()


def rank_main(
    rank: int, world: int, stages: int, schedules: list[str], init: str, folder: str
) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    mesh = Mesh(stages, world, rank)
    for family, (_, make_batch, loss_fn) in CASES.items():
        inputs, target = make_batch(torch.Generator().manual_seed(1))
        whole, loss = reference(family, inputs, target)
        grads = dict(whole.named_parameters(remove_duplicate=False))
        # each pipeline row its half of the batch
        share = {k: v.chunk(mesh.rows)[mesh.row] for k, v in inputs.items()}
        share_target = target.chunk(mesh.rows)[mesh.row]
        for kind in schedules:
            case = f"{family} {kind} rank {rank}"
            pipe = Pipeline(
                model(family).eval(), mesh, kind, MICROBATCHES, loss_fn, torch.device("cpu")
            )
            got = pipe.step(share, share_target)
            if pipe.holds_output:
                rows = torch.tensor([got.item()])
                if pipe.groups.data:
                    dist.all_reduce(rows, group=pipe.groups.data)
                assert abs(rows.item() / mesh.rows - loss.item()) < 1e-5, (case, rows, loss)
            held = pipe.named_parameters()
            assert held, case
            # What a Ray Train rank trains holds every parameter its stages do (under the
            # model's names), bare ones like ViT's class token included.
            trained = dict(PipelinedModel(pipe, split_target).named_parameters())
            assert trained.keys() == held.keys(), (case, trained.keys() ^ held.keys())
            for name, param in held.items():
                # 1e-5 of the gradient's scale: microbatches sum in another order (ViT's
                # zero-initialised class token under a LayerNorm has gradients near 1e3).
                scale = max(1.0, grads[name].grad.abs().max().item())
                diff = (param.grad - grads[name].grad).abs().max().item()
                assert diff < 1e-5 * scale, f"{case}: {name} gradient off by {diff} of {scale}"
            torch.optim.SGD(pipe.parameters(), lr=0.1).step()
            # The consolidated file, gathered tensor by tensor (a GPT's tied copy once).
            path = os.path.join(folder, f"{family}-{kind}.safetensors")
            write_consolidated(path if rank == 0 else None, PipelinedModel(pipe, split_target))
            if rank == 0:
                state = load_file(path)
                expected = whole.state_dict()
                assert expected.keys() - state.keys() <= {"tokens.weight"}, case
                assert state.keys() <= expected.keys(), (case, state.keys() - expected.keys())
                for name, value in state.items():
                    value = expected[name]
                    scale = max(1.0, value.abs().max().item())
                    diff = (state[name] - value).abs().max().item()
                    assert diff < 1e-5 * scale, f"{case}: {name} after a step off by {diff}"
            # Validation's pass: the whole batch relayed through the stages, no microbatches.
            out = pipe.forward(share)
            if pipe.holds_output:
                with torch.no_grad():
                    expected_out = whole(**share)
                assert (out - expected_out).abs().max().item() < 1e-4, case
            dist.barrier()
    accumulate(mesh, schedules)
    short_batch(mesh, schedules)
    leave_together()


def split_target(batch: Inputs) -> tuple[Inputs, torch.Tensor]:
    return batch, batch["input_ids"]


def accumulate(mesh: Mesh, schedules: list[str]) -> None:
    """Two batches accumulated into one optimizer step give the gradients of their mean loss
    (the schedule must not rescale what the first batch left)."""
    batches = [_tokens(torch.Generator().manual_seed(seed)) for seed in (2, 3)]
    whole = model("gpt").eval()
    sum(token_loss(whole(**inputs), target) for inputs, target in batches).div(2).backward()
    grads = dict(whole.named_parameters(remove_duplicate=False))
    for kind in schedules:
        pipe = Pipeline(
            model("gpt").eval(), mesh, kind, MICROBATCHES, token_loss, torch.device("cpu"),
            accumulation=2,
        )  # fmt: skip
        for (inputs, target), sync in zip(batches, (False, True), strict=True):
            share = {k: v.chunk(mesh.rows)[mesh.row] for k, v in inputs.items()}
            pipe.step(share, target.chunk(mesh.rows)[mesh.row], sync)
        for name, param in pipe.named_parameters().items():
            diff = (param.grad - grads[name].grad).abs().max().item()
            assert diff < 1e-5, f"accumulated {kind}: {name} gradient off by {diff}"


def short_batch(mesh: Mesh, schedules: list[str]) -> None:
    """An epoch's last, short batch (5 rows where the stages take 8: the last microbatch is
    padding only) counts every row once: its loss and gradients are the unsplit model's on
    those 5 rows, for a language model and a classifier."""
    for family in ("gpt", "transformer"):
        _, make_batch, loss_fn = CASES[family]
        inputs, target = make_batch(torch.Generator().manual_seed(4))
        inputs, target = {k: v[:5] for k, v in inputs.items()}, target[:5]
        whole, loss = reference(family, inputs, target)
        grads = dict(whole.named_parameters(remove_duplicate=False))
        for kind in schedules:
            case = f"short {family} {kind}"
            pipe = Pipeline(
                model(family).eval(), mesh, kind, MICROBATCHES, loss_fn, torch.device("cpu"),
                rows=ROWS,
            )  # fmt: skip
            got = pipe.step(inputs, target)
            if pipe.holds_output:
                assert abs(got.item() - loss.item()) < 1e-5, (case, got, loss)
            for name, param in pipe.named_parameters().items():
                scale = max(1.0, grads[name].grad.abs().max().item())
                diff = (param.grad - grads[name].grad).abs().max().item()
                assert diff < 1e-5 * scale, f"{case}: {name} gradient off by {diff} of {scale}"


def run_ranks(tmp_path, world: int, stages: int, schedules: list[str]) -> None:
    os.environ.pop("MASTER_ADDR", None)
    init = f"file://{tmp_path / 'rendezvous'}"
    args = (world, stages, schedules, init, str(tmp_path))
    mp.spawn(rank_main, args=args, nprocs=world, join=True)


def test_each_schedule_and_family_on_two_ranks_computes_the_whole_models_loss_and_gradients(
    tmp_path,
):
    run_ranks(tmp_path, world=2, stages=2, schedules=list(SCHEDULES))


@pytest.mark.slow
def test_two_pipelines_of_two_stages_average_their_gradients(tmp_path):
    run_ranks(tmp_path, world=4, stages=2, schedules=["1f1b", "interleaved_1f1b"])
