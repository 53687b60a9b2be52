"""Task `classify`'s programs (`export.formats`: AOTInductor, ExecuTorch), built by
app/export/compile_programs.py and checked as its ONNX variants are (parity with torch, val
accuracy against ONNX fp32, a row's answer alone as in a batch), and each servable variant's
speed, by which `serve.variant: auto` chooses."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.config import Config
from app.data.preprocess import Preprocessor
from app.evaluate.held_out import labeled_batches, predictions, torch_predict
from app.export import quantize as q
from app.export.compile_programs import (
    PRECISION,
    Positional,
    Subject,
    build_all,
    drift_refusal,
    open_session,
    wanted,
)
from app.export.measure import batch_drift, latency_ms, rows_per_s
from app.runtime import artifact as art
from app.runtime import programs as prg
from app.tasks.classify.accuracy import allowed_drop_points
from app.train.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)
Inputs = dict[str, np.ndarray]


def programs(
    config: Config, loaded: LoadedCheckpoint, sample: Inputs, work: str, report: dict[str, Any]
) -> dict[str, prg.ProgramInfo]:
    """The classifier's programs (one graph, `model`); report["serving"]: each servable
    variant's speed."""
    built = build_programs(config, loaded, sample, work, report)
    report["serving"] = serving_speeds(config, loaded.preprocessor, work, sample)
    return built


def build_programs(
    config: Config, loaded: LoadedCheckpoint, sample: Inputs, work: str, report: dict[str, Any]
) -> dict[str, prg.ProgramInfo]:
    report["programs"] = {}
    if not wanted(config):
        return {}
    pre = loaded.preprocessor
    names = pre.input_names()
    subject = Subject(
        Positional(loaded.model, names).eval(),
        names,
        names if pre.variable_length else [],
        sample,
        lambda: q.calibration_inputs(config, pre),
    )
    with torch.no_grad():
        torch_logits = torch_predict(loaded.model)(sample)
    check = ClassifierCheck(config, pre, sample, torch_logits, report)
    return build_all(config, {"model": subject}, check, work, report)


class ClassifierCheck:
    """A classifier program against torch (parity), ONNX fp32 (val accuracy) and itself
    (batch drift), by the export gate's rules."""

    def __init__(self, config: Config, pre: Preprocessor, sample, torch_logits, report):
        self.config, self.pre, self.sample, self.torch_logits = config, pre, sample, torch_logits
        self.fp32_accuracy = report["accuracy"]["onnx_fp32"]
        self.accuracy_rows = report["accuracy_rows"]

    def __call__(self, variant: str, sessions: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        session, e = sessions["model"], self.config.export
        logits = art.run_logits(session, self.sample)
        y_true, y_pred = predictions(
            lambda x: art.run_logits(session, x), labeled_batches(self.config, self.pre, "val")
        )
        m = {
            "max_abs_diff": float(np.abs(logits - self.torch_logits).max()),
            "accuracy": float((y_true == y_pred).mean()),
            "batch_drift": batch_drift(session, self.sample),
            "latency_ms": latency_ms(session, self.sample, e.latency_repeats),
        }
        return m, self.refusal(PRECISION[variant], m)

    def refusal(self, precision: str, m: dict[str, Any]) -> str | None:
        e = self.config.export
        if precision == "fp32" and m["max_abs_diff"] > e.parity_tolerance:
            return (
                f"differs from torch by {m['max_abs_diff']:.3g} (max abs logit diff), above "
                f"export.parity_tolerance={e.parity_tolerance}"
            )
        if why := drift_refusal(m["batch_drift"], e.parity_tolerance):
            return why
        drop = 100 * (self.fp32_accuracy - m["accuracy"])
        rows = {"accuracy_rows": self.accuracy_rows}
        if drop > allowed_drop_points(rows, e.max_accuracy_drop) + 1e-9:
            return (
                f"accuracy {100 * m['accuracy']:.2f}% is {drop:.2f} points below ONNX fp32, more "
                f"than export.max_accuracy_drop={e.max_accuracy_drop}"
            )
        return None


def open_program(
    variant: str, data: bytes, pre: Preprocessor, threads: int = 1
) -> prg.ProgramSession:
    """A classifier's program as a session (export's speed check, B21)."""
    names = pre.input_names()
    return open_session(variant, data, names, names if pre.variable_length else [], threads)


def serving_speeds(config: Config, pre: Preprocessor, work: str, sample: Inputs) -> dict[str, Any]:
    """Each servable variant's in-process rows/s at `serve.batching.max_batch_size` rows (this
    export's setting), one thread: `serve.variant: auto` serves the fastest a replica can run."""
    rows = config.serve.batching.max_batch_size
    sessions = {
        v: art.create_session(art.local_graph(os.path.join(work, f)))
        for v, f in art.MODEL_FILES.items()
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
