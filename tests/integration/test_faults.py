"""Faults a real run survives: the job's driver killed mid-run and the job resubmitted. (A
worker node lost mid-training: tests/integration/test_elastic.py, where the run goes on with
the workers that fit; a rank that fails: test_train.py.)

The run completes from its last checkpoint, not from scratch; the summary's `resume_history`
(the epochs a restart began at) says where it picked up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app import storage
from tests.conftest import REPO
from tests.integration.conftest import ensure_local_ray

pytestmark = pytest.mark.integration


def checkpoint_epochs(run_dir: Path) -> list[int]:
    """Epochs of the checkpoints already persisted under a run folder."""
    epochs = []
    for meta in run_dir.glob("checkpoint_*/meta.json"):
        try:
            epochs.append(json.loads(meta.read_text())["epoch"])
        except (OSError, ValueError, KeyError):
            continue  # still being written
    return sorted(epochs)


def registered_epoch(run_dir: Path | str) -> int:
    """The newest epoch whose checkpoint Ray Train has registered (0: none yet).

    A checkpoint folder on disk is not enough to resume from: the Train controller registers
    it (in its run snapshot, `checkpoint_manager_snapshot.json`) only after the upload and its
    next poll of the workers, and a restarted or resubmitted run resumes from that snapshot.
    """
    try:  # a local folder or an object-store URI
        snapshot = json.loads(
            storage.read_bytes(storage.join(str(run_dir), "checkpoint_manager_snapshot.json"))
        )
    except (OSError, ValueError):
        return 0
    return max((r["metrics"]["epoch"] for r in snapshot["checkpoint_results"]), default=0)


def wait_for_checkpoint(run_dir: Path, timeout: float, alive=lambda: True) -> int:
    """Wait until a checkpoint of the run is registered; returns the newest registered epoch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if epoch := registered_epoch(run_dir):
            return epoch
        time.sleep(0.1)
    raise AssertionError(f"no registered checkpoint under {run_dir} within {timeout}s")


def job_env() -> dict[str, str]:
    import ray

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # the suite's private cluster
    return env


def train_job(config_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "jobs.train", "--config", "configs/digits.yaml", *config_args]


def test_driver_killed_mid_run_and_resubmitted_resumes(prepared, workspace):
    config = prepared("digits")
    ensure_local_ray()
    args = [
        f"data.output={config.data_output}",
        f"train.storage_path={workspace / 'digits-driver-runs'}",
        "train.epochs=8",
        "train.num_workers=1",  # the driver's death is tested here, not a rank's (test_train.py)
        "train.run_name=digits-driver",
    ]
    run_dir = workspace / "digits-driver-runs" / "digits-driver"
    first = subprocess.Popen(
        train_job(args),
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        killed_after = wait_for_checkpoint(run_dir, 180, lambda: first.poll() is None)
        os.killpg(first.pid, signal.SIGKILL)  # the driver and anything it spawned
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert killed_after < 8, "the run finished before the driver could be killed"
    # Its Train controller and workers die with their owner; the resubmission must find the
    # run's checkpoints and go on from the newest one.
    second = subprocess.run(
        train_job(args), cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["final_epoch"] == 8
    resumed_at = summary["resume_history"][-1]
    # It went on after the newest registered checkpoint at the time of the kill (or a later one).
    assert resumed_at >= killed_after + 1 >= 2
    assert max(checkpoint_epochs(run_dir)) == 8
