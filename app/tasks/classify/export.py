"""Task `classify`'s export parts (app/export/exporter.py runs the flow): one graph, `logits` of
the preprocessor's inputs; int8 found by a search over quantization methods and fp32 layers,
gated on validation accuracy; its programs in app/tasks/classify/compiled.py.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

import numpy as np
import torch
from torch import nn

from app.config import Config
from app.data.preprocess import Preprocessor
from app.errors import GateError
from app.evaluate.held_out import labeled_batches, predictions, torch_predict
from app.export import quantize as q
from app.export.compile_programs import Positional
from app.export.exporter import ExportParts, Quality, Report, gate, parity_refusal, sizes
from app.export.measure import latency_ms
from app.export.onnx_graph import batch_axes, write_onnx
from app.models import is_conv_net
from app.runtime import artifact as art
from app.tasks.classify.accuracy import accuracy_drop_allowed
from app.tasks.classify.compiled import programs
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)
Inputs = dict[str, np.ndarray]


def held_out(config: Config, loaded: LoadedCheckpoint) -> Inputs:
    """The first `export.parity_rows` val rows as model inputs (parity, latency, tracing)."""
    batches = labeled_batches(
        config, loaded.preprocessor, "val", batch_rows=config.export.parity_rows
    )
    return next(iter(batches))[0]


def write_graphs(config: Config, loaded: LoadedCheckpoint, sample: Inputs, work: str) -> None:
    path = os.path.join(work, art.MODEL_FILES["fp32"])
    export_onnx(loaded.model, loaded.preprocessor, sample, path, config.export.opset)


def export_onnx(model: nn.Module, pre: Preprocessor, sample: Inputs, path: str, opset: int) -> None:
    """Batch free for every tensor; for text the sequence too, so that serving can cut a batch
    of short requests to its own longest row instead of `max_length`."""
    names = pre.input_names()
    args = [torch.from_numpy(sample[n][:2]) for n in names]
    axes = batch_axes([*names, "logits"], names if pre.variable_length else [])
    write_onnx(Positional(model, names), args, path, names, ["logits"], axes, opset)


# --- quantization -----------------------------------------------------------------------------


def quantize(config: Config, loaded: LoadedCheckpoint, sample: Inputs, work: str) -> Report:
    """Each quantization method in turn (by default static, static on the Linear layers, then
    weight-only) until one's int8 passes the gate. When none does, the first method's report
    comes back (the gate then refuses with what the default method lost)."""
    fp32 = os.path.join(work, art.MODEL_FILES["fp32"])
    int8 = os.path.join(work, art.MODEL_FILES["int8"])
    prepared = os.path.join(work, "prepared.onnx")
    q.prepare_for_quantization(fp32, prepared)
    fp32_variant = (fp32, art.create_session(art.local_graph(fp32)))
    methods = q.methods_for(config)
    reports = []
    for method in methods:
        # Only the last method tries keeping layers in fp32: the next method is cheaper first.
        last = method == methods[-1]
        report = quantize_method(config, loaded, prepared, fp32_variant, int8, sample, method, last)
        try:
            gate(report, config, refusal)
            break
        except GateError as e:
            log.info("export: %s int8 does not pass the gate (%s)", method, e)
            reports.append(report)
    else:
        report = reports[0]
    os.remove(prepared)
    return report


def quantize_method(
    config: Config,
    loaded: LoadedCheckpoint,
    prepared: str,
    fp32: tuple[str, Any],
    int8: str,
    sample: Inputs,
    method: str,
    keep_layers: bool = True,
) -> Report:
    """Quantize, verify, and while int8 loses more accuracy than the gate allows, keep the most
    sensitive layer in fp32 (at most `export.max_fp32_layers`, and only while the size bound
    `export.max_size_ratio` still holds)."""
    e, pre = config.export, loaded.preprocessor
    per_channel = is_conv_net(loaded.model)
    calibration = q.calibration_inputs(config, pre) if q.calibrated(method) else []
    excluded: list[str] = []
    ranking: list[str] | None = None
    previous: Report | None = None
    while True:
        q.quantize(prepared, int8, method, calibration, excluded, per_channel)
        report = measure(config, loaded, fp32, int8, sample)
        if previous is not None and not within_size(report, e):
            return previous  # one more fp32 layer broke the size bound: refuse on accuracy
        report["quantization"] = {
            "method": method,
            "weight_type": "QInt8",
            "per_channel": per_channel and q.calibrated(method),
            # Static scales are constants of the artifact, and weight-only leaves activations
            # in fp32: either way a row's answer is its own, whatever it is batched with.
            "batch_independent": method != "dynamic",
            "excluded_nodes": list(excluded),
        }
        if accuracy_drop_allowed(report, e.max_accuracy_drop) or not keep_layers:
            return report
        if ranking is None:  # measured once, on the fully quantized model
            sensitivity = q.layer_sensitivity(
                prepared,
                method,
                calibration,
                lambda p: onnx_accuracy(config, pre, p),
                os.path.dirname(int8),
                [],
                per_channel=per_channel,
            )
            ranking = sorted(sensitivity, key=lambda node: -sensitivity[node])
        report["sensitivity"] = sensitivity
        if len(excluded) >= min(e.max_fp32_layers, len(ranking)) or not size_allows(report, e):
            return report
        excluded.append(ranking[len(excluded)])
        previous = report
        log.info("export: keeping %s in fp32 (the most sensitive layer left)", excluded[-1])


def within_size(report: Report, e) -> bool:
    return e.max_size_ratio is None or report["size_ratio_int8"] <= e.max_size_ratio


def size_allows(report: Report, e) -> bool:
    """Whether one more fp32 layer could still fit under the size bound (checked again after)."""
    return e.max_size_ratio is None or report["size_ratio_int8"] < e.max_size_ratio


def onnx_accuracy(config: Config, pre: Preprocessor, path: str) -> float:
    session = art.create_session(art.local_graph(path))
    y_true, y_pred = predictions(
        lambda x: art.run_logits(session, x), labeled_batches(config, pre, "val")
    )
    return float((y_true == y_pred).mean())


def measure(
    config: Config, loaded: LoadedCheckpoint, fp32: tuple[str, Any], int8: str, sample: Inputs
) -> Report:
    """Parity, accuracy, size and latency of both variants. `fp32` is (path, session): the
    session is built once and reused across quantization attempts."""
    pre = loaded.preprocessor
    sessions = {"fp32": fp32[1], "int8": art.create_session(art.local_graph(int8))}
    with torch.no_grad():
        torch_logits = torch_predict(loaded.model)(sample)
    onnx_logits = art.run_logits(sessions["fp32"], sample)
    abs_diff = np.abs(torch_logits - onnx_logits)
    parity = {
        "rows": int(len(torch_logits)),
        "max_abs_diff": float(abs_diff.max()),
        "max_rel_diff": float((abs_diff / (np.abs(torch_logits) + 1e-6)).max()),
        "label_agreement": float((torch_logits.argmax(1) == onnx_logits.argmax(1)).mean()),
    }

    def accuracy(predict) -> tuple[float, int]:
        y_true, y_pred = predictions(predict, labeled_batches(config, pre, "val"))
        return float((y_true == y_pred).mean()), len(y_true)

    (torch_acc, rows), (fp32_acc, _), (int8_acc, _) = (
        accuracy(torch_predict(loaded.model)),
        accuracy(lambda x: art.run_logits(sessions["fp32"], x)),
        accuracy(lambda x: art.run_logits(sessions["int8"], x)),
    )
    accuracies = {"torch_fp32": torch_acc, "onnx_fp32": fp32_acc, "onnx_int8": int8_acc}
    work = os.path.dirname(int8)
    size = sizes(work, {v: [art.MODEL_FILES[v]] for v in ("fp32", "int8")})
    latency = {v: latency_ms(s, sample, config.export.latency_repeats) for v, s in sessions.items()}
    log.info(
        "export: accuracy %s sizes %s parity %.2e",
        accuracies,
        size["size_bytes"],
        parity["max_abs_diff"],
    )
    return {
        "parity": parity,
        "accuracy": accuracies,
        "accuracy_rows": rows,
        "accuracy_drop_points": 100 * (accuracies["onnx_fp32"] - accuracies["onnx_int8"]),
        **size,
        "latency_ms": latency,
        "latency_speedup_int8_batch32": latency["fp32"]["batch_32"] / latency["int8"]["batch_32"],
        "thresholds": {
            "parity_tolerance": config.export.parity_tolerance,
            "max_accuracy_drop": config.export.max_accuracy_drop,
            "max_size_ratio": config.export.max_size_ratio,
        },
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1},
    }


# --- the gate -----------------------------------------------------------------------------------


def refusal(report: Report, config: Config) -> str | None:
    """fp32 ONNX against torch, then int8's accuracy against fp32's."""
    e = config.export
    if why := parity_refusal(report, config, ""):
        return why
    if not accuracy_drop_allowed(report, e.max_accuracy_drop):
        acc, drop = report["accuracy"], report["accuracy_drop_points"]
        return (
            f"int8 accuracy {100 * acc['onnx_int8']:.2f}% is {drop:.2f} points below fp32 "
            f"{100 * acc['onnx_fp32']:.2f}%, more than export.max_accuracy_drop="
            f"{e.max_accuracy_drop}{sensitivity_hint(report)}"
        )
    return None


def sensitivity_hint(report: Report) -> str:
    """The layers that cost the most, for the one-line refusal (all of them are in the report)."""
    sensitivity = report.get("sensitivity") or {}
    worst = sorted(sensitivity.items(), key=lambda kv: -kv[1])[:3]
    if not worst:
        return ""
    listed = ", ".join(f"{node} {100 * acc:.2f}%" for node, acc in worst)
    return f"; int8 accuracy with one layer kept in fp32: {listed}"


# --- what the artifact says of itself -------------------------------------------------------------


def schema(loaded: LoadedCheckpoint, task: str) -> dict[str, Any]:
    pre = loaded.preprocessor
    return {
        "task": task,
        "kind": pre.kind,
        "inputs": [pre.raw_input()],
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(pre.labels)]},
        ],
        "feature_columns": pre.feature_columns,
        "image_shape": pre.state.get("image_shape"),
        "labels": pre.labels,
        "model_inputs": pre.input_names(),
    }


def files(loaded: LoadedCheckpoint) -> dict[str, bytes]:
    return {}  # everything a classifier needs is in preprocessor.json


def quality(report: Report) -> Quality:
    accuracy = report["accuracy"]
    return Quality(
        metric=f"accuracy (%), {report.get('accuracy_rows', '?')} val rows",
        key="accuracy",
        values={k: accuracy[k] for k in ("torch_fp32", "onnx_fp32", "onnx_int8")},
        higher_is_better=True,
        latency_ms=report["latency_ms"],
        shown=100.0,
    )


EXPORT_PARTS = ExportParts(
    splits=("train", "val"),  # calibration reads train rows, the gate val rows
    held_out=held_out,
    write_graphs=write_graphs,
    quantize=quantize,
    refusal=refusal,
    programs=programs,
    schema=schema,
    files=files,
    quality=quality,
)
