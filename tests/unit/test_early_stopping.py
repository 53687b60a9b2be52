"""Early stopping's decision (app/train/loop.py): a pure function of the reported per-epoch metrics."""

from __future__ import annotations

import math

import pytest

from app.train.loop import best_index, should_stop_early

pytestmark = pytest.mark.unit


def history(key: str, values: list[float]) -> list[dict]:
    return [{"epoch": i + 1, key: v} for i, v in enumerate(values)]


def test_val_loss_rising_for_patience_epochs_stops(config_factory):
    config = config_factory("train.early_stopping_patience=2")
    assert config.train.early_stopping_metric == "val_loss"
    assert config.train.early_stopping_mode == "min"
    rising = [0.9, 0.5, 0.4, 0.45, 0.47]  # best at epoch 3, two epochs without improvement
    assert not should_stop_early(history("val_loss", rising[:4]), config)
    assert should_stop_early(history("val_loss", rising), config)


def test_an_improvement_resets_the_count(config_factory):
    config = config_factory("train.early_stopping_patience=2")
    assert not should_stop_early(history("val_loss", [0.9, 0.95, 0.5, 0.6]), config)


def test_no_patience_never_stops(config_factory):
    config = config_factory()
    assert config.train.early_stopping_patience is None
    assert not should_stop_early(history("val_loss", [0.1, 0.2, 0.3, 0.4, 0.5]), config)


def test_accuracy_is_maximised(config_factory):
    config = config_factory(
        "train.early_stopping_patience=1",
        "train.early_stopping_metric=val_accuracy",
        "train.early_stopping_mode=max",
    )
    assert not should_stop_early(history("val_accuracy", [0.5, 0.6, 0.7]), config)
    assert should_stop_early(history("val_accuracy", [0.5, 0.7, 0.7]), config)  # equal: no gain


def test_min_delta_ignores_tiny_gains(config_factory):
    config = config_factory(
        "train.early_stopping_patience=2", "train.early_stopping_min_delta=0.01"
    )
    assert should_stop_early(history("val_loss", [0.5, 0.499, 0.498]), config)
    assert not should_stop_early(history("val_loss", [0.5, 0.499, 0.45]), config)


def test_best_index_first_of_equals_and_nan_never_best():
    assert best_index([0.3, 0.2, 0.2, 0.25], "min") == 1
    assert best_index([math.nan, 0.4, math.nan], "min") == 1
    assert best_index([0.4, math.nan, math.nan], "min") == 0


def test_unknown_metric_or_bad_patience_is_a_config_error(config_factory):
    from app.errors import ConfigError
    from app.registry import check_metric, task_named

    # Any metric the task reports: checked against the run's task before any worker starts.
    config = config_factory("train.early_stopping_metric=val_f1", "train.early_stopping_patience=2")
    with pytest.raises(ConfigError, match="train.early_stopping_metric"):
        check_metric(config, task_named("classify"))
    with pytest.raises(ConfigError, match="train.early_stopping_patience"):
        config_factory("train.early_stopping_patience=0")
