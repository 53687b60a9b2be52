"""B20 batch image embedding: `jobs.predict` on a folder of pictures vs a single-process loop that
decodes each picture and runs the same exported image graph with ONNX Runtime, pictures/s.

The retrieval model is configs/retrieval.yaml's, trained briefly (prepare, train and export
run as subprocesses, as a user runs them) once per workspace. The pictures are generated here:
`PICTURES` 256x256 JPEGs of the same kind of scenes, in ten subfolders. `jobs.predict --input
FOLDER` runs as a user runs it, a subprocess starting its own local Ray on every core (its
tasks name the pictures, its actors read, decode and embed them). The peer is one process, one
ONNX Runtime thread: every picture read, decoded and preprocessed by the artifact's own
preprocessor, embedded 64 at a time, the embeddings written to Parquet. Median of 3 each.
Goal: jobs.predict pictures/s >= 0.8x the peer's times the cores (its own time, from its
summary; the wall time, with Ray's start and exit, reported beside it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, Bench, bench_main, median, ratio, wait_for_quiet

ID = "B20"
GOAL = "jobs.predict pictures/s >= 0.8x a one-process ONNX Runtime loop x cores"
WHAT = "batch image embedding: jobs.predict on a folder vs a one-process decode + ORT loop"
PICTURES, SMOKE_PICTURES = 10_000, 300
TRAIN = ["data.num_rows=600", "train.epochs=2", "train.num_workers=1", "export.parity_rows=32"]


def job(module: str, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_ADDRESS": "local"}
    cmd = [sys.executable, "-m", f"jobs.{module}", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"jobs.{module} exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def artifact(work: Path, *extra: str, saved: str = "artifact.json") -> str:
    """configs/retrieval.yaml (with `extra` overrides) trained briefly and exported, once per
    workspace (`saved` remembers it)."""
    remembered = work / saved
    if remembered.exists():
        return json.loads(remembered.read_text())["artifact"]
    config = ["--config", "configs/retrieval.yaml", *TRAIN, *extra]
    config += [f"data.output={work}/data", f"train.storage_path={work}/runs"]
    config += [f"export.registry={work}/registry"]
    job("prepare", *config)
    trained = job("train", *config)
    exported = job("export", *config, "--checkpoint", trained["checkpoint"])
    remembered.write_text(json.dumps({"artifact": exported["artifact"]}))
    return exported["artifact"]


def generate(folder: Path, count: int) -> None:
    import io

    import numpy as np
    from PIL import Image

    from app.data.pictures import _scene, draw

    rng = np.random.default_rng(0)
    for i in range(count):
        png = draw(_scene(rng), 256, rng)
        path = folder / f"part{i % 10}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        Image.open(io.BytesIO(png)).convert("RGB").save(buffer, "JPEG", quality=90)
        path.write_bytes(buffer.getvalue())


def predict_job(uri: str, folder: Path, output: Path) -> dict[str, Any]:
    started = time.perf_counter()
    summary = job("predict", "--artifact", uri, "--input", str(folder), "--output", str(output))
    return {"seconds": time.perf_counter() - started, "summary": summary}


def peer_job(uri: str, folder: Path, output: Path, variant: str) -> dict[str, Any]:
    started = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "bench.b20_embed",
        "--peer",
        uri,
        str(folder),
        str(output),
        variant,
    ]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=1800)
    return {"seconds": time.perf_counter() - started}


def peer(uri: str, folder: str, output: str, variant: str) -> None:
    """One process, one thread: read, decode, preprocess, embed 64 at a time, write."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.kinds.image_text import decode, require
    from app.runtime.artifact import open_artifact

    art = open_artifact(uri)
    pre = require(art.preprocessor)
    session = art.session(variant, 1, "image")
    names = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*.jpg"))
    ids, vectors = [], []
    for start in range(0, len(names), 64):
        chunk = names[start : start + 64]
        pixels = [pre.picture_pixels(decode((Path(folder) / n).read_bytes())) for n in chunk]
        vectors.append(session.run(["embedding"], {"pixels": pre.stacked(pixels)})[0])
        ids += chunk
    flat = np.concatenate(vectors).astype(np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    Path(output).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "embedding": column}), Path(output) / "part.parquet")


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    import shutil

    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    uri = artifact(work)
    count = SMOKE_PICTURES if smoke else PICTURES
    folder = work / f"pictures-{count}"
    if not folder.exists():
        generate(folder, count)
    runs: dict[str, list[dict[str, Any]]] = {"predict": [], "peer": []}
    for r in range(3):
        wait_for_quiet(120.0)
        runs["predict"].append(predict_job(uri, folder, work / f"out-predict-{r}"))
        variant = runs["predict"][-1]["summary"]["variant"]
        wait_for_quiet(120.0)
        runs["peer"].append(peer_job(uri, folder, work / f"out-peer-{r}", variant))
        for side in ("predict", "peer"):
            shutil.rmtree(work / f"out-{side}-{r}", ignore_errors=True)
    cores = os.cpu_count() or 1
    in_job = median([r["summary"]["elapsed_s"] for r in runs["predict"]])
    wall = median([r["seconds"] for r in runs["predict"]])
    peer_s = median([r["seconds"] for r in runs["peer"]])
    speed = ratio(count / in_job, cores * count / peer_s)
    details = {
        "pictures": count,
        "predict_per_s": count / in_job,
        "predict_wall_per_s": count / wall,
        "peer_per_s": count / peer_s,
        "wall_ratio_to_peer_x_cores": ratio(count / wall, cores * count / peer_s),
        "variant": variant,
        "runs": runs,
    }
    summary = (
        f"{count:,} 256x256 JPEGs: jobs.predict {count / in_job:,.0f} pictures/s in the job "
        f"({count / wall:,.0f} with Ray's start and exit) vs one process {count / peer_s:,.0f}: "
        f"x{speed:.2f} of the peer x {cores} cores ({variant})"
    )
    return bench.result(
        "pictures_per_s_vs_peer_x_cores", speed, bool(speed >= 0.8), details, summary
    )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--peer":
        peer(*sys.argv[2:6])
    else:
        bench_main(run, __doc__)()
