"""B21 programs: torch eager vs AOTInductor vs ONNX Runtime fp32 / int8 vs ExecuTorch fp32 / int8.

Each reference workload (tabular MLP, digits CNN, text Transformer) is trained briefly in-process
and exported with `export.formats=[onnx,aoti,executorch]`; the build time of each program is
the export report's. Latency: median of single synchronous calls on real val rows resized to
batch 1 and 32, with one and two threads (ONNX Runtime intra-op threads, torch.set_num_threads
for eager and AOTInductor; ExecuTorch's XNNPACK threadpool is its own, so its two columns are the
same program measured twice). `auto`: the variant export chose by rows/s at
`serve.batching.max_batch_size` rows (one thread), against the fastest of the three servable
variants re-measured here, median of three rounds.

Goals: for every model `auto` picks a servable variant within 5% of the fastest; at fp32 and
batch 1 the fastest compiled variant (AOTInductor or ONNX fp32) is >= 1.2x torch eager.
Pretrained BERT-family and ViT folders are not measured (no weights can be downloaded here).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common import Bench, bench_config, bench_main, ensure_artifact, ratio

ID = "B21"
WHAT = "programs: torch eager vs AOTInductor vs ONNX Runtime vs ExecuTorch, per model"
GOAL = (
    "auto within 5% of the fastest servable variant; fastest compiled fp32 >= 1.2x eager at batch 1"
)
WORKLOADS = ("tabular", "digits", "text")
FORMATS = "export.formats=[onnx,aoti,executorch]"


def sessions(artifact: Any, checkpoint: str, threads: int) -> dict[str, Any]:
    import torch

    from app.evaluate.held_out import torch_predict
    from app.tasks.classify.compiled import open_program
    from app.train.checkpoint import load_checkpoint

    torch.set_num_threads(threads)
    eager = torch_predict(load_checkpoint(checkpoint).model)
    out: dict[str, Any] = {
        "torch_eager": _Eager(eager),
        "onnx_fp32": artifact.session("fp32", threads),
        "onnx_int8": artifact.session("int8", threads),
    }
    names = {"aoti": "model.pt2", "executorch": "model.pte", "executorch_int8": "model.int8.pte"}
    for variant, name in names.items():
        if name in artifact.programs:
            out[variant] = open_program(
                variant, artifact.programs[name], artifact.preprocessor, threads
            )
    return out


class _Eager:
    def __init__(self, predict):
        self.predict = predict

    def run(self, _outputs, feeds):
        return [self.predict(feeds)]


MEMORY_PROBE = """
import sys, numpy as np
from app.runtime.artifact import open_artifact, run_logits
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
artifact = open_artifact(sys.argv[1])
pre = artifact.preprocessor
inputs = pre.features(pre.sample_rows())
inputs = {k: np.repeat(v, 16, axis=0) for k, v in inputs.items()}
before = rss()
session = artifact.session(sys.argv[2])
run_logits(session, inputs)
print(rss() - before)
"""


def replica_memory_mib(uri: str) -> dict[str, float]:
    """Resident MiB a replica's session of each servable variant adds (loaded and called once,
    in a fresh process: torch's own libraries count against `aoti`)."""
    import subprocess
    import sys

    out = {}
    for variant in ("fp32", "int8", "aoti"):
        done = subprocess.run(
            [sys.executable, "-c", MEMORY_PROBE, uri, variant],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        out[variant] = round(float(done.stdout.strip().splitlines()[-1]), 1)
    return out


def measure_workload(work: Path, workload: str, smoke: bool) -> dict[str, Any]:
    import torch

    from app.evaluate.held_out import labeled_batches
    from app.export.measure import median_call_s, resized, rows_per_s
    from app.runtime.artifact import open_artifact

    info = ensure_artifact(work, workload, smoke, FORMATS, tag=f"{workload}-programs")
    artifact = open_artifact(info["artifact"])
    report = artifact.report
    config = bench_config(work, workload, tag=f"{workload}-programs")
    sample, _ = next(iter(labeled_batches(config, artifact.preprocessor, "val", batch_rows=64)))
    repeats = 10 if smoke else 50
    latency: dict[str, dict[str, float]] = {}
    for threads in (1, 2):
        for variant, session in sessions(artifact, info["checkpoint"], threads).items():
            for batch in (1, 32):
                seconds = median_call_s(session, resized(sample, batch), repeats)
                latency.setdefault(variant, {})[f"batch_{batch}_threads_{threads}"] = 1000 * seconds
    torch.set_num_threads(1)
    servable = {
        k: v
        for k, v in sessions(artifact, info["checkpoint"], 1).items()
        if k in ("onnx_fp32", "onnx_int8", "aoti")
    }
    rows = report["serving"]["batch_rows"]
    rounds = [
        {v: rows_per_s(s, sample, rows, repeats) for v, s in servable.items()} for _ in range(3)
    ]
    speeds = {v: statistics.median(r[v] for r in rounds) for v in servable}
    chosen = {"fp32": "onnx_fp32", "int8": "onnx_int8", "aoti": "aoti"}[report["serving"]["auto"]]
    fastest = max(speeds, key=speeds.__getitem__)
    b1 = "batch_1_threads_1"
    compiled = min(latency[v][b1] for v in ("onnx_fp32", "aoti") if v in latency)
    return {
        "latency_ms": latency,
        "build_s": {v: p.get("build_s") for v, p in report["programs"].items()},
        "published": {v: p["published"] for v, p in report["programs"].items()},
        "sizes": {v: p.get("size_bytes") for v, p in report["programs"].items()},
        "serving_rows_per_s": speeds,
        "auto": chosen,
        "fastest": fastest,
        "auto_over_fastest": ratio(speeds[chosen], speeds[fastest]),
        "compiled_over_eager_batch1": ratio(latency["torch_eager"][b1], compiled),
        "export_s": info["export_s"],
        "replica_memory_mib": replica_memory_mib(info["artifact"]),
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    models = {w: measure_workload(work, w, smoke) for w in WORKLOADS}
    worst_auto = min(m["auto_over_fastest"] for m in models.values())
    worst_compiled = min(m["compiled_over_eager_batch1"] for m in models.values())
    met = bool(worst_auto >= 0.95 and worst_compiled >= 1.2)
    parts = [
        f"{w}: auto {m['auto']} x{m['auto_over_fastest']:.2f} of fastest {m['fastest']}, "
        f"compiled fp32 b1 x{m['compiled_over_eager_batch1']:.2f} eager"
        for w, m in models.items()
    ]
    details = {"models": models, "worst_auto_over_fastest": worst_auto}
    return bench.result(
        "compiled_over_eager_batch1_min", worst_compiled, met, details, "; ".join(parts)
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
