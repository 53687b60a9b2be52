"""Pieces as Ray Data tasks: one task a piece, streamed (Ray Data starts tasks as CPUs free up
and shows its progress), the small record each returns gathered in the pieces' order."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class RayTasks:
    """`Tasks` on the connected Ray cluster; each task asks for `cpus` CPUs."""

    def __init__(self, cpus: float = 1.0):
        self.cpus = cpus
        self.nodes: set[str] = set()  # the nodes whose tasks returned a result

    def map(self, fn: Callable[[T], R], items: Sequence[T], what: str) -> list[R]:
        import ray.data

        if not items:
            return []
        log.info("%s: %d task(s)", what, len(items))
        # The rows are the items' numbers; the items travel with the function, serialised by
        # Ray like any task argument.
        rows = [{"i": i} for i in range(len(items))]
        done = (
            ray.data.from_items(rows, override_num_blocks=len(rows))
            .map(_run, fn_kwargs={"fn": fn, "items": list(items)}, num_cpus=self.cpus)  # type: ignore[arg-type]
            .take_all()
        )
        results = sorted(done, key=lambda r: r["i"])
        self.nodes.update(r["node"] for r in results)
        log.info("%s: done on %d node(s)", what, len({r["node"] for r in results}))
        return [r["result"].value for r in results]


class _Held:
    """A task's result as one opaque value: Ray Data keeps an object it cannot express in Arrow
    as it is (a tuple or list would come back as an Arrow list)."""

    def __init__(self, value: Any):
        self.value = value


def _run(row: dict[str, Any], fn: Callable[[Any], Any], items: list[Any]) -> dict[str, Any]:
    import ray

    result = _Held(fn(items[row["i"]]))
    return {"i": row["i"], "result": result, "node": ray.get_runtime_context().get_node_id()}
