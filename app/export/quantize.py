"""Quantize: an fp32 ONNX model -> int8 with onnxruntime, and which layers it hurts.

- Linear-heavy nets (MLP, Transformer): dynamic quantization, int8 weights (one scale per
  tensor), activations quantized on the fly (MatMulInteger / DynamicQuantizeMatMul).
- Conv nets: static QDQ, weights per channel, activation ranges calibrated on training rows
  drawn from the whole train split (not only its first rows).
`layer_sensitivity` measures, for each quantizable node, the accuracy regained by keeping that one
node in fp32: export uses it to keep the most sensitive layers in fp32 when the gate would refuse,
and reports it when the gate fires anyway.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from itertools import islice

import numpy as np

from app.config import Config
from app.data.preprocess import Preprocessor
from app.evaluate import labeled_batches

log = logging.getLogger(__name__)
QUANTIZABLE_OPS = ("Conv", "MatMul", "Gemm")
CALIBRATION_ROWS_PER_BATCH = 32
Inputs = dict[str, np.ndarray]


def method_for(config: Config, is_conv_net: bool) -> str:
    method = config.export.quantization
    if method == "auto":
        method = "static" if is_conv_net else "dynamic"
    return method


def prepare_for_quantization(fp32: str, prepared: str) -> None:
    """Shape inference and graph clean-up that onnxruntime's quantizer expects."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(fp32, prepared, skip_symbolic_shape=True)


def quantizable_nodes(path: str) -> list[str]:
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type in QUANTIZABLE_OPS and n.name]


def quantize(
    prepared: str, int8: str, method: str, calibration: list[Inputs], exclude: list[str]
) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic, quantize_static

    if method == "dynamic":
        # Per-tensor weight scales: per-channel ones cost bytes that kilobyte-sized Linear
        # layers cannot afford under a 0.3x size bound, and the on-the-fly activation
        # quantization is what limits accuracy here anyway.
        quantize_dynamic(
            prepared,
            int8,
            weight_type=QuantType.QInt8,
            per_channel=False,
            nodes_to_exclude=exclude or None,
        )
        return
    from onnxruntime.quantization import CalibrationMethod, QuantFormat

    quantize_static(
        prepared,
        int8,
        _Reader(calibration),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        nodes_to_exclude=exclude or None,
    )


def calibration_inputs(config: Config, pre: Preprocessor) -> list[Inputs]:
    """`export.calibration_batches` batches of train rows spread evenly over the whole split,
    streamed shard by shard (every region of the split is represented, none is held whole)."""
    from app.data.prepare import read_manifest

    take = config.export.calibration_batches * CALIBRATION_ROWS_PER_BATCH
    total = read_manifest(config.data_output)["rows"]["train"]
    stride, seen = max(1, total // take), 0
    picked: list[Inputs] = []
    for inputs, labels in labeled_batches(config, pre, "train", batch_rows=512):
        index = np.arange(len(labels))
        keep = index[(index + seen) % stride == 0]
        seen += len(labels)
        picked.append({k: v[keep] for k, v in inputs.items()})
        if sum(len(p[next(iter(p))]) for p in picked) >= take:
            break
    merged = {k: np.concatenate([p[k] for p in picked])[:take] for k in picked[0]}
    rows = len(next(iter(merged.values())))
    return [
        {k: v[s : s + CALIBRATION_ROWS_PER_BATCH] for k, v in merged.items()}
        for s in range(0, rows, CALIBRATION_ROWS_PER_BATCH)
    ]


def layer_sensitivity(
    prepared: str,
    method: str,
    calibration: list[Inputs],
    accuracy: Callable[[str], float],
    work: str,
    exclude: list[str],
    max_nodes: int = 64,
) -> dict[str, float]:
    """node -> int8 accuracy with that node (and `exclude`) kept in fp32, all else quantized."""
    out: dict[str, float] = {}
    probe = os.path.join(work, "sensitivity.onnx")
    for node in islice((n for n in quantizable_nodes(prepared) if n not in exclude), max_nodes):
        quantize(prepared, probe, method, calibration, [*exclude, node])
        out[node] = accuracy(probe)
    if os.path.exists(probe):
        os.remove(probe)
    return out


class _Reader:
    """onnxruntime's CalibrationDataReader over a fixed list of batches (rewindable)."""

    def __init__(self, batches: list[Inputs]):
        self._batches = batches
        self._it = iter(batches)

    def get_next(self) -> Inputs | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._batches)
