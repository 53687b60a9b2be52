"""Early stopping on a real 2-worker run: both ranks leave after the same epoch (a rank that
went on would wait forever in the next report), and the summary says where and why."""

from __future__ import annotations

import pytest

from app.train.driver import train
from tests.integration.conftest import workload_config

pytestmark = pytest.mark.integration


def test_two_ranks_stop_together_when_val_loss_stops_improving(prepared, workspace, ray_local):
    prepared("digits")
    # No gain can beat a min_delta of 1000, so epoch 1 stays the best and patience 1 runs out
    # after epoch 2, whatever the losses are.
    config = workload_config(
        workspace,
        "digits",
        "train.epochs=6",
        "train.early_stopping_patience=1",
        "train.early_stopping_min_delta=1000",
        "train.run_name=digits-early-stop",
    )
    summary = train(config)
    assert summary["final_epoch"] == 2
    assert [m["epoch"] for m in summary["history"]] == [1, 2]
    assert summary["early_stopping"] == {
        "metric": "val_loss",
        "mode": "min",
        "patience": 1,
        "stopped": True,
        "stopped_after_epoch": 2,
        "best_epoch": 1,
    }
    # The checkpoint the summary names is the best of the epochs run, by train.checkpoint_metric.
    best = max(m["val_accuracy"] for m in summary["history"])
    assert summary["metrics"]["val_accuracy"] == best
    assert summary["epoch"] in (1, 2)
