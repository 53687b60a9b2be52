"""Task `classify`: best checkpoint -> verified ONNX fp32 + int8 artifact (and the programs
`export.formats` asks for), or nothing at all.

Everything is built and measured in a private temporary folder; only when parity and the int8
accuracy gate pass is the folder published as `<registry>/<name>/<version>/` (one move) and the
`latest` pointer advanced. A refusal exits 3 and leaves the registry untouched.
"""

from __future__ import annotations

import io
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from app import storage
from app.config import Config
from app.data.preprocess import Preprocessor
from app.errors import GateError
from app.evaluate.held_out import labeled_batches, predictions, torch_predict, verify_dataset
from app.export import quantize as q
from app.export.compile_programs import Positional, build_programs, open_program
from app.export.measure import accuracy_drop_allowed, latency_ms, rows_per_s
from app.export.publish import check_onnx_fits, gate_parity_and_size, publish, write_metadata
from app.models import is_conv_net
from app.registry import run_task
from app.runtime import artifact as art
from app.runtime import programs as prg
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)


def export_classifier(
    config: Config, loaded: LoadedCheckpoint, checkpoint_uri: str
) -> dict[str, Any]:
    """Task `classify`: ONNX fp32, int8 within the accuracy gate, verified, then published."""
    pre, model = loaded.preprocessor, loaded.model
    check_onnx_fits(model, checkpoint_uri)
    verify_dataset(config, ("train", "val"))  # calibration and the gate read both
    e = config.export
    with tempfile.TemporaryDirectory() as work:
        fp32_path, int8_path = (
            os.path.join(work, art.MODEL_FILES["fp32"]),
            os.path.join(work, art.MODEL_FILES["int8"]),
        )
        sample = next(iter(labeled_batches(config, pre, "val", batch_rows=e.parity_rows)))[0]
        export_onnx(model, pre, sample, fp32_path, e.opset)
        report = quantize_within_gate(config, loaded, fp32_path, int8_path, sample, work)
        gate(report, config)
        programs = build_programs(config, loaded, sample, work, report)
        report["serving"] = serving_speeds(config, pre, work, sample)
        write_quantization_plot(work, config, report)  # before the manifest, which hashes it
        task = run_task(loaded.config.train.task, pre.kind).name
        schema = schema_for(pre, task)
        write_metadata(work, config, loaded, report, checkpoint_uri, schema, programs)
        uri = publish(work, config.registry, config.artifact_name)
    log.info("export: published %s", uri)
    from app.train.tracking import tag_artifact

    tag_artifact(loaded.meta.mlflow_run_id, uri, report)
    plots = {"quantization": storage.join(uri, art.QUANTIZATION_PNG)}
    return {"stage": "export", "artifact": uri, "report": report, "plots": plots}


def serving_speeds(
    config: Config, pre: Preprocessor, work: str, sample: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Each servable variant's in-process rows/s at `serve.batching.max_batch_size` rows (this
    export's setting), one thread: `serve.variant: auto` serves the fastest a replica can run."""
    import torch

    rows = config.serve.batching.max_batch_size
    sessions = {
        v: art.create_session(Path(work, f).read_bytes()) for v, f in art.MODEL_FILES.items()
    }
    aoti = Path(work, prg.PROGRAM_FILES["aoti"])
    threads = torch.get_num_threads()  # a program's session sets one; the export keeps its own
    try:
        if aoti.is_file():
            sessions["aoti"] = open_program("aoti", aoti.read_bytes(), pre)
        speeds = {
            v: rows_per_s(s, sample, rows, config.export.latency_repeats)
            for v, s in sessions.items()
        }
    finally:
        torch.set_num_threads(threads)
    log.info("export: rows/s at batch %d: %s", rows, {v: round(r) for v, r in speeds.items()})
    return {
        "batch_rows": rows,
        "threads": 1,
        "rows_per_s": speeds,
        "auto": max(speeds, key=speeds.__getitem__),
    }


def write_quantization_plot(work: str, config: Config, report: dict[str, Any]) -> None:
    """`quantization.png`: fp32 vs int8 accuracy, size and latency, from the report."""
    from app import plots

    method = report["quantization"]["method"]
    title = f"{config.artifact_name}: fp32 vs int8 ({method} quantization)"
    with open(os.path.join(work, art.QUANTIZATION_PNG), "wb") as f:
        f.write(plots.quantization(report, title))


# --- ONNX export ------------------------------------------------------------------------------


def export_onnx(
    model: nn.Module, pre: Preprocessor, sample: dict[str, np.ndarray], path: str, opset: int
) -> None:
    names = pre.input_names()
    args = tuple(torch.from_numpy(sample[n][:2]) for n in names)
    buffer = io.BytesIO()
    # The TorchScript exporter (dynamo=False) writes one self-contained file whose Gemm/MatMul
    # nodes onnxruntime's quantizer handles; the dynamo exporter defaults to external data.
    # The wrapper must be in eval mode too: the exporter restores the wrapper's mode afterwards,
    # which would otherwise switch the model back to training (dropout, batch-norm updates).
    torch.onnx.export(
        Positional(model, names).eval(),
        args,
        buffer,  # type: ignore[arg-type]  # file-like objects are accepted
        input_names=names,
        output_names=["logits"],
        dynamic_axes=dynamic_axes(pre, names),
        opset_version=opset,
        dynamo=False,
        do_constant_folding=True,
    )
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


def dynamic_axes(pre: Preprocessor, names: list[str]) -> dict[str, dict[int, str]]:
    """Batch is free for every tensor; for text the sequence too, so that serving can cut a
    batch of short requests to its own longest row instead of `max_length` (the Transformer's
    positions and mask take any length up to it)."""
    axes: dict[str, dict[int, str]] = {n: {0: "batch"} for n in [*names, "logits"]}
    if pre.variable_length:
        for name in names:
            axes[name][1] = "sequence"
    return axes


# --- quantization -----------------------------------------------------------------------------


def quantize_within_gate(
    config: Config, loaded: LoadedCheckpoint, fp32: str, int8: str, sample, work: str
) -> dict[str, Any]:
    """Each quantization method in turn (by default static, static on the Linear layers, then
    weight-only) until one's int8
    passes the gate. When none does, the first method's report comes back (the gate then
    refuses with what the default method lost)."""
    prepared = os.path.join(work, "prepared.onnx")
    q.prepare_for_quantization(fp32, prepared)
    fp32_variant = (fp32, art.create_session(Path(fp32).read_bytes()))
    methods = q.methods_for(config)
    reports = []
    for method in methods:
        # Only the last method tries keeping layers in fp32: the next method is cheaper first.
        last = method == methods[-1]
        report = quantize_method(
            config, loaded, prepared, fp32_variant, int8, sample, work, method, last
        )
        try:
            gate(report, config)
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
    sample,
    work: str,
    method: str,
    keep_layers: bool = True,
) -> dict[str, Any]:
    """Quantize, verify, and while int8 loses more accuracy than the gate allows, keep the most
    sensitive layer in fp32 (at most `export.max_fp32_layers`, and only while the size bound
    `export.max_size_ratio` still holds)."""
    e, pre = config.export, loaded.preprocessor
    per_channel = is_conv_net(loaded.model)
    calibration = q.calibration_inputs(config, pre) if q.calibrated(method) else []
    excluded: list[str] = []
    ranking: list[str] | None = None
    previous: dict[str, Any] | None = None
    while True:
        q.quantize(prepared, int8, method, calibration, excluded, per_channel)
        report = verify_variants(config, loaded, fp32, int8, sample)
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
                work,
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


