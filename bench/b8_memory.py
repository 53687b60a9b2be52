"""B8 streaming memory: peak memory of an ingest-only training pass when the data grows 10x.

configs/stream.yaml's generator at N rows and at 10N rows (both over the cache budget, so both
stream), shards of the workload's own `data.rows_per_shard` (10x the data is 10x the files).
Each size runs in a fresh private Ray: the training job's trainer (app.ray_private.lean_torch_trainer) with
2 workers whose loop pulls one epoch of batches through the feed training uses (app.train.worker.feed:
each rank streams its share, app.data.ingest.stream_split + app.data.feed.StreamFeed) and updates no model. A sampler sums the proportional set
size (PSS: shared pages, the object store's included, counted once) of this process and every
process under it (GCS, raylet, object store, workers, Ray Data tasks) every 0.2 s.
Goal: peak(10N) / peak(N) <= 1.2: streaming memory must not grow with the dataset.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    Bench,
    bench_config,
    bench_main,
    ratio,
    wait_for_quiet,
)
from bench.load import process_tree

ID = "B8"
GOAL = "peak memory at 10x the data <= 1.2x"
WHAT = "streaming memory: ingest-only pass through 2 train workers, data x10"


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """Samples the PSS of processes (this process tree, or those `processes` names: pid ->
    role) in a background thread; `peak` in bytes, `peak_by_kind`: where that peak sat, summed
    per role (what to fix when it grows), and each role's own first and largest sample
    (`first_by_kind`, `max_by_kind`)."""

    def __init__(
        self, interval: float = 0.2, processes: Callable[[], dict[int, str]] | None = None
    ):
        self.interval, self.peak, self.samples = interval, 0, 0
        self.processes = processes or (lambda: process_tree(os.getpid()))
        self.peak_by_kind: dict[str, int] = {}
        self.first_by_kind: dict[str, int] = {}
        self.max_by_kind: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            by_kind: dict[str, int] = {}
            for pid, kind in self.processes().items():
                by_kind[kind] = by_kind.get(kind, 0) + pss_bytes(pid)
            total = sum(by_kind.values())
            for kind, size in by_kind.items():
                self.first_by_kind.setdefault(kind, size)
                self.max_by_kind[kind] = max(self.max_by_kind.get(kind, 0), size)
            if total > self.peak:
                self.peak, self.peak_by_kind = total, by_kind
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def ingest_loop(loop_config: dict[str, Any]) -> None:
    import ray.train

    from app.config import validate
    from app.data import kinds
    from app.train.worker import feed

    config = validate(loop_config["config"])
    ctx = ray.train.get_context()
    pre = kinds.from_json(loop_config["preprocessor"])
    train = feed(
        config, loop_config["shards"], True, pre, ctx.get_world_rank(), ctx.get_world_size()
    )
    rows = sum(len(b["label"]) for b in train.batches(config.train.batch_size, seed=0))
    ray.train.report({"rows": rows})


def ingest_pass(config) -> dict[str, Any]:
    import ray
    import ray.train

    from app.config import dump
    from app.data.ingest import split_shards
    from app.data.prepare import read_manifest
    from app.ray_private import lean_torch_trainer
    from app.ray_runtime import init_private_ray
    from app.train.preprocessing import fit_preprocessor

    manifest = read_manifest(config.data_output)
    pre = fit_preprocessor(config, manifest)
    init_private_ray()
    try:
        with PeakMemory() as memory:
            start = time.perf_counter()
            trainer = lean_torch_trainer(pg_cleaner=False)(
                ingest_loop,
                train_loop_config={
                    "config": dump(config),
                    "preprocessor": pre.to_json(),
                    "shards": split_shards(config, manifest, "train"),
                },
                scaling_config=ray.train.ScalingConfig(
                    num_workers=2, resources_per_worker={"CPU": config.train.cpus_per_worker}
                ),
                run_config=ray.train.RunConfig(storage_path=config.storage_path),
            )
            result = trainer.fit()
            elapsed = time.perf_counter() - start
    finally:
        ray.shutdown()
    return {
        "train_rows": manifest["rows"]["train"],
        "error": str(result.error) if result.error else None,
        "peak_pss_bytes": memory.peak,
        "peak_pss_mib_by_process": {
            k: round(v / 2**20, 1)
            for k, v in sorted(memory.peak_by_kind.items(), key=lambda kv: -kv[1])
        },
        "samples": memory.samples,
        "pass_s": elapsed,
    }


def prepare_elsewhere(config) -> None:
    """`jobs.prepare` in its own process: generating the rows must not leave its heap in the
    process tree whose memory is measured."""
    import subprocess
    import sys

    from app.config import dump

    if (Path(config.data_output) / "manifest.json").exists():
        return
    d = dump(config)["data"]
    overrides = [f"data.{k}={d[k]}" for k in ("num_rows", "rows_per_shard", "output")]
    cmd = [sys.executable, "-m", "jobs.prepare", "--config", "configs/stream.yaml", *overrides]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=1200)


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    base = 1000 if smoke else 40000
    sizes = {}
    for scale in (1, 10):
        rows = base * scale
        # Only the row count grows: shards keep the workload's own size (configs/stream.yaml's
        # data.rows_per_shard), so 10x the data is 10x the shard files, as it is for a user.
        config = bench_config(
            work, "stream", f"data.num_rows={rows}", "data.cache=stream", tag=f"stream-{scale}x"
        )
        prepare_elsewhere(config)
        wait_for_quiet(0.0 if smoke else 240.0)
        sizes[f"{scale}x"] = ingest_pass(config)
    growth = ratio(sizes["10x"]["peak_pss_bytes"], sizes["1x"]["peak_pss_bytes"])
    summary = (
        f"peak PSS {sizes['1x']['peak_pss_bytes'] / 2**20:.0f} MiB at {base} rows, "
        f"{sizes['10x']['peak_pss_bytes'] / 2**20:.0f} MiB at {10 * base} rows (x{growth:.2f})"
    )
    return bench.result(
        "peak_memory_ratio_10x_vs_1x",
        growth,
        bool(growth <= 1.2),
        {"sizes": sizes},
        summary,
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
