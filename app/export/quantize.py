"""Quantize: an fp32 ONNX model -> int8 with onnxruntime, and which layers it hurts.

- By default (`export.quantization: auto`) static QDQ: int8 weights, activation ranges
  calibrated on training rows drawn from the whole train split, so the scales are constants of
  the artifact and a row's answer never depends on the rows batched with it. Weights get a
  scale per channel in conv nets and one per tensor in Linear-heavy nets (per-channel scales
  cost bytes that kilobyte-sized layers cannot afford under a 0.3x size bound).
- When static scales everywhere cost more accuracy than the gate allows (a Transformer's
  attention, softmax and residual sums), `static_linear`: the same static scales on the Linear
  layers alone (MatMul/Gemm with a weight; attention's activation x activation MatMuls and every
  other op stay fp32), embedding tables as int8 rows. Integer GEMMs where the FLOPs are.
- Else weight-only: int8 weights, fp32 activations (`MatMulNBits`), batch-independent too.
- `dynamic` (opt-in) quantizes activations on the fly with a scale per call: smaller graphs,
  but a row's probabilities then move with its batch mates.
`layer_sensitivity` measures, for each quantizable node, the accuracy regained by keeping that one
node in fp32: export uses it to keep the most sensitive layers in fp32 when the gate would refuse,
and reports it when the gate fires anyway.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from itertools import islice
from typing import Any

import numpy as np

from app.config import Config
from app.data.preprocess import Preprocessor
from app.evaluate.held_out import labeled_batches

log = logging.getLogger(__name__)
QUANTIZABLE_OPS = ("Conv", "MatMul", "Gemm")
CALIBRATION_ROWS_PER_BATCH = 32
# Weight-only int8: one fp32 scale per this many weights (6% over the int8 bytes).
WEIGHT_BLOCK = 64
Inputs = dict[str, np.ndarray]


def methods_for(config: Config) -> list[str]:
    """The methods export tries in turn until one passes the gate: by default static
    everywhere, then static on the Linear layers alone (a Transformer's attention loses
    accuracy to static activation scales), then weight-only."""
    method = config.export.quantization
    return ["static", "static_linear", "weight_only"] if method == "auto" else [method]


def calibrated(method: str) -> bool:
    """Whether the method's activation scales come from calibration rows."""
    return method in ("static", "static_linear")


def prepare_for_quantization(fp32: str, prepared: str) -> None:
    """Shape inference and graph clean-up that onnxruntime's quantizer expects."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(fp32, prepared, skip_symbolic_shape=True)


def quantizable_nodes(path: str) -> list[str]:
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type in QUANTIZABLE_OPS and n.name]


def quantize(
    prepared: str,
    int8: str,
    method: str,
    calibration: list[Inputs],
    exclude: list[str],
    per_channel: bool = True,
) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic, quantize_static

    if method == "weight_only":
        quantize_weight_only(prepared, int8, exclude)
        return
    if method == "dynamic":
        # Per-tensor weight scales: the on-the-fly activation quantization limits accuracy here.
        quantize_dynamic(
            prepared,
            int8,
            weight_type=QuantType.QInt8,
            per_channel=False,
            nodes_to_exclude=exclude or None,
        )
        return
    from onnxruntime.quantization import CalibrationMethod, QuantFormat

    linear = method == "static_linear"
    quantize_static(
        prepared,
        int8,
        _Reader(calibration),
        quant_format=QuantFormat.QDQ,
        per_channel=per_channel,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        nodes_to_exclude=[*exclude, *activation_matmuls(prepared)] if linear else exclude or None,
        op_types_to_quantize=["MatMul", "Gemm"] if linear else None,
    )
    if linear:
        import onnx

        model = onnx.load(int8)
        quantize_embeddings(model)
        onnx.save_model(model, int8)


def activation_matmuls(path: str) -> list[str]:
    """MatMul nodes with no weight among their inputs (attention's scores and mix)."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    return [
        n.name
        for n in graph.node
        if n.op_type == "MatMul" and n.name and not any(i in weights for i in n.input)
    ]


