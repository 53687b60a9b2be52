"""Pipeline parallelism on gloo ranks (plain torch.distributed, no Ray: the functions a Train
worker runs): a step's loss and every gradient equal the unsplit model's on the same batch for
each schedule, the tied embedding's two copies included, and after an optimizer step the
stages gathered are the unsplit model after the same step. The library's own tests cover
NCCL only; each process group has a short timeout, so a hang fails loudly instead of waiting."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.models.gpt import GPT
from app.tasks.lm import token_loss
from app.train.pipeline import SCHEDULES, Mesh, Pipeline
from tests.gloo_ranks import leave_together

pytestmark = pytest.mark.integration
ROWS, MICROBATCHES = 8, 4


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, block_size=16, dim=32, layers=4, heads=2)


def batch(rows: int = ROWS) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 17), generator=torch.Generator().manual_seed(1))


def reference(ids: torch.Tensor) -> tuple[GPT, torch.Tensor]:
    """The unsplit model after a backward and an SGD step on `ids` (its gradients kept)."""
    whole = model()
    loss = token_loss(whole(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in whole.named_parameters()}
    torch.optim.SGD(whole.parameters(), lr=0.1).step()
    for name, param in whole.named_parameters():
        param.grad = grads[name]
    return whole, loss.detach()


def rank_main(rank: int, world: int, stages: int, schedules: list[str], init: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    ids = batch()
    whole, loss = reference(ids)
    grads = dict(whole.named_parameters(remove_duplicate=False))
    mesh = Mesh(stages, world, rank)
    share = ids.chunk(mesh.rows)[mesh.row]  # each pipeline row its half of the batch
    for kind in schedules:
        pipe = Pipeline(model(), mesh, kind, MICROBATCHES, token_loss, torch.device("cpu"))
        got = pipe.step(share[:, :-1], share[:, 1:])
        if pipe.holds_output:
            rows = torch.tensor([got.item()])
            if pipe.groups.data:
                dist.all_reduce(rows, group=pipe.groups.data)
            assert abs(rows.item() / mesh.rows - loss.item()) < 1e-5, (kind, rows, loss)
        held = pipe.named_parameters()
        assert held, kind
        for name, param in held.items():
            diff = (param.grad - grads[name].grad).abs().max().item()
            assert diff < 1e-5, f"{kind} rank {rank}: {name} gradient off by {diff}"
        torch.optim.SGD(pipe.parameters(), lr=0.1).step()
        state = pipe.full_state_dict()
        if rank == 0:
            expected = whole.state_dict()
            assert state.keys() == expected.keys(), (kind, state.keys() ^ expected.keys())
            for name, value in expected.items():
                diff = (state[name] - value).abs().max().item()
                assert diff < 1e-5, f"{kind}: {name} after a step off by {diff}"
        dist.barrier()
    leave_together()


def run_ranks(tmp_path, world: int, stages: int, schedules: list[str]) -> None:
    os.environ.pop("MASTER_ADDR", None)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(rank_main, args=(world, stages, schedules, init), nprocs=world, join=True)


def test_each_schedule_on_two_ranks_computes_the_whole_models_loss_and_gradients(tmp_path):
    run_ranks(tmp_path, world=2, stages=2, schedules=list(SCHEDULES))


@pytest.mark.slow
def test_two_pipelines_of_two_stages_average_their_gradients(tmp_path):
    run_ranks(tmp_path, world=4, stages=2, schedules=["1f1b", "interleaved_1f1b"])
