"""B24 prepare, tables: `jobs.prepare` on a table source vs a single-process pyarrow script
doing the same read + split + write + hash, rows/s and memory as the data grows.

The data is generated here (30 float32 columns + a label, in 10 Parquet files of 100k-row row
groups; CSV files of the same rows at the CSV sizes) and deleted after each size. `jobs.prepare`
runs as a user runs it, a subprocess starting its own local Ray on every core
(`data.source=table`, `data.rows_per_shard=500000`: a million-row-scale dataset of 1000-row
shards would be 100k files). The peer (`peer`, below, run as a subprocess too) reads the same
files batch by batch, hashes each row as prepare does (pandas' stable row hash), splits by the
same rule, writes Parquet shards of the same size and sha256s them: one core. A sampler sums
the PSS of the job's process tree every 0.2 s: the driver (the job's own process) and the rest
(GCS, raylet, object store, the Ray Data task processes). Median of 3 per side at the smallest
size; one run each at larger sizes (each takes minutes on 2 cores). `B24_MAX_ROWS` caps the
sizes; `B24_MIN_ROWS` runs only the sizes from it up and keeps the smaller ones from the last
result file (marked `from_earlier_run`).
Goals: rows/s >= 0.8x the peer's times the cores (the job's own time, from its summary: the
wall time adds Ray's start and exit, reported beside it); the driver's and the workers' peaks
at the largest size <= 1.2x those at the smallest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.b8_memory import PeakMemory, pss_bytes
from bench.common import REPO, Bench, bench_main, median, ratio, wait_for_quiet
from bench.load import process_tree

ID = "B24"
GOAL = "rows/s >= 0.8x a one-process pyarrow peer x cores; peaks at the largest size <= 1.2x"
WHAT = "prepare, tables: jobs.prepare (Ray Data tasks) vs a single-process pyarrow script"
COLUMNS = 30
ROWS_PER_SHARD = 500_000


def generate(folder: Path, rows: int, fmt: str) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per_file = rows // 10
    for f in range(10):
        rng = np.random.default_rng(f)
        written = 0
        path = folder / f"part-{f:02d}.{fmt}"
        writer = None
        while written < per_file:
            n = min(100_000, per_file - written)
            columns = {f"x{i}": rng.standard_normal(n, np.float32) for i in range(COLUMNS)}
            columns["label"] = pa.array(np.char.add("c", (rng.integers(0, 10, n)).astype(str)))
            table = pa.table(columns)
            if fmt == "parquet":
                writer = writer or pq.ParquetWriter(path, table.schema)
                writer.write_table(table, row_group_size=100_000)
            else:
                import pyarrow.csv as pcsv

                with open(path, "ab") as out:
                    pcsv.write_csv(table, out, pcsv.WriteOptions(include_header=written == 0))
            written += n
        if writer is not None:
            writer.close()


def measured(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs `cmd`, sampling its process tree's memory: wall time, its summary (last stdout
    line), peak PSS of the driver (the process itself) and of everything under it."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    driver = {"peak": 0}

    def processes() -> dict[int, str]:
        tree = process_tree(proc.pid)
        driver["peak"] = max(driver["peak"], pss_bytes(proc.pid))
        return {pid: name for pid, name in tree.items() if pid != proc.pid}

    with PeakMemory(processes=processes) as workers:
        out, err = proc.communicate(timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}: {err[-2000:]}")
    return {
        "seconds": seconds,
        "summary": json.loads(out.strip().splitlines()[-1]),
        "driver_peak_pss_mib": driver["peak"] / 2**20,
        "workers_peak_pss_mib": workers.peak / 2**20,
        "workers_by_process_mib": {k: round(v / 2**20, 1) for k, v in workers.peak_by_kind.items()},
    }


def prepare_job(source: Path, output: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "jobs.prepare",
        "--config",
        "configs/tabular.yaml",
        "data.source=table",
        f"data.path={source}",
        f"data.output={output}",
        f"data.rows_per_shard={ROWS_PER_SHARD}",
    ]
    # A local Ray of the job's own (no running cluster joined): its processes are the job's.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return measured(cmd, env | {"RAY_ADDRESS": "local"})


def peer_job(source: Path, output: Path) -> dict[str, Any]:
    return measured([sys.executable, "-m", "bench.b24_prepare", "--peer", str(source), str(output)])


def peer(source: str, output: str) -> None:
    """One process: every file's batches read, rows hashed and split, shards written, hashed."""
    import hashlib

    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from app.data.pieces import SplitRule

    rule, rows = SplitRule(0, 0.2, 0.0), 0
    pending: dict[int, list[pa.Table]] = {0: [], 1: []}
    counts, shards = {0: 0, 1: 0}, 0

    def flush(code: int, n: int) -> None:
        nonlocal shards
        table = pa.concat_tables(pending[code]).combine_chunks()
        path = Path(output) / f"{code}-{shards:05d}.parquet"
        pq.write_table(table.slice(0, n), path)
        hashlib.sha256(path.read_bytes()).hexdigest()
        rest = table.slice(n)
        pending[code], counts[code], shards = (
            ([rest] if rest.num_rows else []),
            rest.num_rows,
            shards + 1,
        )

    Path(output).mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(source).iterdir()):
        if path.suffix == ".parquet":
            batches = pq.ParquetFile(path).iter_batches(65_536)
        else:
            batches = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=16 << 20))
        for batch in batches:
            table = pa.Table.from_batches([batch])
            features = {c: pa.compute.cast(table[c], pa.float64()) for c in table.column_names[:-1]}
            clean = pa.table({**features, "label": table["label"]})
            keys = pd.util.hash_pandas_object(clean.to_pandas(), index=False).to_numpy(np.uint64)
            codes = rule.codes(keys)
            for code in (0, 1):
                pending[code].append(clean.filter(pa.array(codes == code)))
                counts[code] += int((codes == code).sum())
                while counts[code] >= ROWS_PER_SHARD:
                    flush(code, ROWS_PER_SHARD)
            rows += table.num_rows
    for code in (0, 1):
        if counts[code]:
            flush(code, counts[code])
    print(json.dumps({"rows": rows}))


