"""How export measures a variant, whatever runs it (ONNX Runtime or a compiled program, both
called as `run([output], feeds)`; `output` is a classifier's `logits` unless said otherwise):
latency, throughput at the replica's batch, and how far a row's answer moves with its batch
mates."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

Inputs = dict[str, np.ndarray]
LOGITS = "logits"


def resized(sample: Inputs, rows: int) -> Inputs:
    return {k: np.resize(v, (rows, *v.shape[1:])) for k, v in sample.items()}


def run(session: Any, inputs: Inputs, output: str = LOGITS) -> np.ndarray:
    return session.run([output], inputs)[0]


def median_call_s(session: Any, inputs: Inputs, repeats: int, output: str = LOGITS) -> float:
    run(session, inputs, output)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(session, inputs, output)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latency_ms(
    session: Any, sample: Inputs, repeats: int, output: str = LOGITS
) -> dict[str, float]:
    """Median time of a call at batch 1 and batch 32 (the sample's rows, repeated)."""
    return {
        f"batch_{rows}": 1000 * median_call_s(session, resized(sample, rows), repeats, output)
        for rows in (1, 32)
    }


def rows_per_s(session: Any, sample: Inputs, rows: int, repeats: int) -> float:
    """In-process throughput at `rows` rows a call, one thread: what `serve.variant: auto`
    chooses by."""
    return rows / median_call_s(session, resized(sample, rows), repeats)


def batch_drift(session: Any, sample: Inputs, rows: int = 32, output: str = LOGITS) -> float:
    """The largest output difference between rows run together and each run alone: zero for a
    variant whose row's answer is its own (static scales, fixed kernels)."""
    part = {k: v[:rows] for k, v in sample.items()}
    together = run(session, part, output)
    n = len(together)
    alone = np.concatenate(
        [run(session, {k: v[i : i + 1] for k, v in part.items()}, output) for i in range(n)]
    )
    return float(np.abs(together - alone).max())
