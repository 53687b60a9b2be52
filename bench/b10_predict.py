"""B10 batch inference: rows/s of jobs.predict (Ray Data + an ONNX Runtime actor pool) vs the
online endpoint (Ray Serve, the project's app) on the same machine and the same tabular artifact.

- batch: app.predict.driver.predict (what `python -m jobs.predict` runs) on 100,000 rows (5,000 in
  smoke) of breast-cancer-like rows in Parquet, int8 as served; rows/s over the whole stage
  (artifact checks, actor start, read, inference, writing and publishing the output);
- online: build_app with configs/tabular.yaml's serve section (one replica), closed-loop v2 JSON
  infer requests of 1 and of 256 rows from 8 connections (bench.load); rows/s = rows answered
  per second.

Both run in one private 2-CPU Ray, one after the other (the batch job first, then Serve), so
neither competes with the other. A sample of the batch output is also sent to the endpoint and
the answers compared (labels, largest probability difference).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    Bench,
    bench_config,
    bench_main,
    ensure_artifact,
    free_port,
    private_ray,
    wait_for_quiet,
)
from bench.load import closed_loop, wait_ready

ID = "B10"
WHAT = "batch inference: jobs.predict (Ray Data actor pool) vs the online endpoint, rows/s"
GOAL = "jobs.predict rows/s >= the online endpoint's best rows/s"
REQUEST_ROWS = (1, 256)
SAMPLE = 256


def scoring_input(work: Path, config, rows: int) -> tuple[str, list[str]]:
    """`rows` rows drawn from the prepared breast-cancer table with a little noise, ids 0..n-1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.ingest import iter_shards
    from app.data.prepare import read_manifest, split_files

    manifest = read_manifest(config.data_output)
    columns = list(manifest.feature_columns)
    source = next(iter_shards(split_files(config.data_output, manifest, "train")))
    base = source[columns].to_numpy(np.float64)
    rng = np.random.default_rng(0)
    picked = base[rng.integers(0, len(base), rows)] * rng.normal(1.0, 0.02, (rows, len(columns)))
    table = {"id": pa.array(np.arange(rows))} | {c: picked[:, j] for j, c in enumerate(columns)}
    path = work / "b10-input" / "part-0.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(table), path)
    return str(path.parent), columns


def run_batch(config, artifact: str, input_uri: str, work: Path) -> dict[str, Any]:
    from app.predict.driver import predict

    start = time.perf_counter()
    summary = predict(config, artifact, input_uri, str(work / "b10-output"), overwrite=True)
    return {**summary, "wall_s": time.perf_counter() - start}


def infer_body(rows: np.ndarray) -> bytes:
    tensor = {
        "name": "features",
        "datatype": "FP32",
        "shape": list(rows.shape),
        "data": rows.reshape(-1).tolist(),
    }
    return json.dumps({"inputs": [tensor]}).encode()


def run_online(config, artifact: str, sample: np.ndarray, smoke: bool) -> dict[str, Any]:
    from ray import serve

    from app.serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results: dict[str, Any] = {}
    try:
        cfg = config.serve.model_dump(mode="json")
        cfg["autoscaling"].update(min_replicas=1, max_replicas=1)
        app = build_app({"models": [{"name": "tabular", "artifact": artifact}], "serve": cfg})
        serve.run(app, name="b10", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 120)
        infer = f"{url}/v2/models/tabular/infer"
        for n in REQUEST_ROWS:
            load = closed_loop(
                infer,
                infer_body(sample[:n]),
                connections=8,
                duration_s=2.0 if smoke else 8.0,
                warmup_s=0.5 if smoke else 1.0,
                max_requests=5_000 if smoke else 100_000,
            )
            load["rows_per_request"] = n
            load["rows_per_s"] = load["requests_per_s"] * n
            results[f"rows_{n}"] = load
        results["sample_answer"] = _answer(infer, sample)
    finally:
        serve.shutdown()
    return results


