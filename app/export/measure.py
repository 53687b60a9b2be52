"""How export measures a variant, whatever runs it (ONNX Runtime or a compiled program, both
called as `run(["logits"], feeds)`): latency, throughput at the replica's batch, how far a
row's answer moves with its batch mates, and the accuracy-drop rule of the gate."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from app.runtime import artifact as art

Inputs = dict[str, np.ndarray]


def resized(sample: Inputs, rows: int) -> Inputs:
    return {k: np.resize(v, (rows, *v.shape[1:])) for k, v in sample.items()}


def median_call_s(session: Any, inputs: Inputs, repeats: int) -> float:
    art.run_logits(session, inputs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        art.run_logits(session, inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latency_ms(session: Any, sample: Inputs, repeats: int) -> dict[str, float]:
    return {
        f"batch_{rows}": 1000 * median_call_s(session, resized(sample, rows), repeats)
        for rows in (1, 32)
    }


def rows_per_s(session: Any, sample: Inputs, rows: int, repeats: int) -> float:
    """In-process throughput at `rows` rows a call, one thread: what `serve.variant: auto`
    chooses by."""
    return rows / median_call_s(session, resized(sample, rows), repeats)


def batch_drift(session: Any, sample: Inputs, rows: int = 32) -> float:
    """The largest logit difference between rows run together and each run alone: zero for a
    variant whose row's answer is its own (static scales, fixed kernels)."""
    part = {k: v[:rows] for k, v in sample.items()}
    together = art.run_logits(session, part)
    n = len(together)
    alone = np.concatenate(
        [art.run_logits(session, {k: v[i : i + 1] for k, v in part.items()}) for i in range(n)]
    )
    return float(np.abs(together - alone).max())


def allowed_drop_points(report: dict[str, Any], max_drop: float) -> float:
    """`export.max_accuracy_drop`, but never below one validation sample: on a few hundred rows
    a single flipped prediction is noise, not a quantization loss. A negative setting (tests
    make the gate fire with it) is taken as is."""
    if max_drop < 0:
        return max_drop
    return max(max_drop, 100.0 / max(report["accuracy_rows"], 1))


def accuracy_drop_allowed(report: dict[str, Any], max_drop: float) -> bool:
    return report["accuracy_drop_points"] <= allowed_drop_points(report, max_drop) + 1e-9
