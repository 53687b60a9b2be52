"""The one ONNX export every task's graphs go through: torch's TorchScript exporter (dynamo=False),
which writes Gemm/MatMul nodes onnxruntime's quantizers handle.

A graph whose weights stay within `external_bytes` (export.external_data_bytes) is one
self-contained file; a larger one (protobuf cannot hold a message over 2 GB) keeps its weights
in one external-data file beside it, `<graph>.data`, which the manifest hashes like every file
and the runtime hands to ONNX Runtime from memory (app/runtime/artifact.py).

The module is put in eval mode here: the exporter restores a module's mode afterwards, which
would otherwise switch the model back to training (dropout, batch-norm updates).
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

DATA_SUFFIX = ".data"  # a graph's external data: model.onnx -> model.onnx.data

DynamicAxes = dict[str, dict[int, str]]


def write_onnx(
    module: nn.Module,
    args: Sequence[torch.Tensor],
    path: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    dynamic_axes: DynamicAxes,
    opset: int,
    external_bytes: int | None = None,
) -> None:
    """`module` traced on `args` and written to `path`: one file, or its weights in
    `<path>.data` when they pass `external_bytes`."""
    kwargs: dict[str, Any] = dict(
        input_names=list(inputs),
        output_names=list(outputs),
        dynamic_axes=dynamic_axes,
        opset_version=opset,
        dynamo=False,
        do_constant_folding=True,
    )
    module = module.eval()
    if not beyond(weight_bytes(module), external_bytes):
        buffer = io.BytesIO()
        with torch.no_grad():
            torch.onnx.export(module, tuple(args), buffer, **kwargs)  # type: ignore[arg-type]
        Path(path).write_bytes(buffer.getvalue())
        return
    import onnx

    # Through a file of its own: past 2 GB the exporter itself writes external data.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path) or ".") as scratch:
        traced = os.path.join(scratch, "graph.onnx")
        with torch.no_grad():
            torch.onnx.export(module, tuple(args), traced, **kwargs)
        save_graph(onnx.load(traced), path, external_bytes)


def save_graph(model: Any, path: str, external_bytes: int | None = None) -> None:
    """An ONNX ModelProto to `path`; its tensors in one `<path>.data` file when they pass
    `external_bytes` (a previous data file of that name is replaced)."""
    import onnx

    data = path + DATA_SUFFIX
    if os.path.exists(data):
        os.remove(data)
    size = sum(len(t.raw_data) for t in model.graph.initializer)
    if not beyond(size, external_bytes):
        onnx.save_model(model, path)
        return
    onnx.save_model(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=os.path.basename(data),
        size_threshold=1024,
    )


def beyond(size: int, external_bytes: int | None) -> bool:
    return external_bytes is not None and size > external_bytes


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers, a shared one counted once."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def graph_files(work: str, name: str) -> list[str]:
    """A graph's files in `work`: itself, and its external data when it has some."""
    data = name + DATA_SUFFIX
    return [name, data] if os.path.exists(os.path.join(work, data)) else [name]


def batch_axes(names: Sequence[str], sequences: Sequence[str] = ()) -> DynamicAxes:
    """Every tensor's first axis free (`batch`), and the second of `sequences` (`sequence`)."""
    axes: DynamicAxes = {n: {0: "batch"} for n in names}
    for name in sequences:
        axes[name][1] = "sequence"
    return axes
