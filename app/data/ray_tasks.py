"""Pieces as Ray Data tasks: one task a piece, streamed (Ray Data starts tasks as CPUs free up
and shows its progress), the small record each returns gathered in the pieces' order."""

from __future__ import annotations

import logging
import pickle
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
        rows = [{"i": i, "item": pickle.dumps(item)} for i, item in enumerate(items)]
        done = (
            ray.data.from_items(rows, override_num_blocks=len(rows))
            .map(_run, fn_kwargs={"fn": fn}, num_cpus=self.cpus)  # type: ignore[arg-type]
            .take_all()
        )
        results = sorted(done, key=lambda r: r["i"])
        self.nodes.update(r["node"] for r in results)
        log.info("%s: done on %d node(s)", what, len({r["node"] for r in results}))
        return [pickle.loads(r["result"]) for r in results]


def _run(row: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    import ray

    result = pickle.dumps(fn(pickle.loads(row["item"])))
    return {"i": row["i"], "result": result, "node": ray.get_runtime_context().get_node_id()}
