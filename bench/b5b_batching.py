"""B5b batching: does Serve's default batching pay where it can and never cost where it cannot?

Two halves, per reference model:

1. The ceiling: what one ONNX Runtime call on a batch of 16 saves per row over 16 calls of one,
   on this machine (no Ray, no HTTP: the most batching can pay).
2. End to end: the project's Serve application with its default batching (serve.batching.max_batch_size
   16, batch_wait_timeout_s 5 ms, 2 batches in flight, length grouping), in Serve's
   high-throughput mode, vs a hand-written one-call-per-request uvicorn + ONNX Runtime server
   (bench.plain_server --one-call: the same validation, no batcher), wrk at 32 connections, 3
   windows per side alternating; the goal is Serve >= 1.0x plain's req/s, p99 no worse. The
   models are the published artifacts of configs/digits.yaml (CNN), tabular.yaml (MLP),
   text.yaml (Transformer, max_length 32) and the issue's Transformer (text.yaml's data, width
   256, 4 layers, max_length 128: bench.common.TEXT256), on requests of 20-120 tokens.

- digits: the CNN of configs/digits.yaml (8x8 images), tabular: the MLP of configs/tabular.yaml
  (30 features), text: the issue's Transformer (width 256, 4 layers, 4 heads, ff 512,
  max_length 128, vocab 1000) on requests of 20-120 tokens, exported with a free sequence axis,
  batch padded to its own longest row (what the replica does) and, for reference, to 128.

Weights are random (speed does not depend on them); int8 is onnxruntime's dynamic quantization
(this measures the serving machinery around one int8 kernel, not the export's choice); one intra-op thread (a replica with replica_cpus < 2).
The ceiling is ms/row at batch 1 over ms/row at batch 16: above 1, batching can pay here.
`bench/gpu_check.py` records the same on CUDA when a GPU is lent. `value` is the lowest
end-to-end ratio over the models.
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    TEXT256,
    Bench,
    bench_main,
    ensure_artifact,
    median,
    ratio,
    wait_for_quiet,
)

ID = "B5b"
WHAT = (
    "batching: Serve with its default batching vs a one-call-per-request server (wrk, 32 "
    "connections), and ONNX Runtime's batch 1 vs 16 ceiling, per reference model"
)
GOAL = (
    "Serve with its default batching >= 1.0x a plain one-call-per-request server's req/s at 32 "
    "connections, p99 no worse, on every reference model (ceilings recorded per model)"
)
CONNECTIONS = 32
# name -> (workload, overrides, tag): the artifacts served end to end.
SERVED = {
    "digits_cnn": ("digits", (), None),
    "tabular_mlp": ("tabular", (), None),
    "text_transformer": ("text", (), None),
    "text_transformer_256": ("text", TEXT256, "text256"),
}
BATCH = 16
# TransformerClassifier's sizes for the text model.
TEXT = {"dim": 256, "layers": 4, "heads": 4, "ff_dim": 512, "max_length": 128, "vocab_size": 1000}


def models() -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (torch module, {input name: dynamic axes})."""
    from app.models.cnn import ResNetCNN
    from app.models.mlp import MLP
    from app.models.transformer import TransformerClassifier

    text = TransformerClassifier(num_classes=4, dropout=0.0, **TEXT)
    return {
        "digits_cnn": (ResNetCNN(1, 10, widths=[32, 64]), {"x": {0: "batch"}}),
        "tabular_mlp": (MLP(30, 2, hidden=[256, 128]), {"x": {0: "batch"}}),
        "text_transformer": (
            text,
            {
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
            },
        ),
    }


