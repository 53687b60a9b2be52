"""B1 training speed and B9 start-up: `python -m jobs.train` on Ray vs plain PyTorch DDP.

Both sides are run as a user runs them, as separate processes, side by side in one run:
- Ray: `python -m jobs.train --config configs/<workload>.yaml` joining the benchmarks' private
  Ray cluster (the real job: Ray Data, the cache-or-stream decision, TorchTrainer, checkpoints);
- plain DDP: `python -m bench.ddp_train` (2 gloo processes, a DataLoader with its own worker per
  rank) running the very same epoch function, app.train.loop.train_epoch.
Cases: `digits` (its data path is the in-memory cache) and `stream` (configs/stream.yaml, over its
cache budget: streamed). Each case is repeated (ABAB order), each repeat waits for a quiet window
(1-minute load average), and the median of the repeats is reported.

- B1: steady epoch time (training loop of epochs 2..N, slowest rank), Ray / DDP; goal <= 1.05.
- B9: seconds from launch to the first optimizer step, Ray minus DDP; goal <= 8.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    bench_config,
    bench_main,
    ensure_prepared,
    median,
    private_ray,
    ratio,
    wait_for_quiet,
    write_result,
)

WHAT = "training: python -m jobs.train (Ray) vs plain PyTorch DDP, same epoch function"
CASES = {"cached": "digits", "streamed": "stream"}
# Streamed epochs are ~14 s and vary by up to 15% from one process to the next on this shared
# box (plain DDP ran 13.5 s in one repeat and 16 s in the next, every epoch of a run alike), so
# each streamed run reports the median of three steady epochs rather than a single one.
FULL = {"cached": ["train.epochs=6"], "streamed": ["train.epochs=4"]}
SMOKE = {
    "cached": ["train.epochs=2"],
    "streamed": [
        "train.epochs=2",
        "data.num_rows=1200",
        "data.rows_per_shard=200",
        "data.cache_budget_mb=0.5",
    ],
}


def launch(cmd: list[str], summary: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one training process; its summary plus the launch time and wall. A run that fails or
    hangs is run once more, and the failure is kept in the result: the plain DDP baseline has
    aborted ("terminate called without an active exception") and hung in gloo at start here,
    once each in some twenty runs, and one such run should not void a six-minute benchmark."""
    try:
        return launch_once(cmd, summary, env)
    except (RuntimeError, subprocess.TimeoutExpired) as first:
        wait_for_quiet(60)  # what the failed run left behind (a Ray job's actors) winds down
        out = launch_once(cmd, summary, env)
        out["retried_after"] = str(first)[-500:]
        return out


def launch_once(cmd: list[str], summary: Path, env: dict[str, str]) -> dict[str, Any]:
    launched = time.time()
    # Its own process group, so that a hung run is stopped with the processes it started.
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=600)
    except BaseException:  # a hang, or the benchmark itself interrupted: stop the whole group
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} exited {proc.returncode}: {stderr[-2000:]}")
    out = json.loads(summary.read_text())
    out["launched"], out["wall_s"] = launched, time.time() - launched
    out["to_first_step_s"] = out["first_step_at"] - launched
    return out


def one_repeat(
    work: Path, case: str, overrides: list[str], repeat: int, address: str, quiet_s: float
) -> dict[str, Any]:
    return side_by_side(work, CASES[case], overrides, f"b1-{case}", repeat, address, quiet_s)


def side_by_side(
    work: Path,
    workload: str,
    overrides: list[str],
    tag: str,
    repeat: int,
    address: str,
    quiet_s: float,
) -> dict[str, Any]:
    """One repeat: plain DDP, then `jobs.train` on Ray, each after a quiet window."""
    config = bench_config(work, workload, *overrides)
    ensure_prepared(config)
    args = [
        "--config",
        f"configs/{workload}.yaml",
        f"data.output={config.data_output}",
        f"train.storage_path={config.storage_path}",
        "train.log_every_steps=0",
        *overrides,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_ADDRESS=address)
    runs = {}
    for side in ("ddp", "ray"):
        load = wait_for_quiet(quiet_s)
        summary = work / f"{tag}-{side}-{repeat}.json"
        if side == "ray":
            run_name = f"{tag}-{repeat}-{int(time.time())}"
            cmd = [sys.executable, "-m", "jobs.train", *args, f"train.run_name={run_name}"]
        else:
            cmd = [sys.executable, "-m", "bench.ddp_train", *args]
        runs[side] = launch([*cmd, "--summary-file", str(summary)], summary, env)
        runs[side]["load_average_1m_before"] = load
    return runs


