"""Validation over every val row at any world size: two gloo processes, each validating its
share of a split whose rows do not divide evenly (the one with fewer batches adds a padding
batch), report what one process reports on the whole split. A sharded classifier (FSDP2, whose
forward gathers parameters) and the retrieval task (whose loss gathers every rank's rows):
unequal forward passes would leave a rank waiting, so the group's timeout fails it loudly.
Plain torch.distributed, no Ray: the functions the Train workers run."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from app.data.feed import MemoryFeed, padded
from app.data.ingest import padding_batches, rank_range
from app.tasks.classify.train import validate_classifier
from app.tasks.retrieval.train import validate_retrieval
from tests.gloo_ranks import leave_together

pytestmark = pytest.mark.integration
ROWS, BATCH = 9, 4  # over 2 ranks: 4 rows (1 batch) and 5 rows (2 batches)


def classifier() -> nn.Module:
    from app.models.transformer import TransformerClassifier

    torch.manual_seed(0)
    return TransformerClassifier(50, 3, dim=16, layers=2, heads=2, ff_dim=32, max_length=8)


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(6, 5)
        self.text = nn.Embedding(50, 5)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, pixels, input_ids, attention_mask):
        texts = (self.text(input_ids) * attention_mask[..., None]).mean(1)
        return (
            F.normalize(self.image(pixels), dim=-1),
            F.normalize(texts, dim=-1),
            self.logit_scale.exp(),
        )


def split(task: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (ROWS, 8), generator=g)
    rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "classify":
        return rows | {"label": torch.randint(0, 3, (ROWS,), generator=g)}
    groups = torch.tensor([0, 1, 1, 2, 3, 4, 4, 5, 6])  # captions of one picture on both ranks
    pixels = torch.randn(ROWS, 6, generator=g)[groups]
    return rows | {"pixels": pixels, "group": groups}


def validate(task: str, model: nn.Module, rank: int = 0, world: int = 1) -> dict[str, float]:
    lo, hi = rank_range(ROWS, rank, world, every_row=True)
    share = MemoryFeed.from_arrays({k: v[lo:hi].numpy() for k, v in split(task).items()})
    batches = padded(share.batches(BATCH), padding_batches(ROWS, rank, world, BATCH))
    fn = validate_classifier if task == "classify" else validate_retrieval
    return fn(model, batches, torch.device("cpu"), "fp32")


def rank_main(rank: int, task: str, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    if task == "classify":
        from app.config import load_config
        from app.train import parallel

        t = load_config(None, ["data.source=synthetic_text", "train.strategy=fsdp"]).train
        model = parallel.parallelize(classifier(), t, torch.device("cpu"))
    else:
        model = Towers()
    metrics = validate(task, model, rank, 2)
    torch.save(metrics, f"{out}.{rank}")
    leave_together()


@pytest.mark.parametrize("task", ["classify", "retrieval"])
def test_two_ranks_validate_every_row_as_one_process_does(tmp_path, task):
    assert padding_batches(ROWS, 0, 2, BATCH) == 1  # the case under test: one rank pads
    out = str(tmp_path / "metrics")
    os.environ.pop("MASTER_ADDR", None)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(rank_main, args=(task, init, out), nprocs=2, join=True)
    alone = validate(task, classifier() if task == "classify" else Towers())
    for rank in range(2):
        metrics = torch.load(f"{out}.{rank}")
        assert metrics.keys() == alone.keys()
        for key, value in alone.items():
            if key == "val_loss" and task == "retrieval":
                continue  # the contrastive loss depends on how rows are batched
            assert metrics[key] == pytest.approx(value, abs=1e-5), key