def quantize_weight_only(
    fp32: str,
    int8: str,
    exclude: list[str] | None = None,
    int8_compute: bool = True,
    gemm_weights: bool = False,
    external_bytes: int | None = None,
) -> None:
    """int8 weights (onnxruntime's weight-only `MatMulNBits`, 8 bits, symmetric blocks of
    WEIGHT_BLOCK along each weight's input dimension), embedding tables too
    (`quantize_embeddings`). Arithmetic: by default int8, each row's activation blocks
    quantized in the kernel (MLAS's int8 path); `int8_compute=False` keeps fp32 arithmetic on
    dequantized blocks, a path that dequantizes whole weights per call and runs slower than fp32
    ONNX (GPT-2 small decoded 7x slower, a BERT-base row 2.4x). Either way no scale spans rows,
    so a row's result depends on that row alone. `gemm_weights`: a Gemm's constant weight
    (a language model's head, which reads its matrix untransposed) is quantized too, as a
    MatMul. A graph over `external_bytes` is saved with external data."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    from app.export.onnx_graph import save_graph

    source = onnx.load(fp32)
    if gemm_weights:
        gemm_as_matmul(source)
    ops = ("MatMul",)
    axes = (("MatMul", 0),)
    level = 4 if int8_compute else 1  # onnxruntime's accuracy_level: 4 = int8, 1 = fp32
    config = nbits.DefaultWeightOnlyQuantConfig(
        block_size=WEIGHT_BLOCK,
        is_symmetric=True,
        accuracy_level=level,
        bits=8,
        op_types_to_quantize=ops,
        quant_axes=axes,
    )
    quantizer = nbits.MatMulNBitsQuantizer(
        source,
        bits=8,
        block_size=WEIGHT_BLOCK,
        is_symmetric=True,
        accuracy_level=level,
        nodes_to_exclude=exclude or None,
        op_types_to_quantize=ops,
        quant_axes=axes,
        algo_config=config,
    )
    quantizer.process()
    model = quantizer.model.model
    quantize_embeddings(model)
    save_graph(model, int8, external_bytes)


def is_zero(graph: Any, name: str) -> bool:
    from onnx import numpy_helper

    found = [i for i in graph.initializer if i.name == name]
    return bool(found) and not numpy_helper.to_array(found[0]).any()


def gemm_as_matmul(model: Any) -> None:
    """Each Gemm (alpha and beta 1, A untransposed) whose B is a constant matrix becomes a
    MatMul on its own [in, out] copy of B, plus an Add of C unless C is zero: the form
    MatMulNBits quantizes. A B that a Gather reads too (a tied embedding) keeps its table for
    the Gather."""
    from onnx import helper

    graph = model.graph
    tables = {i.name: i for i in graph.initializer if len(i.dims) == 2}
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
        if node.op_type == "Gemm" and node.input[1] in tables and not attrs.get("transA") and plain:
            nodes += as_matmul(graph, node, tables[node.input[1]], bool(attrs.get("transB")))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    for initializer in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(initializer)


def as_matmul(graph: Any, gemm: Any, table: Any, transposed: bool) -> list[Any]:
    """One Gemm's MatMul (and Add) nodes, its weight added as an [in, out] initializer."""
    from onnx import helper, numpy_helper

    weight = numpy_helper.to_array(table)
    name = f"{table.name}_matmul"
    graph.initializer.append(
        numpy_helper.from_array(np.ascontiguousarray(weight.T if transposed else weight), name)
    )
    bias = gemm.input[2] if len(gemm.input) > 2 and not is_zero(graph, gemm.input[2]) else None
    product = f"{gemm.output[0]}_product" if bias else gemm.output[0]
    nodes = [helper.make_node("MatMul", [gemm.input[0], name], [product], name=gemm.name)]
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [gemm.output[0]]))
    return nodes


def quantize_embeddings(model: Any, min_elements: int = 1024) -> None:
    """Each embedding table read only by Gather becomes int8 rows with one scale a row: the
    graph gathers the int8 rows and their scales and multiplies, so a call dequantizes only the
    rows it reads (a whole-table DequantizeLinear would cost the table on every call)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    tables = {i.name: i for i in graph.initializer if len(i.dims) == 2}
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in tables:
                readers.setdefault(name, []).append((node, k))
    for name, uses in readers.items():
        if not all(node.op_type == "Gather" and k == 0 for node, k in uses):
            continue
        table = numpy_helper.to_array(tables[name]).astype(np.float32)
        if table.size < min_elements:
            continue
        scale = np.maximum(np.abs(table).max(axis=1, keepdims=True), 1e-12) / 127.0
        graph.initializer.remove(tables[name])
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.round(table / scale).astype(np.int8), f"{name}_q"),
                numpy_helper.from_array(scale.astype(np.float32), f"{name}_scale"),
            ]
        )
        for node, _ in uses:
            ids, out = node.input[1], node.output[0]
            rows_q, rows_f, rows_s = f"{out}_q", f"{out}_qf", f"{out}_s"
            node.input[0], node.output[0] = f"{name}_q", rows_q
            graph.node.extend(
                [
                    helper.make_node("Gather", [f"{name}_scale", ids], [rows_s], axis=0),
                    helper.make_node("Cast", [rows_q], [rows_f], to=onnx.TensorProto.FLOAT),
                    helper.make_node("Mul", [rows_f, rows_s], [out]),
                ]
            )
    _topological_sort(graph)


def _topological_sort(graph: Any) -> None:
    """Nodes in an order where each input is produced before it is read (ONNX requires it)."""
    produced = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in produced for i in n.input)]
        if not ready:
            raise ValueError("quantized graph has a cycle or an unknown input")
        for node in ready:
            ordered.append(node)
            produced.update(node.output)
        pending = [n for n in pending if n not in ready]
    del graph.node[:]
    graph.node.extend(ordered)


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
    per_channel: bool = True,
) -> dict[str, float]:
    """node -> int8 accuracy with that node (and `exclude`) kept in fp32, all else quantized."""
    out: dict[str, float] = {}
    probe = os.path.join(work, "sensitivity.onnx")
    for node in islice((n for n in quantizable_nodes(prepared) if n not in exclude), max_nodes):
        quantize(prepared, probe, method, calibration, [*exclude, node], per_channel)
        out[node] = accuracy(probe)
    if os.path.exists(probe):
        os.remove(probe)
    return out


class _Reader:
    """onnxruntime's CalibrationDataReader over a fixed list of batches (rewindable), one row
    per call: its MinMax calibration holds every intermediate tensor of a call alive (about
    1 GiB per row for ViT-base, so 32-row calls ran out of 24 GiB), and per-row minima and
    maxima fold into the batch's exactly."""

    def __init__(self, batches: list[Inputs]):
        self._batches = batches
        self.rewind()

    def get_next(self) -> Inputs | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = (
            {name: value[i : i + 1] for name, value in batch.items()}
            for batch in self._batches
            for i in range(len(next(iter(batch.values()))))
        )
