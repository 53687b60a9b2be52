"""The contrastive loss over every worker's batch: two gloo processes, each with half the batch,
give the loss and every gradient (averaged as DDP averages them) of one process on the whole
batch. Plain torch.distributed, no Ray: this is the math the Train workers run."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from app.tasks.retrieval.train import pair_loss
from tests.gloo_ranks import leave_together

pytestmark = pytest.mark.integration

ROWS, WIDTH, EMBED = 12, 7, 5  # the whole batch; each of the 2 ranks holds 6 rows


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(WIDTH, EMBED).double()
        self.text = nn.Linear(WIDTH, EMBED).double()
        self.logit_scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, pictures: torch.Tensor, captions: torch.Tensor):
        images = F.normalize(self.image(pictures), dim=-1)
        texts = F.normalize(self.text(captions), dim=-1)
        return images, texts, self.logit_scale.exp()


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    pictures = torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)
    captions = torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)
    # Rows 0 and 7 (and 3 and 4) are captions of one picture: across ranks, and within one.
    groups = torch.tensor([0, 1, 2, 3, 3, 5, 6, 0, 8, 9, 10, 11])
    pictures[7] = pictures[0]
    pictures[4] = pictures[3]
    return pictures, captions, groups


def loss_and_grads(model: Towers, rows: slice) -> tuple[float, dict[str, torch.Tensor]]:
    pictures, captions, groups = batch()
    images, texts, scale = model(pictures[rows], captions[rows])
    loss = pair_loss(images, texts, scale, groups[rows])
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def rank_main(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    half = ROWS // 2
    loss, grads = loss_and_grads(Towers(), slice(rank * half, (rank + 1) * half))
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    for g in grads.values():  # what DDP does to every gradient
        dist.all_reduce(g)
        g /= 2
    if rank == 0:
        torch.save({"loss": float(total) / 2, "grads": grads}, out)
    leave_together()


def test_two_ranks_give_the_loss_and_gradients_of_one_process_on_the_whole_batch(tmp_path):
    out = str(tmp_path / "ranks.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.pop("MASTER_ADDR", None)
    mp.spawn(rank_main, args=(init, out), nprocs=2, join=True)
    ranks = torch.load(out)
    loss, grads = loss_and_grads(Towers(), slice(0, ROWS))
    assert ranks["loss"] == pytest.approx(loss, abs=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(ranks["grads"][name], grad, atol=1e-5, rtol=0)
        assert grad.abs().sum() > 0, name  # a gradient that is there to compare


def test_a_rank_without_the_others_rows_gives_a_different_loss():
    """The check above can fail: one rank's half alone is not the whole batch's loss."""
    whole, _ = loss_and_grads(Towers(), slice(0, ROWS))
    half, _ = loss_and_grads(Towers(), slice(0, ROWS // 2))
    assert abs(whole - half) > 1e-3
