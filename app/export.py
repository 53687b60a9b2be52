"""Export: best checkpoint -> verified ONNX fp32 + int8 artifact, or nothing at all.

Everything is built and measured in a private temporary folder; only when parity and the int8
accuracy gate pass is the folder published as `<registry>/<name>/<version>/` (one move) and the
`latest` pointer advanced. A refusal exits 3 and leaves the registry untouched.
"""

from __future__ import annotations

import io
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from app import artifact as art
from app import storage
from app.checkpoint import LoadedCheckpoint, load_checkpoint
from app.cli import UserError
from app.config import Config
from app.evaluate import labeled_batches, predictions, torch_predict
from app.models import is_conv_net
from app.preprocess import Preprocessor

log = logging.getLogger(__name__)


class GateError(UserError):
    """Export refused: int8 lost too much accuracy or ONNX disagrees with torch (exit 3)."""

    exit_code = 3


def export(config: Config, checkpoint_uri: str) -> dict[str, Any]:
    loaded = load_checkpoint(checkpoint_uri)
    pre, model = loaded.preprocessor, loaded.model
    e = config.export
    with tempfile.TemporaryDirectory() as work:
        fp32_path, int8_path = (
            os.path.join(work, art.MODEL_FILES["fp32"]),
            os.path.join(work, art.MODEL_FILES["int8"]),
        )
        sample = next(iter(labeled_batches(config, pre, "val", batch_rows=e.parity_rows)))[0]
        export_onnx(model, pre, sample, fp32_path, e.opset)
        method = quantize(config, pre, model, fp32_path, int8_path, work)
        report = verify_variants(config, loaded, fp32_path, int8_path, sample, method)
        gate(report, e.parity_tolerance, e.max_accuracy_drop)
        write_metadata(work, config, loaded, report, checkpoint_uri)
        uri = publish(work, config.registry, config.artifact_name)
    log.info("export: published %s", uri)
    return {"stage": "export", "artifact": uri, "report": report}


# --- ONNX export ------------------------------------------------------------------------------


