"""app/train/elastic.py and train.num_workers as a range."""

from __future__ import annotations

import pytest

from app.config import load_config
from app.errors import ConfigError
from app.train import elastic
from app.train.loop import steps_per_epoch
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def digits(*overrides: str):
    return load_config(REPO / "configs" / "digits.yaml", list(overrides))


def test_a_range_is_elastic_and_a_count_or_equal_bounds_is_not():
    assert digits("train.num_workers=[1,4]").train.elastic
    for fixed in ("train.num_workers=3", "train.num_workers=[2,2]"):
        assert not digits(fixed).train.elastic
    assert elastic.scaling_workers(digits("train.num_workers=[1,4]").train) == (1, 4)
    assert elastic.scaling_workers(digits("train.num_workers=[2,2]").train) == 2
    for bad in ("[2,1]", "[0,2]", "0"):
        with pytest.raises(ConfigError, match="num_workers"):
            digits(f"train.num_workers={bad}")


def test_fewer_ranks_accumulate_so_the_global_batch_and_the_schedule_stay_max_workers():
    config = digits("train.num_workers=[1,4]", "train.grad_accum_steps=2")
    rows = 10_000
    full = steps_per_epoch(rows, 4, elastic.for_world(config, 4))
    for world, accumulate in ((4, 2), (2, 4), (1, 8), (3, 4)):
        on_world = elastic.for_world(config, world)
        assert on_world.train.grad_accum_steps == accumulate
        global_batch = world * on_world.train.batch_size * accumulate
        # The same global batch where the world divides max, else the next multiple up.
        assert 4 * config.train.batch_size * 2 <= global_batch < 2 * 4 * config.train.batch_size * 2
        if 4 % world == 0:
            assert steps_per_epoch(rows, world, on_world) == full
    fixed = digits("train.num_workers=2", "train.grad_accum_steps=2")
    assert elastic.for_world(fixed, 2) is fixed


def test_the_size_history_records_starts_grows_and_shrinks_but_not_same_size_restarts():
    t = digits("train.num_workers=[1,2]").train
    history = elastic.record_size([], 1, 1, t)
    assert history[0]["reason"].startswith("start") and history[0]["workers"] == 1
    assert elastic.record_size(history, 1, 4, t) == history  # a restart after a fault
    history = elastic.record_size(history, 2, 4, t)
    history = elastic.record_size(history, 1, 7, t)
    assert [(h["workers"], h["from_epoch"]) for h in history] == [(1, 1), (2, 4), (1, 7)]
    assert history[1]["reason"].startswith("grew 1 -> 2")
    assert history[2]["reason"].startswith("shrank 2 -> 1")


def test_per_worker_cpus_ray_may_miscount_are_warned_about(caplog):
    for cpus, warned in (("0.5", False), ("1", False), ("0.3", True)):
        caplog.clear()
        elastic.warn_inexact(
            digits("train.num_workers=[1,2]", f"train.cpus_per_worker={cpus}").train
        )
        assert ("not a binary fraction" in caplog.text) is warned, cpus
    caplog.clear()
    elastic.warn_inexact(digits("train.num_workers=2", "train.cpus_per_worker=0.3").train)
    assert not caplog.text  # a fixed count is not sized by Ray's elastic policy


@pytest.mark.parametrize("sizes", [(3, 4, 4), (4, 3, 3), (2, 4, 2)], ids=str)
def test_the_schedule_ends_at_the_last_step_whatever_sizes_the_run_trains_at(sizes):
    """Each epoch at its own size, restarted between (a new state restored from the last):
    the linear decay is a third left at the last epoch's start and just above 0 at its end."""
    import torch

    from app.train.loop import TrainState

    config = digits(
        "train.num_workers=[2,4]", "train.epochs=3", "train.lr_schedule=linear",
        "train.warmup_fraction=0", "train.batch_size=16",
    )  # fmt: skip
    rows, base = 10_000, config.train.lr
    state, rates, firsts = None, [], []
    for epoch, world in enumerate(sizes, start=1):
        restarted = TrainState.create(
            torch.nn.Linear(2, 2), elastic.for_world(config, world), rows, world
        )
        if state is not None:  # what TrainState.restore brings back
            restarted.rows, restarted.step, restarted.epoch = state.rows, state.step, state.epoch
        state = restarted
        for i in range(steps_per_epoch(rows, world, state.config)):
            state.advance()
            rates.append(state.optimizer.param_groups[0]["lr"])
            if i == 0:
                firsts.append(rates[-1])
        state.end_epoch(epoch)
    assert state.rows == 3 * rows
    assert all(r > 0 for r in rates) and rates == sorted(rates, reverse=True)
    assert firsts[-1] == pytest.approx(base / 3)
    assert rates[-1] < 0.03 * base
