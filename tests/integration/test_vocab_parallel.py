"""A sharded run's vocabulary split by rows (plain torch.distributed on 2 gloo ranks, the functions
a Ray Train worker runs): under FSDP a causal LM's embedding and head tables (one, tied) are each
rank's rows alone, never gathered, and yet the loss, its top-1 hits and every gradient equal a
single process's, for a tied Llama-style decoder, an untied one and GPT, each rank with its own
batch (packed chat rows, a rank without any trained token, unequal batch sizes); bf16 autocast
agrees with fp32 within its precision. The tables checkpoint whole, and a run restored from its
sharded checkpoint (optimizer state included) takes the step the original took."""

from __future__ import annotations

import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.config import TrainConfig
from app.data.packing import Tokenized, packed
from app.models.gpt import GPT
from app.models.init import initialise
from app.models.llama import DecoderArgs, LlamaLM
from app.tasks.lm.train import SEGMENTS_KEY, TOKENS_KEY, TRAINED_KEY, scored
from app.train import parallel
from app.train.consolidate import write_consolidated
from app.train.vocab_parallel import VocabParallelEmbedding
from tests.gloo_ranks import leave_together

pytestmark = pytest.mark.integration
SEED, WORLD, VOCAB, WIDTH = 3, 2, 67, 25  # 67 rows: ranks hold 34 and 33


def llama(tied: bool) -> LlamaLM:
    args = DecoderArgs(
        vocab_size=VOCAB, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, ff_dim=48,
        max_positions=32, tied=tied,
    )  # fmt: skip
    return LlamaLM(args)


FAMILIES = {
    "llama-tied": lambda: llama(True),
    "llama-untied": lambda: llama(False),
    "gpt": lambda: GPT(VOCAB, block_size=32, dim=32, layers=2, heads=2),
}


def batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's batches: packed chat rows; one with no trained token on rank 1; then rows of
    unequal counts (3 and 2, as validation's last batches)."""
    rng = np.random.default_rng(rank)

    def rows(count: int, train: bool = True) -> dict[str, torch.Tensor]:
        seqs = []
        for _ in range(count):
            n = int(rng.integers(5, 12))
            trained = np.zeros(n, np.uint8)
            trained[n // 2 :] = train
            seqs.append(Tokenized(rng.integers(0, VOCAB, n).astype(np.int32), trained))
        r = packed(seqs, WIDTH, 0)
        return {
            TOKENS_KEY: torch.from_numpy(r.ids.astype(np.int64)),
            TRAINED_KEY: torch.from_numpy(r.trained),
            SEGMENTS_KEY: torch.from_numpy(r.segments),
        }

    return [rows(8), rows(4, train=rank == 0), rows(9 - 3 * rank)]


def reference(family: str, folder: str) -> None:
    """Each rank's losses and the gradients of the mean of the ranks' mean losses."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    initialise(model, SEED)
    out = {}
    for step in range(3):
        model.zero_grad()
        losses = [scored(model, batches(rank)[step], torch.device("cpu")) for rank in range(WORLD)]
        (sum(loss.mean for loss in losses) / WORLD).backward()
        out[step] = {
            "losses": [(float(loss.total), int(loss.tokens), int(loss.correct)) for loss in losses],
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        }
    torch.save(out, os.path.join(folder, f"{family}-reference.pt"))


def check(family: str, rank: int, folder: str) -> None:
    expected = torch.load(os.path.join(folder, f"{family}-reference.pt"))
    model = sharded_model(family)
    assert isinstance(model.tokens, VocabParallelEmbedding), family
    table = model.tokens.weight
    assert table.to_local().shape[0] == (34 if rank == 0 else 33)  # rows, never gathered
    for step in range(3):
        model.zero_grad()
        out = scored(model, batches(rank)[step], torch.device("cpu"))
        out.mean.backward()
        total, tokens, correct = expected[step]["losses"][rank]
        case = f"{family} step {step} rank {rank}"
        assert int(out.tokens) == tokens and int(out.correct) == correct, case
        assert float(out.total) == pytest.approx(total, rel=1e-5, abs=1e-6), case
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            torch.testing.assert_close(
                grad, expected[step]["grads"][name], rtol=1e-4, atol=1e-6, msg=f"{case}: {name}"
            )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = scored(model, batches(rank)[0], torch.device("cpu"))
    assert float(low.total) == pytest.approx(expected[0]["losses"][rank][0], rel=0.05)
    path = os.path.join(folder, f"{family}-consolidated.safetensors")
    write_consolidated(path if rank == 0 else None, model)
    resumes_from_its_shards(family, model, rank, folder)


def sharded_model(family: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = FAMILIES[family]()
    return parallel.parallelize(model, TrainConfig(strategy="fsdp", seed=SEED), torch.device("cpu"))


def resumes_from_its_shards(family: str, model: torch.nn.Module, rank: int, folder: str) -> None:
    """An AdamW step, a sharded checkpoint (torch.distributed.checkpoint), a fresh model and
    optimizer restored from it: the same next loss as the run that went on."""
    from app.train.checkpoint import load_sharded, save_sharded

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optimizer, batches(rank)[0])
    where = os.path.join(folder, f"{family}-sharded")  # one folder, as Ray Train merges ranks'
    save_sharded(where, model, optimizer, rank)
    went_on = step(model, optimizer, batches(rank)[2])
    fresh = sharded_model(family)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    step(fresh, fresh_optimizer, batches(rank)[1], lr=0.0)  # AdamW's state exists to load into
    load_sharded(where, fresh, fresh_optimizer, rank)
    assert step(fresh, fresh_optimizer, batches(rank)[2]) == pytest.approx(went_on, rel=1e-6)


def step(model, optimizer, batch, lr: float | None = None) -> float:
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] if lr is None else lr
    optimizer.zero_grad()
    loss = scored(model, batch, torch.device("cpu")).mean
    loss.backward()
    optimizer.step()
    return loss.item()


def rank_main(rank: int, init: str, folder: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    for family in FAMILIES:
        check(family, rank, folder)
        dist.barrier()
    leave_together()


def test_vocab_parallel_loss_and_gradients_equal_one_process(tmp_path):
    from safetensors.torch import load_file, save_model

    for family in FAMILIES:
        reference(family, str(tmp_path))
        whole = FAMILIES[family]()
        initialise(whole, SEED)
        save_model(whole, str(tmp_path / f"{family}-whole.safetensors"))
    os.environ.pop("MASTER_ADDR", None)
    mp.spawn(rank_main, args=(f"file://{tmp_path / 'rv'}", str(tmp_path)), nprocs=WORLD)
    for family in FAMILIES:  # the tables come back whole, as one process holds them
        got = load_file(tmp_path / f"{family}-consolidated.safetensors")
        want = load_file(tmp_path / f"{family}-whole.safetensors")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), family
