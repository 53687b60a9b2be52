"""B25 prepare, pictures: `jobs.prepare` on an image folder and on an image_text table of the
same pictures vs single-process PIL scripts doing the same work, pictures/s and memory as the
set grows.

The pictures are generated here (640x480 JPEGs, quality 85, smooth scenes of about 30 KB, ten
class folders) and deleted after each size. The image folder is prepared at
`data.image_size=224` (decode, resize, uint8 pixels); the image_text table (a CSV of relative
paths and a caption each) keeps the encoded bytes after a decode check. `jobs.prepare` runs as
a user runs it, a subprocess starting its own local Ray on every core. The peers (subprocesses
too, one core): the folder's decodes each picture the same way (JPEG draft scale, RGB, resize),
splits by the same rule and writes and hashes Parquet shards of the same size; the table's reads
each file, decodes it to check it, and writes and hashes shards of the bytes. Memory as in B24:
the driver's peak PSS and the summed peak of the rest of the job's process tree.
Goals: pictures/s >= 0.8x the peer's times the cores (the job's own time, from its summary);
peaks at the largest size <= 1.2x those at the smallest. Median of 3 at 10k pictures, one run at
100k; `B25_MAX_PICTURES` caps the sizes, `B25_MIN_PICTURES` runs only those from it up and keeps
the smaller ones from the last result file (marked `from_earlier_run`).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.b24_prepare import measured
from bench.common import Bench, bench_main, median, ratio, wait_for_quiet

ID = "B25"
GOAL = "pictures/s >= 0.8x a one-process PIL peer x cores; peaks at the largest size <= 1.2x"
WHAT = "prepare, pictures: jobs.prepare (Ray Data tasks) vs single-process PIL scripts"
SIZE = 224
ROWS_PER_SHARD = 1000
CLASSES = 10


def picture(seed: int) -> bytes:
    """A smooth 640x480 scene: a gradient ground and a few filled shapes."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:480, 0:640]
    base = rng.integers(0, 255, 3)
    ground = (base + 0.2 * x[..., None] * rng.random(3) + 0.2 * y[..., None] * rng.random(3)) % 255
    img = Image.fromarray(ground.astype(np.uint8), "RGB")
    pen = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.integers(0, 560), rng.integers(0, 400)
        box = (x0, y0, x0 + rng.integers(20, 80), y0 + rng.integers(20, 80))
        pen.ellipse(box, fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=85)
    return buffer.getvalue()


def _write(args: tuple[Path, int, int]) -> None:
    folder, start, stop = args
    for i in range(start, stop):
        (folder / f"class{i % CLASSES}" / f"{i:07d}.jpg").write_bytes(picture(i))


def generate(folder: Path, count: int) -> None:
    """`count` pictures in ten class folders, and `pairs.csv` naming each with a caption."""
    for c in range(CLASSES):
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
    step = 500
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(_write, [(folder, s, min(count, s + step)) for s in range(0, count, step)]))
    with open(folder / "pairs.csv", "w") as f:
        f.write("image,caption\n")
        for i in range(count):
            f.write(f"class{i % CLASSES}/{i:07d}.jpg,picture number {i}\n")