def case_result(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    def pick(side: str, key: str) -> list[float]:
        return [r[side][key] for r in repeats]

    ray_epoch, ddp_epoch = (
        median(pick("ray", "epoch_seconds")),
        median(pick("ddp", "epoch_seconds")),
    )
    ray_first, ddp_first = (
        median(pick("ray", "to_first_step_s")),
        median(pick("ddp", "to_first_step_s")),
    )
    return {
        "steady_epoch_s": {"ray": ray_epoch, "ddp": ddp_epoch},
        "ratio_ray_vs_ddp": ratio(ray_epoch, ddp_epoch),
        "to_first_step_s": {"ray": ray_first, "ddp": ddp_first},
        "first_step_gap_s": ray_first - ddp_first,
        "data_wait_fraction": {
            "ray": median(pick("ray", "data_wait_fraction")),
            "ddp": median(pick("ddp", "data_wait_fraction")),
        },
        "val_accuracy": {
            "ray": median([r["ray"]["metrics"]["val_accuracy"] for r in repeats]),
            "ddp": median([r["ddp"]["metrics"]["val_accuracy"] for r in repeats]),
        },
        "data_path": repeats[0]["ray"].get("data_path", {}).get("mode"),
        "repeats": repeats,
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    overrides = SMOKE if smoke else FULL
    cases: dict[str, Any] = {}
    quiet_s = 0.0 if smoke else 240.0
    with private_ray() as ray_info:
        for case in CASES:
            reps = [
                one_repeat(work, case, overrides[case], r, ray_info["address"], quiet_s)
                for r in range(1 if smoke else 3)
            ]
            cases[case] = case_result(reps)
    worst = max(cases.values(), key=lambda c: c["ratio_ray_vs_ddp"])
    gap = max(c["first_step_gap_s"] for c in cases.values())
    mode = "smoke" if smoke else "full"
    method = (
        "Ray side: python -m jobs.train against a running private Ray (cluster start excluded, as "
        "for a user submitting to a running cluster); plain side: python -m bench.ddp_train. Both "
        "call app.train.loop.train_epoch; epoch time = its loop time (first batch request to last "
        "optimizer step, slowest rank), validation and checkpointing excluded. First step = "
        "wall clock of rank 0's first optimizer step minus the process launch. Each side waits "
        "for a 1-minute load average under the quiet threshold before it starts."
    )
    details = {"cases": cases, "ray": ray_info, "method": method}
    summary = ", ".join(
        f"{c} Ray {v['steady_epoch_s']['ray']:.3f}s vs DDP {v['steady_epoch_s']['ddp']:.3f}s "
        f"(x{v['ratio_ray_vs_ddp']:.2f})"
        for c, v in cases.items()
    )
    write_result(
        "B9",
        "launch_to_first_step_ray_minus_ddp_s",
        gap,
        "<= 8 s",
        bool(gap <= 8),
        details={
            c: {"to_first_step_s": v["to_first_step_s"], "gap_s": v["first_step_gap_s"]}
            for c, v in cases.items()
        }
        | {"method": method},
        out_dir=out,
        what="start-up: launch to first optimizer step, jobs.train on Ray vs plain DDP",
        summary=", ".join(
            f"{c} Ray {v['to_first_step_s']['ray']:.1f}s vs DDP {v['to_first_step_s']['ddp']:.1f}s"
            for c, v in cases.items()
        ),
        mode=mode,
        elapsed_s=time.perf_counter() - started,
    )
    return write_result(
        "B1",
        "ray_vs_ddp_steady_epoch_time_ratio (worse case)",
        worst["ratio_ray_vs_ddp"],
        "<= 1.05 for cached and streamed",
        bool(all(c["ratio_ray_vs_ddp"] <= 1.05 for c in cases.values())),
        details,
        out,
        what=WHAT,
        summary=summary,
        mode=mode,
        elapsed_s=time.perf_counter() - started,
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