def _answer(url: str, rows: np.ndarray) -> dict[str, Any]:
    import requests

    r = requests.post(url, data=infer_body(rows), timeout=60)
    r.raise_for_status()
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    probabilities = np.asarray(outputs["probabilities"]["data"], np.float32).reshape(len(rows), -1)
    return {"labels": outputs["label"]["data"], "probabilities": probabilities}


def compare(output: str, manifest_files: list[str], ids: np.ndarray, online: dict) -> dict:
    """The batch output's rows for `ids` against the endpoint's answer for the same rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables([pq.read_table(f"{output}/{f}") for f in manifest_files])
    index = {int(i): k for k, i in enumerate(table["id"].to_pylist())}
    take = [index[int(i)] for i in ids]
    labels = [table["label"][k].as_py() for k in take]
    probabilities = np.asarray([table["probabilities"][k].as_py() for k in take], np.float32)
    return {
        "rows": len(ids),
        "label_agreement": float(
            np.mean([a == b for a, b in zip(labels, online["labels"], strict=True)])
        ),
        "max_abs_probability_diff": float(np.abs(probabilities - online["probabilities"]).max()),
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    from app.predict.write import verify_output

    bench = Bench(ID, GOAL, WHAT, out, smoke)
    rows = 5_000 if smoke else 100_000
    artifact = ensure_artifact(work, "tabular", smoke)["artifact"]
    config = bench_config(work, "tabular", "predict.max_actors=2")
    input_uri, columns = scoring_input(work, config, rows)
    load_before = wait_for_quiet(60 if smoke else 240)
    with contextlib.ExitStack() as stack:
        ray_info = stack.enter_context(private_ray())
        batch = run_batch(config, artifact, input_uri, work)
        manifest = verify_output(batch["output"])
        import pyarrow.parquet as pq

        source = pq.read_table(f"{input_uri}/part-0.parquet")
        sample = np.stack([source[c].to_numpy()[:SAMPLE] for c in columns], 1).astype(np.float32)
        online = run_online(config, artifact, sample, smoke)
    agreement = compare(
        batch["output"],
        [s.file for s in manifest.files],
        source["id"].to_numpy()[:SAMPLE],
        online.pop("sample_answer"),
    )
    batch_rps = batch["rows"]["input"] / batch["wall_s"]
    best_online = max(v["rows_per_s"] for v in online.values())
    ratio = batch_rps / best_online if best_online else float("nan")
    details = {
        "rows": rows,
        "batch": {
            "rows_per_s": batch_rps,
            "wall_s": batch["wall_s"],
            "rows": batch["rows"],
            "variant": batch["variant"],
            "settings": config.predict.model_dump(mode="json"),
        },
        "online": online,
        "online_best_rows_per_s": best_online,
        "sample_agreement": agreement,
        "ray": ray_info,
        "load_average_before": load_before,
        "method": (
            "One private 2-CPU Ray. The batch side is app.predict.driver.predict, the stage behind "
            "`python -m jobs.predict`, timed from the call to the published manifest (actor "
            "start-up, reading, inference, writing included). The online side is the project's "
            "Serve app (ingress + one int8 replica, configs/tabular.yaml's serve section), "
            "measured with 8 closed-loop connections after a warm-up, requests of 1 and of 256 "
            "rows. The load generator shares the 2 cores. The int8 variant is batch-independent, "
            "so both sides give a row the same answer (sample_agreement)."
        ),
    }
    summary = (
        f"jobs.predict {batch_rps:.0f} rows/s on {rows} rows ({batch['wall_s']:.1f} s) vs online "
        + ", ".join(
            f"{v['rows_per_s']:.0f} rows/s at {v['rows_per_request']} row(s)/request"
            for v in online.values()
        )
        + f" (x{ratio:.1f} the best); sample labels agree "
        + f"{100 * agreement['label_agreement']:.1f}%"
    )
    return bench.result(
        "batch_vs_online_rows_per_s_ratio", ratio, bool(ratio >= 1.0), details, summary
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