class _Positional(nn.Module):
    """Adapts a keyword-argument model to the positional inputs the ONNX exporter traces."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs, strict=True)))


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
        _Positional(model, names).eval(),
        args,
        buffer,  # type: ignore[arg-type]  # file-like objects are accepted
        input_names=names,
        output_names=["logits"],
        dynamic_axes={n: {0: "batch"} for n in [*names, "logits"]},
        opset_version=opset,
        dynamo=False,
        do_constant_folding=True,
    )
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


# --- quantization -----------------------------------------------------------------------------


def quantize(
    config: Config, pre: Preprocessor, model: nn.Module, fp32: str, int8: str, work: str
) -> str:
    from onnxruntime.quantization import QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    method = config.export.quantization
    if method == "auto":
        method = "static" if is_conv_net(model) else "dynamic"
    prepared = os.path.join(work, "prepared.onnx")
    quant_pre_process(fp32, prepared, skip_symbolic_shape=True)
    if method == "dynamic":
        # Linear-heavy nets: int8 weights, activations quantized on the fly (MatMulInteger).
        quantize_dynamic(prepared, int8, weight_type=QuantType.QInt8, per_channel=False)
    else:
        # Conv nets: static QDQ with activation ranges calibrated on train batches.
        from onnxruntime.quantization import CalibrationMethod, QuantFormat

        reader = _CalibrationReader(config, pre)
        quantize_static(
            prepared,
            int8,
            reader,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
    os.remove(prepared)
    return method


class _CalibrationReader:
    def __init__(self, config: Config, pre: Preprocessor):
        batches = labeled_batches(config, pre, "train", batch_rows=32)
        self._batches = iter(
            [inputs for inputs, _ in islice(batches, config.export.calibration_batches)]
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)

    def rewind(self) -> None:  # the quantizer may call it; one pass is enough here
        pass


# --- verification -----------------------------------------------------------------------------


def verify_variants(
    config: Config, loaded: LoadedCheckpoint, fp32: str, int8: str, sample, method: str
) -> dict[str, Any]:
    pre = loaded.preprocessor
    sessions = {
        v: art.create_session(Path(p).read_bytes()) for v, p in (("fp32", fp32), ("int8", int8))
    }
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

    def accuracy(predict) -> float:
        y_true, y_pred = predictions(predict, labeled_batches(config, pre, "val"))
        return float((y_true == y_pred).mean())

    accuracies = {
        "torch_fp32": accuracy(torch_predict(loaded.model)),
        "onnx_fp32": accuracy(lambda x: art.run_logits(sessions["fp32"], x)),
        "onnx_int8": accuracy(lambda x: art.run_logits(sessions["int8"], x)),
    }
    sizes = {"fp32": os.path.getsize(fp32), "int8": os.path.getsize(int8)}
    latency = {v: latency_ms(s, sample, config.export.latency_repeats) for v, s in sessions.items()}
    log.info("export: accuracy %s sizes %s parity %.2e", accuracies, sizes, parity["max_abs_diff"])
    return {
        "parity": parity,
        "accuracy": accuracies,
        "accuracy_drop_points": 100 * (accuracies["onnx_fp32"] - accuracies["onnx_int8"]),
        "size_bytes": sizes,
        "size_ratio_int8": sizes["int8"] / sizes["fp32"],
        "latency_ms": latency,
        "latency_speedup_int8_batch32": latency["fp32"]["batch_32"] / latency["int8"]["batch_32"],
        "quantization": {"method": method, "weight_type": "QInt8"},
        "thresholds": {
            "parity_tolerance": config.export.parity_tolerance,
            "max_accuracy_drop": config.export.max_accuracy_drop,
        },
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1},
    }


def latency_ms(session, sample: dict[str, np.ndarray], repeats: int) -> dict[str, float]:
    out = {}
    for batch in (1, 32):
        inputs = {k: np.resize(v, (batch, *v.shape[1:])) for k, v in sample.items()}
        art.run_logits(session, inputs)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            art.run_logits(session, inputs)
            times.append(1000 * (time.perf_counter() - start))
        out[f"batch_{batch}"] = statistics.median(times)
    return out


def gate(report: dict[str, Any], parity_tolerance: float, max_drop: float) -> None:
    parity = report["parity"]["max_abs_diff"]
    if parity > parity_tolerance:
        raise GateError(
            f"export refused: ONNX fp32 differs from torch by {parity:.3g} (max abs logit diff), "
            f"above export.parity_tolerance={parity_tolerance}"
        )
    acc = report["accuracy"]
    drop = report["accuracy_drop_points"]
    if drop > max_drop:
        raise GateError(
            f"export refused: int8 accuracy {100 * acc['onnx_int8']:.2f}% is {drop:.2f} points below "
            f"fp32 {100 * acc['onnx_fp32']:.2f}%, more than export.max_accuracy_drop={max_drop}"
        )


# --- metadata and publishing ------------------------------------------------------------------


def schema_for(pre: Preprocessor) -> dict[str, Any]:
    if pre.kind == "text":
        tensor = {"name": "text", "datatype": "BYTES", "shape": [-1]}
    else:
        name = "image" if pre.kind == "image" else "features"
        tensor = {"name": name, "datatype": "FP32", "shape": [-1, pre.num_features]}
    return {
        "kind": pre.kind,
        "inputs": [tensor],
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(pre.labels)]},
        ],
        "feature_columns": pre.feature_columns,
        "image_shape": pre.state.get("image_shape"),
        "labels": pre.labels,
        "model_inputs": pre.input_names(),
    }


def write_metadata(
    work: str, config: Config, loaded: LoadedCheckpoint, report: dict[str, Any], checkpoint_uri: str
) -> None:
    import onnx
    import onnxruntime
    import ray

    files = {
        "preprocessor.json": loaded.preprocessor.to_json(),
        "schema.json": json.dumps(schema_for(loaded.preprocessor), indent=2),
        "report.json": json.dumps(report, indent=2, sort_keys=True),
    }
    for name, text in files.items():
        with open(os.path.join(work, name), "w") as f:
            f.write(text + "\n")
    listed = {}
    for name in sorted(os.listdir(work)):
        with open(os.path.join(work, name), "rb") as f:
            data = f.read()
        listed[name] = {"sha256": art.sha256_bytes(data), "size": len(data)}
    manifest = {
        "name": config.artifact_name,
        "version": None,  # set at publish time
        "created": datetime.now(timezone.utc).isoformat(),
        "source_checkpoint": checkpoint_uri,
        "run_name": loaded.meta.get("config", {}).get("train", {}).get("run_name"),
        "train_metrics": loaded.meta.get("metrics", {}),
        "workload": config.workload,
        "quantization": report["quantization"],
        "opset": config.export.opset,
        "versions": {
            "torch": torch.__version__,
            "ray": ray.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "files": listed,
    }
    with open(os.path.join(work, art.MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)


def next_version(registry: str, name: str) -> int:
    existing = [int(v) for v in storage.list_dir(storage.join(registry, name)) if v.isdigit()]
    return max(existing, default=0) + 1


def publish(work: str, registry: str, name: str) -> str:
    for _ in range(5):  # another export may take the same number: try the next one
        version = next_version(registry, name)
        manifest_path = os.path.join(work, art.MANIFEST)
        with open(manifest_path) as f:
            manifest = json.load(f)
        manifest["version"] = str(version)
        with open(manifest_path, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        uri = storage.join(registry, name, str(version))
        try:
            with storage.staged_dir(uri, replace=False) as staging:
                for file in os.listdir(work):
                    shutil.copy2(os.path.join(work, file), os.path.join(staging, file))
        except FileExistsError:
            continue
        storage.write_bytes(storage.join(registry, name, art.LATEST), f"{version}\n".encode())
        return uri
    raise UserError(f"{registry}/{name}: could not claim a new version number")
