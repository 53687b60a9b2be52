"""Training on a real local Ray: accuracy bars, bf16, a survived fault, resume by run name."""

from __future__ import annotations

import json
import os
import re

import pytest

from app.errors import ConfigError
from app.train.driver import check_precision, train
from tests.fault_hooks import fail_at
from tests.integration.conftest import workload_config

pytestmark = pytest.mark.integration
FAST = ["train.epochs=5", "train.log_every_steps=1000"]


def run_metrics(run_dir: str) -> list[dict]:
    """Per-epoch metrics of every kept checkpoint, in epoch order."""
    metas = []
    for entry in os.listdir(run_dir):
        meta = os.path.join(run_dir, entry, "meta.json")
        if entry.startswith("checkpoint_") and os.path.exists(meta):
            with open(meta) as f:
                metas.append(json.load(f)["metrics"])
    return sorted(metas, key=lambda m: m["epoch"])


@pytest.fixture(scope="module")
def digits_fp32(trained):
    return trained("digits")


@pytest.fixture(scope="module")
def ray_local_module():
    from tests.integration.conftest import ensure_local_ray

    ensure_local_ray()


def test_digits_two_workers_reach_the_bar_and_loss_falls(digits_fp32):
    config, summary = digits_fp32
    assert summary["num_workers"] == 2
    assert summary["metrics"]["val_accuracy"] >= 0.97
    history = run_metrics(os.path.join(config.storage_path, summary["run_name"]))
    assert [m["epoch"] for m in history] == [1, 2, 3, 4, 5]
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]
    assert len(set(summary["worker_nodes"])) == 1  # one local node, two ranks
    assert os.path.exists(os.path.join(summary["checkpoint"], "model.safetensors"))


def test_cached_run_never_waits_for_data(digits_fp32):
    _, summary = digits_fp32
    assert summary["data_path"]["mode"] == "memory"
    assert "fits the cache budget" in summary["data_path"]["reason"]
    assert len(summary["data_wait_history"]) == 5
    assert summary["data_wait_fraction"] < 0.10


def test_streamed_run_survives_a_killed_rank_and_reaches_the_cached_runs_accuracy(
    digits_fp32, workspace, prepared
):
    """One run for two behaviours (a Ray Train run's start-up is most of a short run's cost):
    `data.cache: auto` streams a dataset over its budget, and rank 1 killed at epoch 3 is
    restarted from the last checkpoint, the stream going on from there."""
    _, cached = digits_fp32
    # A budget below the dataset's size: `data.cache: auto` must stream it.
    config = workload_config(
        workspace,
        "digits",
        *FAST,
        "data.cache_budget_mb=0.1",
        # Room for a restart this test did not cause (a worker group that fails to come up
        # once on a loaded box is retried as well).
        "train.max_failures=3",
        "train.run_name=digits-stream",
    )
    run_dir = os.path.join(config.storage_path, "digits-stream")
    fail_at(run_dir, rank=1, epoch=3)  # tests/fault_hooks.py, installed in every worker
    streamed = train(config)
    # Restarted workers went on from a checkpoint, not from scratch: epoch 2's, or epoch 1's if
    # the controller had not yet polled epoch 2's report when rank 1 died (Ray Train registers a
    # checkpoint only when it polls; a rank that dies first takes the report with it).
    assert streamed["resume_history"], "the run restarted from scratch"
    assert streamed["resume_history"][-1] in (2, 3)
    assert streamed["final_epoch"] == 5
    assert "fail-rank1-epoch3" not in os.listdir(run_dir)  # it fired
    assert streamed["data_path"]["mode"] == "stream"
    assert "over the cache budget" in streamed["data_path"]["reason"]
    assert streamed["metrics"]["val_accuracy"] >= 0.97
    # Same seed, same model and steps; only the batch order differs: within noise.
    gap = abs(streamed["metrics"]["val_accuracy"] - cached["metrics"]["val_accuracy"])
    assert gap <= 0.02


def test_bf16_within_one_point_of_fp32(digits_fp32, workspace, prepared):
    _, fp32 = digits_fp32
    config = workload_config(
        workspace, "digits", *FAST, "train.precision=bf16", "train.run_name=digits-bf16"
    )
    bf16 = train(config)
    assert bf16["precision"] == "bf16"
    assert abs(bf16["metrics"]["val_accuracy"] - fp32["metrics"]["val_accuracy"]) <= 0.01


# Slow (make test-all): resuming by run name is what test_faults.py's killed-driver run does.
@pytest.mark.slow
def test_same_run_name_resumes_instead_of_restarting(prepared, workspace, ray_local_module):
    prepared("digits")
    first = train(
        workload_config(workspace, "digits", "train.epochs=1", "train.run_name=digits-resume")
    )
    assert first["final_epoch"] == 1 and first["resume_history"] == []
    second = train(
        workload_config(workspace, "digits", "train.epochs=2", "train.run_name=digits-resume")
    )
    assert second["resume_history"] == [2]  # continued after epoch 1
    assert second["final_epoch"] == 2


@pytest.mark.unit
def test_fp16_without_cuda_is_refused_before_any_work(workspace):
    config = workload_config(workspace, "digits", "train.precision=fp16")
    with pytest.raises(ConfigError, match="train.precision: fp16 needs CUDA"):
        check_precision(config)


def test_workers_that_never_fit_fail_after_bounded_tries_naming_the_resources(
    prepared, workspace, ray_local_module, monkeypatch
):
    """Eight workers at 0.5 CPU on a 2-CPU Ray never start: the run gives up after a bounded
    number of start-up timeouts (Ray's default retries forever) with one line saying what
    it needed and what the cluster had."""
    from app.errors import UserError

    prepared("digits")
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "2")
    config = workload_config(
        workspace, "digits", *FAST, "train.num_workers=8", "train.run_name=digits-too-wide"
    )
    with pytest.raises(UserError) as failed:
        train(config)
    message = str(failed.value)
    assert "\n" not in message
    assert "8 workers did not start in 3 tries" in message
    assert "CPU 4 together" in message and re.search(r"CPU [\d.]+ free of 2\b", message)
    from app.ray_private import wait_for_job_actors

    assert wait_for_job_actors("TrainController", timeout_s=0) == []  # the failed run's ended
