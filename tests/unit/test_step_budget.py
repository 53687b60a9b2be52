"""train.max_steps_per_epoch: an epoch stops after the budget, yet samples the whole shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.data.feed import MemoryFeed
from app.train.loop import epoch_batches, steps_per_epoch

pytestmark = pytest.mark.unit


def test_budget_bounds_the_epoch_and_the_schedule(config_factory):
    config = config_factory("train.max_steps_per_epoch=3", "train.batch_size=10")
    feed = MemoryFeed.from_arrays({"x": np.arange(100)})
    first = [b["x"] for b in epoch_batches(feed, 10, 1, config)]
    second = [b["x"] for b in epoch_batches(feed, 10, 2, config)]
    assert len(first) == len(second) == 3
    assert len(feed) == 100  # the cache holds the whole shard although the pass stopped early
    assert not torch.equal(torch.cat(first), torch.cat(second))  # each epoch a fresh sample
    assert steps_per_epoch(100, 1, config) == 3  # the LR schedule counts the budget
    assert steps_per_epoch(20, 1, config) == 2  # a smaller split stays smaller


def test_no_budget_is_the_whole_split(config_factory):
    config = config_factory("train.batch_size=10")
    feed = MemoryFeed.from_arrays({"x": np.arange(100)})
    assert sum(len(b["x"]) for b in epoch_batches(feed, 10, 1, config)) == 100


def test_a_step_budget_short_of_one_epoch_is_named():
    """configs/bert-text.yaml's 60 steps on 2,588 rows: 0.37 of an epoch, said in one line."""
    from app.config import load_config
    from app.train.loop import short_budget
    from tests.conftest import REPO

    config = load_config(REPO / "configs" / "bert-text.yaml")
    t = config.train
    rows = 2588
    line = short_budget(rows, config)
    seen = t.max_steps * t.min_workers * t.batch_size * t.grad_accum_steps / rows
    assert seen < 1 and line is not None
    assert f"train.max_steps={t.max_steps}" in line and f"{seen:.2f} of one epoch" in line
    assert short_budget(10, config) is None  # the budget covers every row
    assert short_budget(rows, load_config(REPO / "configs" / "digits.yaml")) is None
