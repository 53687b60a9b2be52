"""Export: the best checkpoint -> its task's verified artifact, or nothing at all.

One flow for every task; the task supplies only what is its own, as the same-named parts
(`ExportParts`, bound in app/tasks/<task>/export.py):

    checks (the held-out shards are intact)
    -> held_out: the rows export measures on
    -> in a private temporary folder:
       write_graphs: the fp32 ONNX graph(s), through app/export/onnx_graph.py
       quantize: the int8 variant(s), both measured (a task may search its methods here)
       the gate: int8 within export.max_size_ratio, then the task's own `refusal`
       programs: AOTInductor / ExecuTorch programs `export.formats` asks for, gated alike
       quantization.png from the task's `quality`, its `files`, schema.json, the metadata
    -> publish `<registry>/<name>/<version>/` (app/export/publish.py: one move, the manifest
       last) -> the MLflow tag -> the summary.

A refusal exits 3 and leaves the registry untouched.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app import storage
from app.config import Config
from app.errors import GateError
from app.registry import Part, run_task
from app.runtime import artifact as art
from app.runtime import programs as prg
from app.train.checkpoint import LoadedCheckpoint, load_checkpoint

log = logging.getLogger(__name__)
Report = dict[str, Any]


@dataclass(frozen=True)
class Quality:
    """What the quantization plot and the tracking tag show of a task's report: its quality
    metric for each variant (`torch_fp32`, `onnx_fp32`, `onnx_int8`), and each variant's
    latency by setting."""

    metric: str  # as the plot titles it, e.g. "accuracy (%)"
    key: str  # the tracking metric's name: export_int8_<key>
    values: dict[str, float]  # in the report's units
    higher_is_better: bool
    latency_ms: dict[str, dict[str, float]]  # variant -> setting -> ms
    shown: float = 1.0  # the plot's scale of the values (100: a fraction shown in %)


@dataclass(frozen=True)
class ExportParts:
    """What a task adds to export: the same parts, by the same names, for every task."""

    splits: tuple[str, ...]  # the held-out splits export reads (hashed before any work)
    # (config, checkpoint) -> the held-out rows every later part measures on
    held_out: Callable[[Config, LoadedCheckpoint], Any]
    # (config, checkpoint, held-out rows, work folder) -> the fp32 graph files written
    write_graphs: Callable[[Config, LoadedCheckpoint, Any, str], None]
    # (config, checkpoint, held-out rows, work folder) -> the report: int8 written, both
    # variants measured (parity, quality, sizes, latency, report["quantization"])
    quantize: Callable[[Config, LoadedCheckpoint, Any, str], Report]
    # (report, config) -> why the task's own gate refuses the int8 variant, or None
    refusal: Callable[[Report, Config], str | None]
    # (config, checkpoint, held-out rows, work folder, report) -> the program files written
    programs: Callable[[Config, LoadedCheckpoint, Any, str, Report], dict[str, prg.ProgramInfo]]
    schema: Callable[[LoadedCheckpoint, str], dict[str, Any]]  # (checkpoint, task) -> schema.json
    files: Callable[[LoadedCheckpoint], dict[str, bytes]]  # other files the artifact carries
    quality: Callable[[Report], Quality]


EXPORT = Part[ExportParts]("export")


def export(config: Config, checkpoint_uri: str) -> dict[str, Any]:
    """The checkpoint's task's artifact, built, verified, gated and published."""
    from app.evaluate.held_out import verify_dataset
    from app.export.publish import publish, write_metadata

    loaded = load_checkpoint(checkpoint_uri)
    task = run_task(loaded.config.train.task, loaded.preprocessor.kind)
    parts = task.part(EXPORT)
    verify_dataset(config, parts.splits)
    held_out = parts.held_out(config, loaded)
    with tempfile.TemporaryDirectory() as work:
        parts.write_graphs(config, loaded, held_out, work)
        report = {"task": task.name, **parts.quantize(config, loaded, held_out, work)}
        gate(report, config, parts.refusal)
        programs = parts.programs(config, loaded, held_out, work, report)
        quality = parts.quality(report)
        write_quantization_plot(work, config, report, quality)  # the manifest hashes it
        for name, data in parts.files(loaded).items():
            with open(os.path.join(work, name), "wb") as f:
                f.write(data)
        schema = parts.schema(loaded, task.name)
        write_metadata(work, config, loaded, report, checkpoint_uri, schema, programs)
        uri = publish(work, config.registry, config.artifact_name)
    log.info("export: published %s", uri)
    from app.train.tracking import tag_artifact

    tag_artifact(loaded.meta.mlflow_run_id, uri, quality, report)
    plots = {"quantization": storage.join(uri, art.QUANTIZATION_PNG)}
    return {"stage": "export", "artifact": uri, "report": report, "plots": plots}


# --- the gate ------------------------------------------------------------------------------------


def gate(report: Report, config: Config, refusal: Callable[[Report, Config], str | None]) -> None:
    """Refuse (GateError: exit 3, nothing published) an int8 variant larger than
    export.max_size_ratio of fp32, or what the task's own rule refuses."""
    why = size_refusal(report, config) or refusal(report, config)
    if why:
        raise GateError(f"export refused: {why}", report)


def size_refusal(report: Report, config: Config) -> str | None:
    limit, ratio = config.export.max_size_ratio, report["size_ratio_int8"]
    if limit is not None and ratio > limit:
        return f"int8 model is {ratio:.2f}x the fp32 size, above export.max_size_ratio={limit}"
    return None


def parity_refusal(report: Report, config: Config, compared: str) -> str | None:
    """ONNX fp32 against torch (`compared` says on what), for tasks whose parity is a largest
    absolute difference of logits."""
    tolerance, parity = config.export.parity_tolerance, report["parity"]["max_abs_diff"]
    if not parity <= tolerance:  # a NaN fails too
        return (
            f"ONNX fp32 differs from torch by {parity:.3g} (max abs logit diff{compared}), "
            f"above export.parity_tolerance={tolerance}"
        )
    return None


def sizes(work: str, files: dict[str, list[str]]) -> dict[str, Any]:
    """The report's sizes: bytes of each variant's files (`files`: variant -> file names in
    `work`, ONNX external data included) and int8's ratio to fp32."""
    size = {
        v: sum(os.path.getsize(os.path.join(work, f)) for f in names) for v, names in files.items()
    }
    return {"size_bytes": size, "size_ratio_int8": size["int8"] / size["fp32"]}


# --- what every artifact shows of its quantization -----------------------------------------------


def write_quantization_plot(work: str, config: Config, report: Report, quality: Quality) -> None:
    """`quantization.png`: the task's quality metric, size and latency of fp32 and int8."""
    from app import plots

    method = report["quantization"]["method"]
    if isinstance(method, dict):  # one per graph
        method = ", ".join(sorted(set(method.values())))
    title = f"{config.artifact_name}: fp32 vs int8 ({method} quantization)"
    with open(os.path.join(work, art.QUANTIZATION_PNG), "wb") as f:
        f.write(plots.quantization(quality, report["size_bytes"], title))
