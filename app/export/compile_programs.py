"""Programs beside the ONNX graphs (`export.formats`): the model torch.export'ed, then compiled
by AOTInductor (`model.pt2`) or lowered to ExecuTorch's XNNPACK delegate (`model.pte`, and
`model.int8.pte` quantized by the PT2E XNNPACK quantizer with static scales calibrated on train
rows). Each goes through its task's check, the gate its ONNX variants pass (a classifier's in
app/tasks/classify/compiled.py, a retrieval model's in app/tasks/retrieval/export.py), and
every one must give a row the same answer alone as in a batch. A program that cannot be built or
fails a check is left out of the artifact and the report says why; the ONNX variants publish
either way.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from app.config import Config
from app.runtime import programs as prg

log = logging.getLogger(__name__)
MAX_PTE_BATCH = 1024  # ExecuTorch plans its memory for the largest batch a program takes


class Positional(nn.Module):
    """A keyword-argument model with the positional inputs exporters trace."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs, strict=True)))


@dataclass
class Subject:
    """One graph as every program of it is built: a module taking positional inputs (their
    names in order; `sequences`, those with a free sequence axis), val rows (the export example,
    parity, batch drift, latency) and the rows int8's static scales are calibrated on."""

    module: nn.Module
    names: list[str]
    sequences: list[str]
    sample: dict[str, np.ndarray]
    calibration: Callable[[], list[dict[str, np.ndarray]]]

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(self.sample[n][:2]) for n in self.names)

    def dynamic_shapes(
        self, max_batch: int | None, free_sequence: bool
    ) -> tuple[dict[int, Any], ...]:
        """Batch free (up to `max_batch`); a sequence too when `free_sequence`, up to its padded
        length (XNNPACK takes one free axis: its programs get rows of full length)."""
        batch = torch.export.Dim("batch", min=1, **({"max": max_batch} if max_batch else {}))
        shapes = []
        for name in self.names:
            axes: dict[int, Any] = {0: batch}
            if name in self.sequences and free_sequence:
                axes[1] = torch.export.Dim("sequence", min=1, max=self.sample[name].shape[1])
            shapes.append(axes)
        return tuple(shapes)

    def export(
        self, module: nn.Module, max_batch: int | None = None, free_sequence: bool = True
    ) -> Any:
        shapes: Any = self.dynamic_shapes(max_batch, free_sequence)
        if not isinstance(module, torch.fx.GraphModule):  # `*inputs`: one variadic argument
            shapes = (shapes,)
        return torch.export.export(module, self.args(), dynamic_shapes=shapes)

    def open(self, variant: str, data: bytes, threads: int = 1) -> prg.ProgramSession:
        return open_session(variant, data, self.names, self.sequences, threads)


def open_session(
    variant: str, data: bytes, names: list[str], sequences: list[str], threads: int = 1
) -> prg.ProgramSession:
    free = variant == "aoti"  # XNNPACK programs take full-length rows
    inputs = [
        prg.InputInfo(n, ["batch", "sequence" if free and n in sequences else -1]) for n in names
    ]
    if variant == "aoti":
        return prg.aoti_session(data, inputs, threads)
    return prg.executorch_session(data, inputs)


def build_aoti(subject: Subject) -> bytes:
    return prg.aoti_compile(subject.export(subject.module))


def build_executorch(subject: Subject) -> bytes:
    return _lower(subject.export(subject.module, MAX_PTE_BATCH, free_sequence=False))


