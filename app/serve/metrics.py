"""Request-path metrics kept in Python and recorded in Ray's metrics once a second, off the
event loop.

Every `ray.util.metrics` call drops the GIL for its C++ part and has to take it back; in a model
replica whose ONNX Runtime threads are busy, the event loop then waits, for each of the three
records a request makes (py-spy on the width-256 Transformer's replica at 32 connections: ~7%
of the event loop's samples). Counters are summed here and increment once per flush;
histogram observations are replayed by the flush thread, which can wait for the GIL without
holding up request parsing. Up to one interval of observations is lost if the process dies,
as with Serve's own cached request metrics.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ray.serve")


class MetricBuffer:
    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._counts: dict[tuple[Any, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self._values: list[tuple[Any, float, dict[str, str]]] = []
        self._levels: dict[tuple[Any, tuple[tuple[str, str], ...]], float] = {}
        self._samplers: list[Callable[[], None]] = []  # read levels once a flush, off the hot path
        self._thread = threading.Thread(target=self._run, name="metric-flush", daemon=True)
        self._thread.start()

    def inc(self, counter: Any, tags: dict[str, str], by: float = 1) -> None:
        with self._lock:
            self._counts[(counter, tuple(sorted(tags.items())))] += by

    def inc_and_observe(
        self,
        counter: Any,
        counter_tags: dict[str, str],
        histogram: Any,
        value: float,
        tags: dict[str, str],
    ) -> None:
        """`inc` and `observe` under one lock (a request's count and latency)."""
        with self._lock:
            self._counts[(counter, tuple(sorted(counter_tags.items())))] += 1
            self._values.append((histogram, value, tags))

    def observe(self, histogram: Any, value: float, tags: dict[str, str]) -> None:
        with self._lock:
            self._values.append((histogram, value, tags))

    def set(self, gauge: Any, value: float, tags: dict[str, str]) -> None:
        """A gauge's level: the last one set before a flush is recorded."""
        with self._lock:
            self._levels[(gauge, tuple(sorted(tags.items())))] = value

    def sample(self, sampler: Callable[[], None]) -> None:
        """`sampler` runs at every flush, before the levels are recorded: gauges that change
        with every step (a decode batch's cache) are read once a flush, not set per token."""
        self._samplers.append(sampler)

    def flush(self) -> None:
        """Record everything buffered so far in the metrics it belongs to."""
        for sampler in list(self._samplers):
            try:
                sampler()
            except Exception:  # noqa: BLE001 - must not stop the flush thread
                log.exception("a metrics sampler failed")
        with self._lock:
            counts, self._counts = self._counts, defaultdict(float)
            values, self._values = self._values, []
            levels, self._levels = self._levels, {}
        failed = 0
        for (gauge, pairs), level in levels.items():
            failed += not _recorded(gauge.set, level, dict(pairs))
        for (counter, pairs), n in counts.items():
            failed += not _recorded(counter.inc, n, dict(pairs))
        for histogram, value, tags in values:
            failed += not _recorded(histogram.observe, value, tags)
        if failed:
            log.warning("%d buffered metric records failed (see the first error above)", failed)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.flush()


def model_histogram(name: str, description: str, boundaries: list[float]) -> Any:
    """A Ray histogram tagged by model (how every custom serving metric is labelled)."""
    from ray.util.metrics import Histogram

    return Histogram(name, description=description, boundaries=boundaries, tag_keys=("model",))


def model_gauge(name: str, description: str) -> Any:
    from ray.util.metrics import Gauge

    return Gauge(name, description=description, tag_keys=("model",))


def model_counter(name: str, description: str, tag_keys: tuple[str, ...] = ("model",)) -> Any:
    from ray.util.metrics import Counter

    return Counter(name, description=description, tag_keys=tag_keys)


class Deferred(collections.deque):
    """Records made on a request path, kept as they come and recorded by the flush thread:
    `append(item)` is the deque's own, so a request takes no lock and makes no Python call to
    record. `record(buffer, item)` turns one item into the buffer's records."""

    def __init__(
        self, record: Callable[[MetricBuffer, Any], None], buffer: MetricBuffer | None = None
    ):
        super().__init__()
        self.buffer = buffer or process_buffer()
        self._record = record
        self.buffer.sample(self._drain)

    def _drain(self) -> None:
        while self:
            self._record(self.buffer, self.popleft())


@functools.cache
def process_buffer() -> MetricBuffer:
    """The one buffer (and flush thread) of this process, made on first use."""
    return MetricBuffer()


_warned: set[str] = set()


def _recorded(record: Any, value: float, tags: dict[str, str]) -> bool:
    """One record; a fault (a metrics backend down, a tag Ray refuses) costs that record only."""
    try:
        record(value, tags=tags)
        return True
    except Exception as e:  # noqa: BLE001 - must not stop the flush thread
        if type(e).__name__ not in _warned:
            _warned.add(type(e).__name__)
            log.warning("recording a buffered metric failed: %s: %s", type(e).__name__, e)
        return False


class RetrievalMetrics:
    """A retrieval replica's requests, by the name it serves (a model's embeddings, an index's
    searches): the inputs or queries a request carries and its time in the replica; and, for
    an index, the version served (so a dashboard shows a new version taking over)."""

    def __init__(self, name: str, version: str | None = None):
        self.tags = {"model": name}
        self.items = model_histogram(
            "raytorch_retrieval_items_per_request",
            "inputs embedded or queries searched per request",
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
        )
        self.latency = model_histogram(
            "raytorch_retrieval_latency_ms",
            "embedding or search time in the replica (ms)",
            [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
        )
        self.done = Deferred(self._record)
        if version is not None and version.isdigit():
            gauge = model_gauge("raytorch_index_version", "the index version a replica serves")
            buffer, level = self.done.buffer, float(version)
            buffer.sample(lambda: buffer.set(gauge, level, self.tags))

    def observe(self, items: int, latency_ms: float) -> None:
        self.done.append((items, latency_ms))

    def _record(self, buffer: MetricBuffer, answer: tuple[int, float]) -> None:
        items, latency_ms = answer
        buffer.observe(self.items, items, self.tags)
        buffer.observe(self.latency, latency_ms, self.tags)
