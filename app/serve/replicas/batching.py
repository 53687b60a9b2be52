"""The batching policy of a classifier replica: which requests share an ONNX Runtime call.

A batch from Serve's `serve.batch` is split into groups of similar length (`padding_groups`:
padded tokens at most serve.batching.max_padding_waste of the real ones), and the groups are dealt to the
worker threads (`spread`). Whether requests share calls at all (serve.batching.calls: auto) is
measured once at start (`measure_batch_calls`): on a small CPU one call on many rows of a wide
Transformer can cost more per row than a call per row.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from app.config import ServeConfig
from app.runtime.artifact import run_logits

MASK = "attention_mask"
SHARE_MARGIN = 0.9


def row_lengths(inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Real (unpadded) length of each row: the attention mask's sum for text, 1 otherwise."""
    mask = inputs.get(MASK)
    if mask is None:
        return np.ones(len(next(iter(inputs.values()))), dtype=np.int64)
    return np.maximum(mask.sum(axis=1), 1)


def padding_groups(lengths: list[np.ndarray], max_waste: float) -> list[list[int]]:
    """Requests (by index) grouped so that each group, padded to its longest row, pads at most
    `max_waste` x its real tokens. Requests are taken shortest first, so a group only grows while
    the longer newcomer keeps the padding bounded; a request alone is always a valid group."""
    order = sorted(range(len(lengths)), key=lambda i: int(lengths[i].max()))
    groups: list[list[int]] = []
    longest = rows = real = 0
    for i in order:
        n, total, top = len(lengths[i]), int(lengths[i].sum()), int(lengths[i].max())
        new_longest = max(longest, top)
        padded = new_longest * (rows + n) - (real + total)
        if groups and padded <= max_waste * (real + total):
            groups[-1].append(i)
            longest, rows, real = new_longest, rows + n, real + total
        else:
            groups.append([i])
            longest, rows, real = top, n, total
    return groups


def spread(
    groups: list[list[int]], lengths: list[np.ndarray], workers: int
) -> list[list[list[int]]]:
    """Groups dealt to at most `workers` shares of about equal work (padded tokens), the largest
    first to the least loaded: each share is one worker thread's part of a batch."""

    def cost(group: list[int]) -> int:
        rows = sum(len(lengths[i]) for i in group)
        return rows * max(int(lengths[i].max()) for i in group)

    shares: list[list[list[int]]] = [[] for _ in range(min(workers, len(groups)))]
    load = [0] * len(shares)
    for group in sorted(groups, key=cost, reverse=True):
        k = load.index(min(load))
        shares[k].append(group)
        load[k] += cost(group)
    return shares


def measure_batch_calls(session: Any, batch: dict[str, np.ndarray], trim: bool) -> dict[str, Any]:
    """Whether one ONNX Runtime call on the rows of `batch` (text: cut to its longest row) costs
    clearly less than a call per row (text: each cut to its own length) plus the thread
    hand-offs the extra calls take; medians of a few timed rounds. The replica's choice for
    serve.batching.calls=auto."""

    def median_s(fn: Any, repeats: int = 7) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    lengths = row_lengths(batch)
    cut = trim and MASK in batch
    singles = [
        {k: v[i : i + 1, : lengths[i]] if cut else v[i : i + 1] for k, v in batch.items()}
        for i in range(len(lengths))
    ]
    many = {k: v[:, : lengths.max()] if cut else v for k, v in batch.items()}
    one_by_one_s = median_s(lambda: [run_logits(session, r) for r in singles])
    shared_s = median_s(lambda: run_logits(session, many))
    with ThreadPoolExecutor(1) as pool:  # an idle thread of its own: the hand-off alone
        handoff_s = median_s(lambda: pool.submit(int).result(), repeats=21)
    separate_s = one_by_one_s + (len(singles) - 1) * handoff_s
    return {
        # Shared calls must save a clear 10%: a batch that shares calls keeps fewer threads
        # busy, and the timings are taken while the replica starts (noisy).
        "share_calls": shared_s <= SHARE_MARGIN * separate_s,
        "rows": len(singles),
        "ms_one_call": round(1000 * shared_s, 4),
        "ms_a_call_per_row": round(1000 * one_by_one_s, 4),
        "ms_thread_handoff": round(1000 * handoff_s, 4),
    }


def takes_any_length(session: Any) -> bool:
    """Whether the ONNX model's text inputs have a free sequence axis (then a batch is cut to its
    longest row); models exported with a fixed length get the preprocessor's full padding."""
    try:
        shape = session.get_inputs()[0].shape
    except Exception:  # noqa: BLE001 - a session without shape info: keep the full padding
        return False
    return len(shape) > 1 and not isinstance(shape[1], int)


def serve_batcher(handler: Any, cfg: ServeConfig) -> Any:
    """Serve's dynamic batching around `handler`, its limits from config. Outside a Serve
    replica (tests, the bench's plain server) it is the same asyncio batcher."""
    from ray import serve

    from app.ray_private import batching_outside_serve

    batching_outside_serve()

    return serve.batch(
        max_batch_size=cfg.batching.max_batch_size,
        batch_wait_timeout_s=cfg.batching.batch_wait_timeout_s,
        max_concurrent_batches=cfg.batching.max_concurrent_batches,
    )(handler)