def build_executorch_int8(subject: Subject) -> bytes:
    """PT2E: observers inserted, calibrated, folded into static int8 scales."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True)
    )
    module = subject.export(subject.module, MAX_PTE_BATCH, free_sequence=False).module()
    prepared = prepare_pt2e(module, quantizer)
    with torch.no_grad():
        for batch in subject.calibration():
            prepared(*(torch.from_numpy(batch[n]) for n in subject.names))
    return _lower(subject.export(convert_pt2e(prepared), MAX_PTE_BATCH, free_sequence=False))


def _lower(exported: Any) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    lowered = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    return bytes(lowered.to_executorch().buffer)


BUILDERS: dict[str, Callable[[Subject], bytes]] = {
    "aoti": build_aoti,
    "executorch": build_executorch,
    "executorch_int8": build_executorch_int8,
}
PRECISION = {"aoti": "fp32", "executorch": "fp32", "executorch_int8": "int8"}
# (variant, its sessions by graph) -> (its measurements, why it may not be published or None)
Check = Callable[[str, dict[str, Any]], tuple[dict[str, Any], str | None]]


def build_all(
    config: Config, subjects: dict[str, Subject], check: Check, work: str, report: dict[str, Any]
) -> dict[str, prg.ProgramInfo]:
    """Writes into `work` each requested program (every graph of it) that builds and passes
    `check`; report["programs"] gets each one's measurements, or why it is absent. Returns the
    manifest's entries."""
    report["programs"] = {}
    infos: dict[str, prg.ProgramInfo] = {}
    threads = torch.get_num_threads()  # measuring sets one thread; the export process keeps its own
    try:
        for variant in wanted(config):
            report["programs"][variant], data = build_variant(subjects, variant, check)
            for graph, program in data.items():
                name = prg.program_file(graph, variant)
                with open(os.path.join(work, name), "wb") as f:
                    f.write(program)
                infos[name] = program_info(variant)
    finally:
        torch.set_num_threads(threads)
    return infos


def build_variant(
    subjects: dict[str, Subject], variant: str, check: Check
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(what the report says of `variant`, its programs by graph when they passed)."""
    start = time.perf_counter()
    try:
        data = {graph: BUILDERS[variant](s) for graph, s in subjects.items()}
    except Exception as e:  # noqa: BLE001 - an operator the toolchain does not take: reported
        log.warning("export: %s not built (%s)", variant, first_line(e))
        return {"published": False, "reason": f"not built: {first_line(e)}"}, {}
    build_s = time.perf_counter() - start
    try:
        sessions = {graph: subjects[graph].open(variant, d) for graph, d in data.items()}
        measured, why = check(variant, sessions)
    except Exception as e:  # noqa: BLE001 - built but does not run here: reported
        log.warning("export: %s does not run (%s)", variant, first_line(e))
        return {"published": False, "reason": f"does not run: {first_line(e)}"}, {}
    measured.update(
        precision=PRECISION[variant],
        build_s=round(build_s, 2),
        size_bytes=sum(len(d) for d in data.values()),
        max_batch=min((s.max_batch for s in sessions.values() if s.max_batch), default=None),
    )
    log.info("export: %s built in %.1f s: %s", variant, build_s, why or "passed the gate")
    if why:
        return {"published": False, "reason": why, **measured}, {}
    return {"published": True, **measured}, data


def drift_refusal(drift: float, tolerance: float) -> str | None:
    if drift > tolerance:
        return (
            f"a row's output moves by {drift:.3g} with its batch mates, above "
            f"export.parity_tolerance={tolerance}"
        )
    return None


def program_info(variant: str) -> prg.ProgramInfo:
    fmt = "aoti" if variant == "aoti" else "executorch"
    return prg.ProgramInfo(
        format=fmt,
        precision=PRECISION[variant],  # type: ignore[arg-type]
        torch=torch.__version__,
        cpu_capability=prg.cpu_capability() if fmt == "aoti" else None,
        machine=platform.machine() if fmt == "aoti" else None,
        device="cpu",
    )


def wanted(config: Config) -> list[str]:
    """The program variants `export.formats` asks for (beside ONNX)."""
    return [v for f in config.export.formats if f != "onnx" for v in prg.FORMATS[f]]


def not_for_task(config: Config, task: str, why: str) -> dict[str, Any]:
    """report["programs"] of a task that exports ONNX only: each requested program, and why."""
    variants = wanted(config)
    if variants:
        log.warning("export: task %s builds no %s (%s)", task, ", ".join(variants), why)
    return {v: {"published": False, "reason": f"task {task}: {why}"} for v in variants}


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"
