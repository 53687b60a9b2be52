"""B2 ingest: Ray Data `iter_torch_batches` (app.data.load_split) vs a torch DataLoader over the same
Parquet shards with the same fitted preprocessor (app.preprocess), with and without shuffling;
plus the data-wait fraction inside a real Ray training run (app.train's `data_wait_fraction`).

Both pipelines stream the train split shard by shard, transform 256 rows at a time with the
preprocessor (as load_split's map_batches does) and hand out torch batches of the training batch
size (32). Shuffling means a 2000-row local shuffle buffer on both sides (train.shuffle_buffer).
Every pass is timed from the iterator's creation to its last batch, so a pipeline's start-up
counts, as it does in each training epoch. The DataLoader baseline is the faster of
num_workers=0 and num_workers=1 (one background loader process, like Ray Data's tasks).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import (
    bench_config,
    ensure_prepared,
    main_wrapper,
    median,
    private_ray,
    ratio,
    steady,
    train_files,
    write_result,
)

ID = "B2"
WHAT = "ingest: Ray Data iter_torch_batches vs torch DataLoader (same shards, same transform)"
GOAL = "Ray/DataLoader rows/s >= 1.0; in-training data wait < 10%"
BATCH = 32
SHUFFLE_BUFFER = 2000


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
    from app.data import fit_preprocessor, load_split
    from bench.b1_train import epochs_for, ray_train_run
    from bench.torch_data import TorchShard

    started = time.perf_counter()
    rows = 2000 if smoke else 20000
    passes = 1 if smoke else 3
    config = bench_config(
        work,
        "digits",
        "data.source=synthetic_image",
        f"data.num_rows={rows}",
        "data.image_size=16",
        "data.rows_per_shard=1000",
        "data.num_classes=4",
        tag="ingest",
    )
    manifest = ensure_prepared(config)
    pre = fit_preprocessor(config, manifest)
    files = train_files(config, manifest, "train")

    # DataLoader first, before Ray exists in this process (its workers fork).
    torch_results: dict[str, Any] = {}
    for workers in (0, 1):
        shard = TorchShard(files, pre, num_workers=workers)
        for shuffle in (False, True):
            buffer = SHUFFLE_BUFFER if shuffle else None
            torch_results[f"workers{workers}_{'shuffle' if shuffle else 'ordered'}"] = measure(
                lambda s=shard, b=buffer: s.iter_torch_batches(
                    batch_size=BATCH, local_shuffle_buffer_size=b, local_shuffle_seed=0
                ),
                passes,
            )
    ray_results: dict[str, Any] = {}
    with private_ray() as ray_info:
        ds = load_split(config, "train", pre, manifest)
        for shuffle in (False, True):
            buffer = SHUFFLE_BUFFER if shuffle else None
            ray_results["shuffle" if shuffle else "ordered"] = measure(
                lambda b=buffer: ds.iter_torch_batches(
                    batch_size=BATCH, local_shuffle_buffer_size=b, local_shuffle_seed=0
                ),
                passes,
            )
        training = ray_train_run(work, epochs_for(smoke))
    waits = [h["metrics"]["data_wait_fraction"] for h in training["history"]]
    steady_wait = steady(waits)

    ratios = {}
    for mode in ("ordered", "shuffle"):
        best = max(torch_results[f"workers{w}_{mode}"]["median_rows_per_s"] for w in (0, 1))
        ratios[mode] = ratio(ray_results[mode]["median_rows_per_s"], best)
    worst = min(ratios.values())
    met = bool(worst >= 1.0 and steady_wait < 0.10)
    details = {
        "dataset": f"synthetic_image 16x16, {manifest['rows']['train']} train rows in "
        f"{len(files)} Parquet shards (prepared by app.prepare)",
        "batch_size": BATCH,
        "shuffle_buffer": SHUFFLE_BUFFER,
        "passes": passes,
        "ray_data": {**ray_results, **ray_info, "task_cpus": config.data.task_cpus},
        "torch_dataloader": torch_results,
        "ratios_ray_vs_best_dataloader": ratios,
        "in_training": {
            "workload": "digits, 2 Ray Train workers (the B1 Ray run)",
            "data_wait_fraction_per_epoch": waits,
            "steady_data_wait_fraction": steady_wait,
        },
        "method": (
            "rows/s = rows of one full pass / its wall time, iterated on the driver (Ray) or the "
            "main process (DataLoader); median of the passes. first_batch_s is each pass's start-up "
            "(Ray Data plans and launches a streaming execution per pass, i.e. per epoch); "
            "median_rows_per_s_after_first_batch leaves it out. The in-training figure is app.train's "
            "own data_wait_fraction (time blocked on the next batch / train-loop time, rank 0), "
            "median over epochs after the first."
        ),
    }
    summary = (
        f"Ray/DataLoader rows/s ordered x{ratios['ordered']:.2f}, shuffled x{ratios['shuffle']:.2f} "
        f"(Ray {ray_results['ordered']['median_rows_per_s']:.0f} rows/s, "
        f"{median(ray_results['ordered']['first_batch_s']):.1f}s to its first batch per pass); "
        f"in-training data wait {100 * steady_wait:.0f}%"
    )
    return write_result(
        ID,
        "ray_vs_dataloader_rows_per_s_ratio_min",
        worst,
        GOAL,
        met,
        details,
        out,
        what=WHAT,
        summary=summary,
        mode="smoke" if smoke else "full",
        elapsed_s=time.perf_counter() - started,
    )


def main(argv=None) -> None:
    main_wrapper(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