def within_size(report: dict[str, Any], e) -> bool:
    return e.max_size_ratio is None or report["size_ratio_int8"] <= e.max_size_ratio


def size_allows(report: dict[str, Any], e) -> bool:
    """Whether one more fp32 layer could still fit under the size bound (checked again after)."""
    return e.max_size_ratio is None or report["size_ratio_int8"] < e.max_size_ratio


def onnx_accuracy(config: Config, pre: Preprocessor, path: str) -> float:
    session = art.create_session(Path(path).read_bytes())
    y_true, y_pred = predictions(
        lambda x: art.run_logits(session, x), labeled_batches(config, pre, "val")
    )
    return float((y_true == y_pred).mean())


# --- verification -----------------------------------------------------------------------------


def verify_variants(
    config: Config, loaded: LoadedCheckpoint, fp32: tuple[str, Any], int8: str, sample
) -> dict[str, Any]:
    """Parity, accuracy, size and latency of both variants. `fp32` is (path, session): the
    session is built once and reused across quantization attempts."""
    pre = loaded.preprocessor
    sessions = {"fp32": fp32[1], "int8": art.create_session(Path(int8).read_bytes())}
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
    sizes = {"fp32": os.path.getsize(fp32[0]), "int8": os.path.getsize(int8)}
    latency = {v: latency_ms(s, sample, config.export.latency_repeats) for v, s in sessions.items()}
    log.info("export: accuracy %s sizes %s parity %.2e", accuracies, sizes, parity["max_abs_diff"])
    return {
        "parity": parity,
        "accuracy": accuracies,
        "accuracy_rows": rows,
        "accuracy_drop_points": 100 * (accuracies["onnx_fp32"] - accuracies["onnx_int8"]),
        "size_bytes": sizes,
        "size_ratio_int8": sizes["int8"] / sizes["fp32"],
        "latency_ms": latency,
        "latency_speedup_int8_batch32": latency["fp32"]["batch_32"] / latency["int8"]["batch_32"],
        "thresholds": {
            "parity_tolerance": config.export.parity_tolerance,
            "max_accuracy_drop": config.export.max_accuracy_drop,
            "max_size_ratio": config.export.max_size_ratio,
        },
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1},
    }


def gate(report: dict[str, Any], config: Config) -> None:
    e = config.export
    gate_parity_and_size(report, config, "")
    if not accuracy_drop_allowed(report, e.max_accuracy_drop):
        acc, drop = report["accuracy"], report["accuracy_drop_points"]
        raise GateError(
            f"export refused: int8 accuracy {100 * acc['onnx_int8']:.2f}% is {drop:.2f} points below "
            f"fp32 {100 * acc['onnx_fp32']:.2f}%, more than export.max_accuracy_drop="
            f"{e.max_accuracy_drop}{sensitivity_hint(report)}",
            report,
        )


def sensitivity_hint(report: dict[str, Any]) -> str:
    """The layers that cost the most, for the one-line refusal (all of them are in the report)."""
    sensitivity = report.get("sensitivity") or {}
    worst = sorted(sensitivity.items(), key=lambda kv: -kv[1])[:3]
    if not worst:
        return ""
    listed = ", ".join(f"{node} {100 * acc:.2f}%" for node, acc in worst)
    return f"; int8 accuracy with one layer kept in fp32: {listed}"


# --- metadata and publishing ------------------------------------------------------------------


def schema_for(pre: Preprocessor, task: str) -> dict[str, Any]:
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
