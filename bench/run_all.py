"""Run the benchmarks and print their ratios; `make bench` runs this, then renders the table in
bench/README.md.

    python -m bench.run_all [--smoke] [--out DIR] [--only B1,B3] [--work DIR] [--no-render]

Each benchmark runs in its own process (fresh interpreter, its own torch thread settings) and
writes `<out>/<id>.json`. They share one scratch folder (prepared data, the B1 training run that B2
reuses, exported artifacts) and one private Ray cluster started here (`address="local"`: never the
machine's default cluster), whose address they get in $BENCH_RAY_ADDRESS. A benchmark that fails
or runs out of time still gets a result file (met false, the error in details) and makes the exit
code 1. Full mode writes bench/results/*.json and then updates the table in bench/README.md (bench.render);
smoke mode writes to bench/results/smoke/ (or --out) and renders nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (
    RAY_ADDRESS_ENV,
    RAY_INIT_S_ENV,
    REPO,
    RESULTS_DIR,
    SMOKE_DIR,
    setup_logging,
    workspace,
    write_result,
)


@dataclass(frozen=True)
class Benchmark:
    module: str
    what: str
    needs_ray: bool
    timeout_s: int
    smoke_timeout_s: int


def load_benchmarks() -> dict[str, Benchmark]:
    import yaml

    table = yaml.safe_load(Path(__file__).with_name("benchmarks.yaml").read_text())
    return {bid: Benchmark(**entry) for bid, entry in table.items()}


BENCHMARKS = load_benchmarks()


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, seconds each; results outside bench/results",
    )
    p.add_argument(
        "--out", help="results folder (default bench/results, smoke: bench/results/smoke)"
    )
    p.add_argument("--only", help="comma-separated ids, e.g. B1,B3")
    p.add_argument("--work", help="scratch folder to keep (default: a temporary one)")
    p.add_argument(
        "--no-render", action="store_true", help="do not update the table in bench/README.md"
    )
    args = p.parse_args(argv)
    args.out = args.out or str(SMOKE_DIR if args.smoke else RESULTS_DIR)
    known = {b.upper(): b for b in BENCHMARKS}  # any case: b5a, B5A and B5a are B5a
    asked = [i.strip() for i in (args.only or ",".join(BENCHMARKS)).split(",") if i.strip()]
    ids = [known.get(i.upper(), i) for i in asked]
    unknown = [i for i in ids if i not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    args.ids = ids
    return args


def start_shared_ray() -> tuple[str, float]:
    import ray

    from app.ray_runtime import init_private_ray

    start = time.perf_counter()
    init_private_ray()
    return ray.get_runtime_context().gcs_address, time.perf_counter() - start


def last_line(log: Path, prefix: str) -> str | None:
    if not log.exists():
        return None
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith(prefix)]
    return lines[-1] if lines else None


def run_one(
    bid: str, args: argparse.Namespace, work: Path, env: dict[str, str]
) -> tuple[bool, float]:
    bench = BENCHMARKS[bid]
    timeout = bench.smoke_timeout_s if args.smoke else bench.timeout_s
    log = work / "logs" / f"{bid}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", bench.module, "--out", args.out, "--work", str(work)] + (
        ["--smoke"] if args.smoke else []
    )
    result_file = Path(args.out) / f"{bid}.json"
    before = result_file.stat().st_mtime if result_file.exists() else None
    start = time.perf_counter()
    print(f"== {bid} {bench.what} ...", flush=True)
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
            error = None if rc == 0 else f"exited with code {rc}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout}s"
            _kill_group(proc)
    elapsed = time.perf_counter() - start
    wrote = result_file.exists() and result_file.stat().st_mtime != before
    if error is None and not wrote:
        error = "finished without writing its result"
    if error is not None:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        write_result(
            bid,
            "error",
            None,
            "",
            False,
            {"error": error, "log_tail": tail},
            args.out,
            what=bench.what,
            summary=f"FAILED: {error}",
            mode="smoke" if args.smoke else "full",
            elapsed_s=elapsed,
        )
        print(f"{bid}: FAILED ({error}); last output:\n{tail[-1500:]}", file=sys.stderr, flush=True)
        return False, elapsed
    print(last_line(log, f"{bid}:") or f"{bid}: done", f"({elapsed:.0f}s)", flush=True)
    return True, elapsed


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a benchmark process this run started, and its children (its own session)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv=None) -> None:
    args = parse(argv)
    setup_logging()
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ok_all, times = True, {}
    with workspace(args.work) as work:
        shared_ray = any(BENCHMARKS[i].needs_ray for i in args.ids)
        if shared_ray:
            address, init_s = start_shared_ray()
            env.update({RAY_ADDRESS_ENV: address, RAY_INIT_S_ENV: f"{init_s:.3f}"})
            # ray.init turns token authentication on for the cluster it starts (in this process's
            # environment); the benchmark processes need the same mode to join it.
            if os.environ.get("RAY_AUTH_MODE"):
                env["RAY_AUTH_MODE"] = os.environ["RAY_AUTH_MODE"]
            print(
                f"private Ray for the benchmarks at {address} (started in {init_s:.1f}s)",
                flush=True,
            )
        try:
            for bid in args.ids:
                ok, times[bid] = run_one(bid, args, work, env)
                ok_all = ok_all and ok
        finally:
            if shared_ray:
                import ray

                ray.shutdown()
    total = time.perf_counter() - started
    print(
        f"benchmarks: {', '.join(f'{k} {v:.0f}s' for k, v in times.items())}; total {total:.0f}s"
        f" ({'smoke' if args.smoke else 'full'} mode, results in {args.out})",
        flush=True,
    )
    if not args.smoke and not args.no_render and Path(args.out).resolve() == RESULTS_DIR.resolve():
        from bench.render import render

        render(args.out)
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