def one_size(work: Path, rows: int, fmt: str, repeats: int) -> dict[str, Any]:
    source = work / f"{fmt}-{rows}"
    generate(source, rows, fmt)
    try:
        runs: dict[str, list[dict[str, Any]]] = {"prepare": [], "peer": []}
        for r in range(repeats):
            for side, job in (("prepare", prepare_job), ("peer", peer_job)):
                out = work / f"out-{side}-{r}"
                wait_for_quiet(120.0)
                runs[side].append(job(source, out))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(source, ignore_errors=True)
    cores = os.cpu_count() or 1
    prepare_s = median([r["seconds"] for r in runs["prepare"]])
    in_job_s = median([r["summary"]["throughput"]["seconds"] for r in runs["prepare"]])
    peer_s = median([r["seconds"] for r in runs["peer"]])
    return {
        "rows": rows,
        "format": fmt,
        "prepare_rows_per_s": rows / prepare_s,
        "prepare_in_job_rows_per_s": rows / in_job_s,
        "ray_start_and_exit_s": prepare_s - in_job_s,
        "peer_rows_per_s": rows / peer_s,
        "ratio_to_peer_x_cores": ratio(rows / prepare_s, cores * rows / peer_s),
        "in_job_ratio_to_peer_x_cores": ratio(rows / in_job_s, cores * rows / peer_s),
        "driver_peak_pss_mib": max(r["driver_peak_pss_mib"] for r in runs["prepare"]),
        "workers_peak_pss_mib": max(r["workers_peak_pss_mib"] for r in runs["prepare"]),
        "runs": runs,
    }


def describe(results: list[dict[str, Any]], driver: float, workers: float) -> str:
    sizes = "; ".join(
        f"{r['format']} {r['rows']:,} rows x{r['in_job_ratio_to_peer_x_cores']:.2f} "
        f"({r['prepare_in_job_rows_per_s']:,.0f} vs peer {r['peer_rows_per_s']:,.0f} rows/s; "
        f"wall x{r['ratio_to_peer_x_cores']:.2f} with {r['ray_start_and_exit_s']:.0f} s of Ray "
        "start and exit)"
        for r in results
    )
    parquet = [r for r in results if r["format"] == "parquet"]
    return (
        f"rows/s vs peer x cores: {sizes}; peaks {parquet[0]['rows']:,} -> "
        f"{parquet[-1]['rows']:,} rows: driver x{driver:.2f}, workers x{workers:.2f}"
    )


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    sizes = (
        [(20_000, "parquet"), (20_000, "csv")]
        if smoke
        else [
            (1_000_000, "parquet"),
            (10_000_000, "parquet"),
            (100_000_000, "parquet"),
            (1_000_000, "csv"),
            (10_000_000, "csv"),
        ]
    )
    limit = int(os.environ.get("B24_MAX_ROWS", "0")) or None
    least = int(os.environ.get("B24_MIN_ROWS", "0"))
    results = [
        one_size(work, rows, fmt, 3 if rows == sizes[0][0] else 1)
        for rows, fmt in sizes
        if (limit is None or rows <= limit) and rows >= least
    ]
    if least:  # the smaller sizes as the last full run measured them (each side by side)
        earlier = json.loads((Path(out) / f"{ID}.json").read_text())["details"]["sizes"]
        kept = [r | {"from_earlier_run": True} for r in earlier if r["rows"] < least]
        results = sorted(kept + results, key=lambda r: (r["format"] != "parquet", r["rows"]))
    parquet = [r for r in results if r["format"] == "parquet"]
    small, large = parquet[0], parquet[-1]
    # Judged on the job's own time (its summary: plan, both passes, the manifest); the wall
    # time adds Ray's start and exit, a constant reported beside it.
    speed = min(r["in_job_ratio_to_peer_x_cores"] for r in results)
    driver = ratio(large["driver_peak_pss_mib"], small["driver_peak_pss_mib"])
    workers = ratio(large["workers_peak_pss_mib"], small["workers_peak_pss_mib"])
    met = bool(speed >= 0.8 and driver <= 1.2 and workers <= 1.2)
    summary = describe(results, driver, workers)
    details = {"sizes": results, "largest_run": f"{large['rows']:,} rows"}
    return bench.result("rows_per_s_vs_peer_x_cores", speed, met, details, summary)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--peer":
        peer(sys.argv[2], sys.argv[3])
    else:
        bench_main(run, __doc__)()
