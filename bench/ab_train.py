"""Training A/B: this checkout's `python -m jobs.train` against an earlier commit's, alternating.

    python -m bench.ab_train --before c97048a [--workload digits] [--runs 3]

Both sides run the real job as a user does, `python -m jobs.train --config
configs/<workload>.yaml`, each with a Ray of its own, from its own source tree (the earlier
commit exported with `git archive` and put first on PYTHONPATH for the job, its Ray and its
workers), on one dataset prepared by this checkout. Runs alternate (ABBA...), each after a quiet
window (1-minute load average), and each side's median steady epoch time (the training loop of
epochs 2..N, slowest rank: the train summary's `epoch_seconds`) is compared: B1's measure, on
the code before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.ab_serve import export_tree
from bench.common import REPO, RESULTS_DIR, Bench, median, wait_for_quiet

ID = "B1_ab"
WHAT = "training: jobs.train of this checkout vs an earlier commit's (alternating)"
GOAL = "after/before steady epoch time <= 1.05"


def run_train(root: Path, config: str, overrides: list[str], log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    with log.open("a") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "jobs.train", "--config", config, *overrides],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            timeout=900,
            check=True,
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier commit")
    p.add_argument("--workload", default="digits")
    p.add_argument("--runs", type=int, default=3, help="runs per side")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-ab-train"))
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(ID, GOAL, WHAT, args.out, smoke=False, doc=__doc__)
    trees = {"before": export_tree(args.before, work / f"before-{args.before}"), "after": REPO}
    config = str(REPO / "configs" / f"{args.workload}.yaml")
    data = [f"data.output={work / 'data'}", f"train.storage_path={work / 'runs'}"]
    subprocess.run(
        [sys.executable, "-m", "jobs.prepare", "--config", config, *data], cwd=REPO, check=True
    )
    epochs: dict[str, list[float]] = {"before": [], "after": []}
    order = [("before", "after") if i % 2 == 0 else ("after", "before") for i in range(args.runs)]
    for i, pair in enumerate(order):
        for side in pair:
            wait_for_quiet()
            name = f"train.run_name=ab-{side}-{i}"
            summary = run_train(trees[side], config, [*data, name], work / f"{side}.log")
            epochs[side].append(summary["epoch_seconds"])
            print(f"{side} run {i}: steady epoch {summary['epoch_seconds']:.3f} s", flush=True)
    before, after = median(epochs["before"]), median(epochs["after"])
    ratio = after / before
    summary = (
        f"{args.workload}: steady epoch before {before:.3f} s, after {after:.3f} s "
        f"(x{ratio:.3f}; medians of {args.runs} alternating runs each)"
    )
    details = {"before": args.before, "workload": args.workload, "epoch_seconds": epochs}
    record = bench.result("after_vs_before_epoch_seconds", ratio, ratio <= 1.05, details, summary)
    print(f"{ID}: {record['summary']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
