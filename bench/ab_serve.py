"""Serving A/B: this checkout's Serve path against an earlier commit's, same artifact, same window.

    python -m bench.ab_serve --before 1b1a0b1 [--workload digits|text|lm] [--connections 1,16,32]

Both sides run B5a's Serve set-up (bench.serve_child: a Ray of its own in Serve's
high-throughput mode, HAProxy in front of the model's one replica), each from its own source
tree (the earlier commit exported with `git archive`, put first on PYTHONPATH for the child, its
Ray and its replicas), on one artifact exported by this checkout. Both stay up for the whole
run, so each side's windows see the other's idle cost. Per connection count: a warm-up window
each, then `--runs` windows per side, alternating (ABBA); the medians are compared.
- digits, text: v2 inference, 5-second wrk windows (after/before req/s, p50).
- lm: B15's served decode loop (its artifact and replica config), streamed `/v1/completions`
  of 96 tokens from closed-loop clients (bench.sse_load), 10-second windows at 16 streams by
  default (after/before output tokens/s, TTFT p50).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.b5_serve import _stop, start_ht_child, wait_child_ready
from bench.b5c_litserve import request_bodies
from bench.b15_generation import PROMPT, trained
from bench.common import REPO, RESULTS_DIR, Bench, ensure_artifact, free_port, median
from bench.load import wrk_run
from bench.sse_load import load

ONE_REPLICA = ("serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=1")
ID = "B5_ab"
WHAT = "the Serve path of this checkout vs an earlier commit's (B5a's set-up, alternating)"
GOAL = "after/before req/s (lm: tokens/s) >= 0.95 at every connection count"
# B15's served loop: its replica admits every stream measured, one replica.
LM_SERVE = (
    "serve.generation.max_streams=64",
    "serve.max_ongoing_requests=64",
    "serve.batching.max_batch_size=16",
    "serve.generation.max_tokens=96",
)
LM_TOKENS = 96


def export_tree(rev: str, into: Path) -> Path:
    """The source tree of `rev` (tracked files only), for the earlier side."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def serve_config_of(root: Path, work: Path, workload: str) -> dict[str, Any]:
    """configs/<workload>.yaml's serve section, one replica, as the code in `root` reads it (keys
    have moved)."""
    code = (
        "import json, sys; from bench.common import bench_config; "
        "print(json.dumps(bench_config(*sys.argv[1:]).serve.model_dump(mode='json')))"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    overrides = (*ONE_REPLICA, *(LM_SERVE if workload == "lm" else ()))
    cmd = [sys.executable, "-c", code, str(work), workload, *overrides]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def side_by_side(
    before: Path, artifact: str, work: Path, workload: str, runs: int, conns: list[int]
) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """{connections: {"before"|"after": [window, ...]}} with both sides up throughout."""
    logs = work / "logs"
    name = "lm"
    if workload != "lm":
        body_file = logs / f"bodies_{workload}.jsonl"
        name, bodies, _ = request_bodies(artifact)
        body_file.write_text("\n".join(bodies) + "\n")

    completion = {"model": name, "prompt": PROMPT, "max_tokens": LM_TOKENS, "temperature": 1.0}

    def window(side: str, connections: int, seconds: float) -> dict[str, Any]:
        if workload == "lm":  # streams last longer than a request: windows twice as long
            port = int(urls[side].rsplit(":", 1)[1])
            body = completion | {"stream": True}
            return load("127.0.0.1", port, "/v1/completions", body, connections, 2 * seconds)
        return wrk_run(urls[side], str(body_file), connections, seconds)

    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for side, root in (("before", before), ("after", REPO)):
            port, scratch = free_port(), tempfile.mkdtemp(prefix=f"ab-{side}-")
            cfg, log = serve_config_of(root, work, workload), logs / f"serve_{side}.log"
            child = start_ht_child(artifact, cfg, port, scratch, log, name, root=root)
            stack.callback(_stop, child)
            wait_child_ready(child, 300, log)
            urls[side] = (
                f"http://127.0.0.1:{port}"
                if workload == "lm"
                else f"http://127.0.0.1:{port}/v2/models/{name}/infer"
            )
        windows: dict[int, dict[str, list[dict[str, Any]]]] = {}
        for c in conns:
            for side in urls:
                window(side, c, 1.0)  # warm-up
            for i in range(runs):
                for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    windows.setdefault(c, {}).setdefault(side, []).append(window(side, c, 5.0))
    return windows


def lm_artifact(work: Path) -> str:
    """B15's language model (configs/lm.yaml trained briefly, int8 served), made once per --work."""
    steps = ["train.epochs=1", "train.max_steps_per_epoch=40"]
    return trained(work, "lm", "lm", steps)[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier commit")
    p.add_argument("--workload", default="digits", choices=["digits", "text", "lm"])
    p.add_argument("--connections", default=None, help="default: 1,16,32 (lm: 16)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-ab"))
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    work = Path(args.work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    bid = ID if args.workload == "digits" else f"{ID}_{args.workload}"
    bench = Bench(bid, GOAL, WHAT, args.out, smoke=False, doc=__doc__)
    lm = args.workload == "lm"
    artifact = lm_artifact(work) if lm else ensure_artifact(work, args.workload, False)["artifact"]
    before = export_tree(args.before, work / f"before-{args.before}")
    conns = [int(c) for c in (args.connections or ("16" if lm else "1,16,32")).split(",")]
    windows = side_by_side(before, artifact, work, args.workload, args.runs, conns)
    rate, latency, unit = (
        ("tokens_per_s", "ttft_p50_ms", "tok/s") if lm else ("requests_per_s", "p50_ms", "req/s")
    )
    sides = {
        c: {
            side: {
                rate: median([w[rate] for w in runs]),
                latency: median([w[latency] for w in runs]),
                "errors": sum(w["failed"] if lm else w["errors"] + w["non_2xx"] for w in runs),
                "runs": runs,
            }
            for side, runs in by_side.items()
        }
        for c, by_side in windows.items()
    }
    ratios = {c: s["after"][rate] / s["before"][rate] for c, s in sides.items()}
    summary = "; ".join(
        f"c={c}: before {s['before'][rate]:.0f} {unit} p50 {s['before'][latency]:.2f} ms, "
        f"after {s['after'][rate]:.0f} {unit} p50 {s['after'][latency]:.2f} ms "
        f"(x{ratios[c]:.3f})"
        for c, s in sides.items()
    )
    met = all(r >= 0.95 for r in ratios.values())
    details = {"before": args.before, "workload": args.workload, "by_connections": sides}
    record = bench.result(
        f"after_vs_before_{rate}_min", min(ratios.values()), met, details, summary
    )
    print(f"{bid}: {record['summary']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
