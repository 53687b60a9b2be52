"""B2 ingest: the project's two data paths vs a torch DataLoader over the same shards, same transform.

- streamed: `app.data.feed.StreamFeed` over `app.data.ingest.stream_split` (one rank's stream, as each
  training worker runs it: several read tasks, Ray Data bounded as in training) vs a DataLoader with one worker process; every pass reads the
  Parquet shards and applies the fitted preprocessor (app.data.preprocess) on both sides.
- cached: the in-memory path training takes when the data fits (`app.data.feed.MemoryFeed` filled
  once by `app.data.ingest.read_rank_share` straight from the shards, then reshuffled per epoch) vs
  the DataLoader, which reads and transforms every epoch. Both the steady epochs and the
  filling pass (the same read + transform work as one DataLoader pass) are reported; `value`
  is the worse of the steady ratios.

Rows/s = rows of one full pass / its wall time (start-up included, as in an epoch), median of
the passes, batch 64, taken in quiet windows. Data: configs/stream.yaml's generator (24x24 images).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import (
    Bench,
    bench_config,
    bench_main,
    ensure_prepared,
    median,
    private_ray,
    ratio,
    train_files,
    wait_for_quiet,
)

ID = "B2"
WHAT = "ingest: Ray Data (streamed) and the worker cache (cached) vs torch DataLoader"
GOAL = "Ray/DataLoader rows/s >= 1.0, cached and streamed"
BATCH = 64


def measure(make_iter, passes: int) -> dict[str, Any]:
    rates, first_batch, after_first = [], [], []
    for _ in range(passes):
        start = time.perf_counter()
        rows, first, first_rows = 0, None, 0
        for batch in make_iter():
            n = int(batch["label"].shape[0])
            if first is None:
                first, first_rows = time.perf_counter() - start, n
            rows += n
        elapsed = time.perf_counter() - start
        rates.append(rows / elapsed)
        first_batch.append(first)
        after_first.append((rows - first_rows) / max(elapsed - (first or 0.0), 1e-9))
    return {
        "rows": rows,
        "rows_per_s": rates,
        "median_rows_per_s": median(rates),
        "first_batch_s": first_batch,
        # Throughput once the pipeline runs: start-up (time to the first batch) left out.
        "median_rows_per_s_after_first_batch": median(after_first),
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    from app.data.feed import MemoryFeed, StreamFeed
    from app.data.ingest import read_rank_share, split_shards, stream_split
    from app.train.preprocessing import fit_preprocessor
    from bench.torch_data import TorchShard

    bench = Bench(ID, GOAL, WHAT, out, smoke)
    rows, passes, quiet_s = (1200, 2, 0.0) if smoke else (40000, 3, 240.0)
    config = bench_config(
        work, "stream", f"data.num_rows={rows}", f"data.rows_per_shard={rows // 20}", tag="ingest"
    )
    manifest = ensure_prepared(config)
    pre = fit_preprocessor(config, manifest)
    files = train_files(config, manifest, "train")

    # DataLoader first, before Ray exists in this process (its workers fork).
    shard = TorchShard(files, pre, num_workers=1)
    wait_for_quiet(quiet_s)
    loader = measure(lambda: shard.batches(BATCH), passes)
    with private_ray() as ray_info:
        shards = split_shards(config, manifest, "train")
        # The whole split as one rank (world 1), with that rank's Data budget: half of what two
        # training workers leave free on the private 2-CPU Ray, as in training.
        ds = stream_split(config, shards, pre)
        wait_for_quiet(quiet_s)
        # Training's consumer, unshuffled as the DataLoader side is (training adds a seeded pool
        # shuffle: one concatenation and gather per 2,000 rows).
        stream = StreamFeed(ds, prefetch_batches=4, shuffle_buffer=0)
        streamed = measure(lambda: stream.batches(BATCH), passes)
        feed = MemoryFeed(lambda: read_rank_share(shards, 0, 1, pre))
        wait_for_quiet(quiet_s)
        fill = measure(lambda: feed.batches(BATCH, seed=0), 1)  # the first epoch fills it
        cached = measure(lambda: feed.batches(BATCH, seed=1), passes)
    ratios = {
        "streamed": ratio(streamed["median_rows_per_s"], loader["median_rows_per_s"]),
        "cached": ratio(cached["median_rows_per_s"], loader["median_rows_per_s"]),
        "cached_fill_pass": ratio(fill["median_rows_per_s"], loader["median_rows_per_s"]),
    }
    worst = min(ratios["streamed"], ratios["cached"])
    details = {
        "dataset": f"synthetic_image 24x24, {manifest['rows']['train']} train rows in "
        f"{len(files)} Parquet shards (prepared by app.data.prepare)",
        "batch_size": BATCH,
        "passes": passes,
        "torch_dataloader_1_worker": loader,
        "ray_data_streamed": {**streamed, "task_cpus": config.data.task_cpus},
        "worker_cache_fill_pass": fill,
        "worker_cache_steady": cached,
        "ray": ray_info,
        "ratios": ratios,
    }
    summary = (
        f"Ray/DataLoader rows/s: streamed x{ratios['streamed']:.2f}, cached x{ratios['cached']:.2f} "
        f"(cache fill pass x{ratios['cached_fill_pass']:.2f}); DataLoader "
        f"{loader['median_rows_per_s']:.0f} rows/s"
    )
    return bench.result(
        "ray_vs_dataloader_rows_per_s_ratio (worse of cached, streamed)",
        worst,
        bool(worst >= 1.0),
        details,
        summary,
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
