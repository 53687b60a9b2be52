"""B5b batching ceiling: what one ONNX Runtime call on a batch of 16 saves per row over 16 calls
of one, per reference model, on this machine (no Ray, no HTTP: the most batching can pay).

- digits: the CNN of configs/digits.yaml (8x8 images), tabular: the MLP of configs/tabular.yaml
  (30 features), text: the issue's Transformer (width 256, 4 layers, 4 heads, ff 512,
  max_length 128, vocab 1000) on requests of 20-120 tokens, exported with a free sequence axis,
  batch padded to its own longest row (what the replica does) and, for reference, to 128.

Weights are random (speed does not depend on them); int8 is onnxruntime's dynamic quantization
(what app.export ships for these models); one intra-op thread (a replica with replica_cpus < 2).
The ceiling is ms/row at batch 1 over ms/row at batch 16: above 1, batching can pay here.
`bench/gpu_check.py` records the same on CUDA when a GPU is lent.
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import main_wrapper, median, wait_for_quiet, write_result

ID = "B5b"
WHAT = "batching ceiling: ONNX Runtime ms/row at batch 1 vs batch 16, per reference model"
GOAL = "recorded per model; Serve with batching >= 1.0x plain one-call-per-request (see details)"
BATCH = 16
TEXT = {"dim": 256, "layers": 4, "heads": 4, "ff_dim": 512, "max_length": 128, "vocab": 1000}


def models() -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (torch module, {input name: dynamic axes})."""
    from app.models.cnn import ResNetCNN
    from app.models.mlp import MLP
    from app.models.transformer import TransformerClassifier

    text = TransformerClassifier(
        vocab_size=TEXT["vocab"],
        num_classes=4,
        dim=TEXT["dim"],
        layers=TEXT["layers"],
        heads=TEXT["heads"],
        ff_dim=TEXT["ff_dim"],
        max_length=TEXT["max_length"],
        dropout=0.0,
    )
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


def int8_session(module, axes: dict[str, Any], sample: dict[str, np.ndarray], folder: str):
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from app.export import _Positional

    names = list(axes)
    fp32, int8 = Path(folder) / "m.onnx", Path(folder) / "m.int8.onnx"
    buffer = io.BytesIO()
    torch.onnx.export(
        _Positional(module.eval(), names).eval(),
        tuple(torch.from_numpy(sample[n]) for n in names),
        buffer,  # type: ignore[arg-type]
        input_names=names,
        output_names=["logits"],
        dynamic_axes={**axes, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    fp32.write_bytes(buffer.getvalue())
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(int8), options, providers=["CPUExecutionProvider"])


def requests_for(name: str, n: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    if name == "digits_cnn":
        return [{"x": rng.normal(size=(1, 1, 8, 8)).astype(np.float32)} for _ in range(n)]
    if name == "tabular_mlp":
        return [{"x": rng.normal(size=(1, 30)).astype(np.float32)} for _ in range(n)]
    out = []
    for length in rng.integers(20, 121, n):
        ids = np.zeros((1, TEXT["max_length"]), np.int64)
        ids[0, :length] = rng.integers(1, TEXT["vocab"], length)
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


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    n = 32 if smoke else 256
    repeats = 1 if smoke else 5
    results: dict[str, Any] = {}
    loads = []
    for name, (module, axes) in models().items():
        requests = requests_for(name, n, rng)
        with tempfile.TemporaryDirectory() as folder:
            session = int8_session(module, axes, batch_of(requests[:2], None), folder)
            loads.append(wait_for_quiet(0 if smoke else 15))
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
    lowest = min(r["ceiling"] for r in results.values())
    details = {
        "models": results,
        "requests_per_model": n,
        "repeats": repeats,
        "text_model": TEXT,
        "load_averages_before": loads,
        "method": (
            "ONNX Runtime alone, int8 (dynamic quantization), 1 intra-op thread, CPU provider. "
            "Batch 1: every request alone at its own length; batch 16: consecutive groups of 16 "
            "requests padded to the group's longest row. Median of the repeats."
        ),
        "serve_vs_plain": (
            "not measured in this run: the end-to-end half of B5b (Serve with its batching vs a "
            "hand-written one-call-per-request server at 32 connections on every reference "
            "model) needs a text artifact exported with a free sequence axis (see README)"
        ),
    }
    summary = ", ".join(
        f"{k}: {v['ms_per_row_batch_1']:.3f} -> {v['ms_per_row_batch_16']:.3f} ms/row "
        f"(ceiling x{v['ceiling']:.2f})"
        for k, v in results.items()
    )
    return write_result(
        ID,
        "lowest_batching_ceiling_over_models",
        lowest,
        GOAL,
        None,
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
