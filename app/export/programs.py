"""Programs beside the ONNX graphs (`export.formats`): the model torch.export'ed, then compiled
by AOTInductor (`model.pt2`) or lowered to ExecuTorch's XNNPACK delegate (`model.pte`, and
`model.int8.pte` quantized by the PT2E XNNPACK quantizer with static scales calibrated on train
rows). Each goes through the gate the ONNX variants do: fp32 programs agree with torch within
`export.parity_tolerance`, int8 ones lose at most `export.max_accuracy_drop` against fp32, and
every one gives a row the same answer alone as in a batch. A program that cannot be built or
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
from app.data.preprocess import Preprocessor
from app.evaluate import labeled_batches, predictions, torch_predict
from app.export import quantize as q
from app.export.measure import allowed_drop_points, batch_drift, latency_ms
from app.runtime import artifact as art
from app.runtime import programs as prg
from app.train.checkpoint import LoadedCheckpoint

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
    """What every program is built from and checked against."""

    config: Config
    pre: Preprocessor
    module: nn.Module  # Positional, in eval mode
    sample: dict[str, np.ndarray]  # val rows (parity, batch drift, latency)
    torch_logits: np.ndarray
    fp32_accuracy: float  # ONNX fp32's, on the whole val split
    accuracy_rows: int

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(self.sample[n][:2]) for n in self.pre.input_names())

    def dynamic_shapes(
        self, max_batch: int | None, free_sequence: bool
    ) -> tuple[dict[int, Any], ...]:
        """Batch free (up to `max_batch`); text's sequence too when `free_sequence`, up to its
        padded length (XNNPACK takes one free axis: its programs get rows of full length)."""
        batch = torch.export.Dim("batch", min=1, **({"max": max_batch} if max_batch else {}))
        shapes = []
        for name in self.pre.input_names():
            axes: dict[int, Any] = {0: batch}
            if self.pre.variable_length and free_sequence:
                axes[1] = torch.export.Dim("sequence", min=1, max=self.sample[name].shape[1])
            shapes.append(axes)
        return tuple(shapes)

    def export(
        self, module: nn.Module, max_batch: int | None = None, free_sequence: bool = True
    ) -> Any:
        shapes: Any = self.dynamic_shapes(max_batch, free_sequence)
        if isinstance(module, Positional):  # `*inputs`: the shapes of its one variadic argument
            shapes = (shapes,)
        return torch.export.export(module, self.args(), dynamic_shapes=shapes)


def build_aoti(subject: Subject) -> bytes:
    return prg.aoti_compile(subject.export(subject.module))


def build_executorch(subject: Subject) -> bytes:
    return _lower(subject.export(subject.module, MAX_PTE_BATCH, free_sequence=False))


def build_executorch_int8(subject: Subject) -> bytes:
    """PT2E: observers inserted, calibrated on train rows, folded into static int8 scales."""
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
    names = subject.pre.input_names()
    with torch.no_grad():
        for batch in q.calibration_inputs(subject.config, subject.pre):
            prepared(*(torch.from_numpy(batch[n]) for n in names))
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


def open_program(variant: str, data: bytes, pre: Preprocessor, threads: int = 1) -> Any:
    free = pre.variable_length and variant == "aoti"  # XNNPACK programs take full-length rows
    shape = ["batch", "sequence" if free else -1]
    inputs = [prg.InputInfo(name, shape) for name in pre.input_names()]
    if variant == "aoti":
        return prg.aoti_session(data, inputs, threads)
    return prg.executorch_session(data, inputs)


def build_programs(
    config: Config,
    loaded: LoadedCheckpoint,
    sample: dict[str, np.ndarray],
    work: str,
    report: dict[str, Any],
) -> dict[str, prg.ProgramInfo]:
    """Writes into `work` each requested program that builds and passes; report["programs"]
    gets each one's measurements, or why it is absent. Returns the manifest's entries."""
    wanted = [v for f in config.export.formats if f != "onnx" for v in prg.FORMATS[f]]
    report["programs"] = {}
    if not wanted:
        return {}
    pre = loaded.preprocessor
    with torch.no_grad():
        torch_logits = torch_predict(loaded.model)(sample)
    subject = Subject(
        config,
        pre,
        Positional(loaded.model, pre.input_names()).eval(),
        sample,
        torch_logits,
        report["accuracy"]["onnx_fp32"],
        report["accuracy_rows"],
    )
    threads = torch.get_num_threads()  # measuring sets one thread; the export process keeps its own
    entries: dict[str, Any] = {}
    infos: dict[str, prg.ProgramInfo] = {}
    try:
        for variant in wanted:
            entries[variant], data = build_one(subject, variant)
            if data is not None:
                name = prg.PROGRAM_FILES[variant]
                with open(os.path.join(work, name), "wb") as f:
                    f.write(data)
                infos[name] = program_info(variant)
    finally:
        torch.set_num_threads(threads)
    report["programs"] = entries
    return infos


def build_one(subject: Subject, variant: str) -> tuple[dict[str, Any], bytes | None]:
    """(what the report says of `variant`, its bytes when it passed)."""
    start = time.perf_counter()
    try:
        data = BUILDERS[variant](subject)
    except Exception as e:  # noqa: BLE001 - an operator the toolchain does not take: reported
        log.warning("export: %s not built (%s)", variant, first_line(e))
        return {"published": False, "reason": f"not built: {first_line(e)}"}, None
    build_s = time.perf_counter() - start
    try:
        measured = measure(subject, variant, data)
    except Exception as e:  # noqa: BLE001 - built but does not run here: reported
        log.warning("export: %s does not run (%s)", variant, first_line(e))
        return {"published": False, "reason": f"does not run: {first_line(e)}"}, None
    measured.update(build_s=round(build_s, 2), size_bytes=len(data))
    why = gate_program(subject, variant, measured)
    log.info("export: %s built in %.1f s: %s", variant, build_s, why or "passed the gate")
    if why:
        return {"published": False, "reason": why, **measured}, None
    return {"published": True, **measured}, data


def measure(subject: Subject, variant: str, data: bytes) -> dict[str, Any]:
    e = subject.config.export
    session = open_program(variant, data, subject.pre)
    logits = art.run_logits(session, subject.sample)
    y_true, y_pred = predictions(
        lambda x: art.run_logits(session, x), labeled_batches(subject.config, subject.pre, "val")
    )
    return {
        "precision": PRECISION[variant],
        "max_abs_diff": float(np.abs(logits - subject.torch_logits).max()),
        "accuracy": float((y_true == y_pred).mean()),
        "batch_drift": batch_drift(session, subject.sample),
        "latency_ms": latency_ms(session, subject.sample, e.latency_repeats),
        "max_batch": session.max_batch,  # rows a call takes at most (null: any)
    }


def gate_program(subject: Subject, variant: str, m: dict[str, Any]) -> str | None:
    """Why the program may not be published (one line), or None."""
    e = subject.config.export
    if m["precision"] == "fp32" and m["max_abs_diff"] > e.parity_tolerance:
        return (
            f"differs from torch by {m['max_abs_diff']:.3g} (max abs logit diff), above "
            f"export.parity_tolerance={e.parity_tolerance}"
        )
    if m["batch_drift"] > e.parity_tolerance:
        return (
            f"a row's logits move by {m['batch_drift']:.3g} with its batch mates, above "
            f"export.parity_tolerance={e.parity_tolerance}"
        )
    drop = 100 * (subject.fp32_accuracy - m["accuracy"])
    allowed = allowed_drop_points({"accuracy_rows": subject.accuracy_rows}, e.max_accuracy_drop)
    if drop > allowed + 1e-9:
        return (
            f"accuracy {100 * m['accuracy']:.2f}% is {drop:.2f} points below ONNX fp32, more "
            f"than export.max_accuracy_drop={e.max_accuracy_drop}"
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


def not_for_task(config: Config, task: str, why: str) -> dict[str, Any]:
    """report["programs"] of a task that exports ONNX only: each requested program, and why."""
    wanted = [v for f in config.export.formats if f != "onnx" for v in prg.FORMATS[f]]
    if wanted:
        log.warning("export: task %s builds no %s (%s)", task, ", ".join(wanted), why)
    return {v: {"published": False, "reason": f"task {task}: {why}"} for v in wanted}


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"