def prepare_job(kind: str, source: Path, output: Path) -> dict[str, Any]:
    if kind == "folder":
        data = ["configs/digits.yaml", "data.source=imagefolder", f"data.path={source}"]
        data.append(f"data.image_size={SIZE}")
    else:
        data = ["configs/retrieval.yaml", "data.source=image_text"]
        data.append(f"data.path={source / 'pairs.csv'}")
    cmd = [sys.executable, "-m", "jobs.prepare", "--config", *data]
    cmd += [f"data.output={output}", f"data.rows_per_shard={ROWS_PER_SHARD}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return measured(cmd, env | {"RAY_ADDRESS": "local"})


def peer_job(kind: str, source: Path, output: Path) -> dict[str, Any]:
    module = [sys.executable, "-m", "bench.b25_pictures", "--peer", kind]
    return measured([*module, str(source), str(output)])


def peer(kind: str, source: str, output: str) -> None:
    """One process: every picture read (and decoded), split, written to shards, hashed."""
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from app.data.pieces import SplitRule, row_keys

    rule = SplitRule(0, 0.2, 0.0)
    pending: dict[int, list[Any]] = {0: [], 1: []}
    shards = 0

    def flush(code: int) -> None:
        nonlocal shards
        values, pending[code] = pending[code], []
        if kind == "folder":  # a row's uint8 pixels as its bytes, as prepare stores them
            column = pa.array([v.tobytes() for v in values], pa.large_binary())
        else:
            column = pa.array(values, pa.binary())
        path = Path(output) / f"{code}-{shards:05d}.parquet"
        pq.write_table(pa.table({"image": column}), path)
        hashlib.sha256(path.read_bytes()).hexdigest()
        shards += 1

    Path(output).mkdir(parents=True, exist_ok=True)
    names = sorted(str(p.relative_to(source)) for p in Path(source).glob("class*/*.jpg"))
    codes = rule.codes(row_keys(pa.table({"path": names}), ["path"]))
    for name, code in zip(names, codes.tolist(), strict=True):
        path = Path(source) / name
        if kind == "folder":
            with Image.open(path) as img:
                img.draft("RGB", (SIZE, SIZE))
                value = np.asarray(img.convert("RGB").resize((SIZE, SIZE)), np.uint8)
            value = value.transpose(2, 0, 1).reshape(-1)
        else:
            value = path.read_bytes()
            with Image.open(io.BytesIO(value)) as img:
                img.convert("RGB")
        pending[code].append(value)
        if len(pending[code]) >= ROWS_PER_SHARD:
            flush(code)
    for code in (0, 1):
        if pending[code]:
            flush(code)
    print(json.dumps({"rows": len(names)}))


def one_size(work: Path, count: int, repeats: int) -> list[dict[str, Any]]:
    source = work / f"pictures-{count}"
    generate(source, count)
    out: list[dict[str, Any]] = []
    try:
        for kind in ("folder", "table"):
            runs: dict[str, list[dict[str, Any]]] = {"prepare": [], "peer": []}
            for r in range(repeats):
                for side, job in (("prepare", prepare_job), ("peer", peer_job)):
                    output = work / f"out-{side}-{r}"
                    wait_for_quiet(120.0)
                    runs[side].append(job(kind, source, output))
                    shutil.rmtree(output, ignore_errors=True)
            out.append(summarise(kind, count, runs))
    finally:
        shutil.rmtree(source, ignore_errors=True)
    return out


def summarise(kind: str, count: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    prepare_s = median([r["seconds"] for r in runs["prepare"]])
    in_job_s = median([r["summary"]["throughput"]["seconds"] for r in runs["prepare"]])
    peer_s = median([r["seconds"] for r in runs["peer"]])
    return {
        "pictures": count,
        "kind": kind,
        "prepare_in_job_per_s": count / in_job_s,
        "ray_start_and_exit_s": prepare_s - in_job_s,
        "peer_per_s": count / peer_s,
        "ratio_to_peer_x_cores": ratio(count / prepare_s, cores * count / peer_s),
        "in_job_ratio_to_peer_x_cores": ratio(count / in_job_s, cores * count / peer_s),
        "driver_peak_pss_mib": max(r["driver_peak_pss_mib"] for r in runs["prepare"]),
        "workers_peak_pss_mib": max(r["workers_peak_pss_mib"] for r in runs["prepare"]),
        "runs": runs,
    }


def describe(results: list[dict[str, Any]], peaks: dict[str, tuple[float, float]]) -> str:
    sizes = "; ".join(
        f"{r['kind']} {r['pictures']:,} x{r['in_job_ratio_to_peer_x_cores']:.2f} "
        f"({r['prepare_in_job_per_s']:,.0f} vs peer {r['peer_per_s']:,.0f} pictures/s; "
        f"driver {r['driver_peak_pss_mib']:,.0f} MiB, workers {r['workers_peak_pss_mib']:,.0f} MiB)"
        for r in results
    )
    growth = ", ".join(f"{k} driver x{d:.2f} workers x{w:.2f}" for k, (d, w) in peaks.items())
    return f"pictures/s vs peer x cores: {sizes}; peaks smallest -> largest: {growth}"


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    sizes = [300] if smoke else [10_000, 100_000]
    limit = int(os.environ.get("B25_MAX_PICTURES", "0")) or None
    least = int(os.environ.get("B25_MIN_PICTURES", "0"))
    results = [
        r
        for count in sizes
        if (limit is None or count <= limit) and count >= least
        for r in one_size(work, count, 3 if count == sizes[0] else 1)
    ]
    if least:  # the smaller sizes as the last full run measured them (each side by side)
        earlier = json.loads((Path(out) / f"{ID}.json").read_text())["details"]["sizes"]
        kept = [r | {"from_earlier_run": True} for r in earlier if r["pictures"] < least]
        results = sorted(kept + results, key=lambda r: r["pictures"])
    peaks = {}
    for kind in ("folder", "table"):
        mine = [r for r in results if r["kind"] == kind]
        small, large = mine[0], mine[-1]
        peaks[kind] = (
            ratio(large["driver_peak_pss_mib"], small["driver_peak_pss_mib"]),
            ratio(large["workers_peak_pss_mib"], small["workers_peak_pss_mib"]),
        )
    speed = min(r["in_job_ratio_to_peer_x_cores"] for r in results)
    growth = max(max(d, w) for d, w in peaks.values())
    met = bool(speed >= 0.8 and growth <= 1.2 and len({r["pictures"] for r in results}) > 1)
    details = {"sizes": results, "largest_run": f"{results[-1]['pictures']:,} pictures"}
    return bench.result(
        "pictures_per_s_vs_peer_x_cores", speed, met, details, describe(results, peaks)
    )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--peer":
        peer(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        bench_main(run, __doc__)()