def int8_session(
    module,
    axes: dict[str, Any],
    sample: dict[str, np.ndarray],
    folder: str,
    int8: bool = True,
    providers: list[str] | None = None,
):
    """The module exported to ONNX (int8: dynamically quantized),
    in a one-thread session on `providers` (default: CPU)."""
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from app.export.compile_programs import Positional

    names = list(axes)
    fp32, int8_path = Path(folder) / "m.onnx", Path(folder) / "m.int8.onnx"
    buffer = io.BytesIO()
    torch.onnx.export(
        Positional(module.eval(), names).eval(),
        tuple(torch.from_numpy(sample[n]) for n in names),
        buffer,  # type: ignore[arg-type]
        input_names=names,
        output_names=["logits"],
        dynamic_axes={**axes, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    fp32.write_bytes(buffer.getvalue())
    if int8:
        quantize_dynamic(str(fp32), str(int8_path), weight_type=QuantType.QInt8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    model = str(int8_path if int8 else fp32)
    return ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])


def requests_for(name: str, n: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    if name == "digits_cnn":
        return [{"x": rng.normal(size=(1, 1, 8, 8)).astype(np.float32)} for _ in range(n)]
    if name == "tabular_mlp":
        return [{"x": rng.normal(size=(1, 30)).astype(np.float32)} for _ in range(n)]
    out = []
    for length in rng.integers(20, 121, n):
        ids = np.zeros((1, TEXT["max_length"]), np.int64)
        ids[0, :length] = rng.integers(1, TEXT["vocab_size"], length)
        out.append({"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64)})
    return out


def batch_of(requests: list[dict[str, np.ndarray]], width: int | None) -> dict[str, np.ndarray]:
    batch = {k: np.concatenate([r[k] for r in requests]) for k in requests[0]}
    if "attention_mask" in batch:
        longest = int(batch["attention_mask"].sum(1).max()) if width is None else width
        batch = {k: v[:, :longest] for k, v in batch.items()}
    return batch


def per_row_ms(session, batches: list[dict[str, np.ndarray]], repeats: int) -> float:
    for b in batches[:2]:
        session.run(["logits"], b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rows = 0
        for b in batches:
            session.run(["logits"], b)
            rows += len(next(iter(b.values())))
        times.append(1000 * (time.perf_counter() - start) / rows)
    return median(times)


def ceilings(
    smoke: bool, int8: bool = True, providers: list[str] | None = None, quiet_s: float = 15
) -> tuple[dict[str, Any], list[float]]:
    """Part 1: ONNX Runtime alone, per model, ms/row at batch 1 and at batch 16 (also what
    bench/gpu_check.py records on CUDA: fp32 there, int8 being a CPU format)."""
    rng = np.random.default_rng(0)
    n = 32 if smoke else 256
    repeats = 1 if smoke else 5
    results: dict[str, Any] = {}
    loads = []
    for name, (module, axes) in models().items():
        requests = requests_for(name, n, rng)
        with tempfile.TemporaryDirectory() as folder:
            sample = batch_of(requests[:2], None)
            session = int8_session(module, axes, sample, folder, int8, providers)
            loads.append(wait_for_quiet(0 if smoke else quiet_s))
            alone = [batch_of([r], None) for r in requests]  # each at its own length
            groups = [requests[i : i + BATCH] for i in range(0, n, BATCH)]
            row = {
                "ms_per_row_batch_1": per_row_ms(session, alone, repeats),
                "ms_per_row_batch_16": per_row_ms(
                    session, [batch_of(g, None) for g in groups], repeats
                ),
            }
            if name == "text_transformer":
                row["ms_per_row_batch_16_padded_to_max_length"] = per_row_ms(
                    session, [batch_of(g, TEXT["max_length"]) for g in groups], repeats
                )
            row["ceiling"] = row["ms_per_row_batch_1"] / row["ms_per_row_batch_16"]
            results[name] = row
    return results, loads


def serve_vs_plain(work: Path, smoke: bool) -> dict[str, Any]:
    """Part 2: per served model, Serve (default batching) vs plain one call per request."""
    from bench.b5_serve import busy_note, measure, serve_and_plain, serve_config, summarize_side
    from bench.b5c_litserve import request_bodies

    cfg = serve_config(work)
    logs = work / "b5b-logs"
    logs.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for label, (workload, overrides, tag) in SERVED.items():
        artifact = ensure_artifact(work, workload, smoke, *overrides, tag=tag)["artifact"]
        name, bodies, tokens = request_bodies(artifact)
        encoded = [b.encode() for b in bodies]
        with serve_and_plain(artifact, cfg, name, encoded, logs, label, one_call=True) as (
            urls,
            body_file,
            _,
        ):
            sides_urls = {"plain_one_call": urls["plain"], "serve_batched": urls["serve"]}
            windows, quiet = measure(sides_urls, body_file, smoke, (CONNECTIONS,))
        sides = {k: summarize_side(r) for k, r in windows[CONNECTIONS].items()}
        serve, plain_side = sides["serve_batched"], sides["plain_one_call"]
        out[label] = {
            "artifact": artifact,
            "request_tokens": {"min": min(tokens), "max": max(tokens)} if tokens else None,
            "ratio_rps": ratio(serve["requests_per_s"], plain_side["requests_per_s"]),
            "p99_no_worse": serve["p99_ms"] <= plain_side["p99_ms"],
            "sides": sides,
            "windows_busy": busy_note(quiet),
            "quiet_before_windows": quiet,
        }
    return out


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke)
    results, loads = ceilings(smoke)
    served = serve_vs_plain(work, smoke)
    lowest = min(r["ratio_rps"] for r in served.values())
    met = all(r["ratio_rps"] >= 1.0 and r["p99_no_worse"] for r in served.values())
    details = {
        "serve_vs_plain_at_32_connections": served,
        "ceilings": results,
        "requests_per_model": 32 if smoke else 256,
        "text_model": TEXT,
        "load_averages_before": loads,
        "method": (
            "Ceilings: ONNX Runtime alone, int8 (dynamic quantization), 1 intra-op thread, CPU "
            "provider; batch 1: every request alone at its own length; batch 16: consecutive "
            "groups of 16 requests padded to the group's longest row; median of the repeats. "
            "End to end: the published int8 artifact of each workload, one request per body "
            "(text: one string of 20-120 tokens, capped by the tokenizer's max_length), wrk -c32 "
            "closed loop on 127.0.0.1, 1 s warm-up then 3 windows of 5 s per side alternating; "
            "req/s counts 2xx answers; medians compared."
        ),
    }
    summary = "; ".join(
        f"{k}: Serve {v['sides']['serve_batched']['requests_per_s']:.0f} req/s p99 "
        f"{v['sides']['serve_batched']['p99_ms']:.1f} ms vs plain one-call "
        f"{v['sides']['plain_one_call']['requests_per_s']:.0f} req/s p99 "
        f"{v['sides']['plain_one_call']['p99_ms']:.1f} ms (x{v['ratio_rps']:.2f})"
        for k, v in served.items()
    )
    summary += "; ceilings " + ", ".join(f"{k} x{v['ceiling']:.2f}" for k, v in results.items())
    return bench.result(
        "lowest_serve_batched_vs_plain_one_call_rps_ratio_at_32_connections",
        lowest,
        met,
        details,
        summary,
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
