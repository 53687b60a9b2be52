"""Pieces as Ray Data tasks: one task a piece, streamed (Ray Data starts tasks as CPUs free up
and shows its progress), the small record each returns gathered in the pieces' order.

A stage never waits in silence: each task reports its process's CPU time to a small actor
every few seconds, and the driver logs the stage's progress and fails it, naming its tasks and
where they run, once none has shown a sign of life (CPU used, a function returned, a result
delivered) for `stall_s`. Liveness, not completion: a tokenizer's training is one long task.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
BEAT_S = 5.0  # how often a task reports, and the driver looks
LOG_EVERY_S = 30.0
# CPU a task's process must use to count as alive: more than a Ray worker's own threads use
# idle, far less than any work.
ALIVE_CPU_SHARE = 0.02


class RayTasks:
    """`Tasks` on the connected Ray cluster; each task asks for `cpus` CPUs. A map whose tasks
    show no sign of life for `stall_s` seconds fails (UserError) instead of waiting."""

    def __init__(self, cpus: float = 1.0, stall_s: float = 300.0, beat_s: float = BEAT_S):
        self.cpus, self.stall_s, self.beat_s = cpus, stall_s, beat_s
        self.nodes: set[str] = set()  # the nodes whose tasks returned a result

    def map(self, fn: Callable[[T], R], items: Sequence[T], what: str) -> list[R]:
        import ray
        import ray.data

        if not items:
            return []
        log.info("%s: %d task(s)", what, len(items))
        pulse: Any = ray.remote(num_cpus=0)(Pulse).remote()
        # The rows are the items' numbers; the items travel with the function, serialised by
        # Ray like any task argument.
        rows = [{"i": i} for i in range(len(items))]
        kwargs = {"fn": fn, "items": list(items), "pulse": pulse, "beat_s": self.beat_s}
        dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
            _run,  # type: ignore[arg-type]
            fn_kwargs=kwargs,
            num_cpus=self.cpus,
        )
        watch = Watch(what, len(items), self.stall_s, self.beat_s, self.cpus)
        try:
            done = watch.run(dataset.take_all, pulse)
        finally:
            ray.kill(pulse)
        results = sorted(done, key=lambda r: r["i"])
        self.nodes.update(r["node"] for r in results)
        log.info("%s: done on %d node(s)", what, len({r["node"] for r in results}))
        # Bytes this job's own tasks pickled a moment ago (what Ray does to any task's return
        # value); never an artifact or a checkpoint read from storage.
        return [pickle.loads(r["result"]) for r in results]


class Pulse:
    """The tasks' latest reports, by task number: (node, pid, CPU seconds, returned)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, int, float, bool]] = {}

    def beat(self, i: int, node: str, pid: int, cpu_s: float, returned: bool) -> None:
        self.seen[i] = (node, pid, cpu_s, returned)

    def state(self) -> dict[int, tuple[str, int, float, bool]]:
        return self.seen


@dataclass
class Seen:
    """What the driver knows of one task: where it runs and when it last showed life."""

    node: str
    pid: int
    cpu_s: float
    returned: bool
    alive_at: float


@dataclass
class Watch:
    """The driver's side: the stage runs in a thread while this looks at its tasks' pulse."""

    what: str
    tasks: int
    stall_s: float
    beat_s: float
    cpus: float
    seen: dict[int, Seen] = field(default_factory=dict)

    def run(self, collect: Callable[[], list[dict[str, Any]]], pulse: Any) -> list[dict[str, Any]]:
        import ray

        out: dict[str, Any] = {}
        thread = threading.Thread(target=_into, args=(collect, out), daemon=True)
        thread.start()
        started = last_life = logged = time.monotonic()
        while True:
            thread.join(self.beat_s)
            if not thread.is_alive():
                break
            now = time.monotonic()
            if self.update(ray.get(pulse.state.remote(), timeout=60), now):
                last_life = now
            if now - logged >= LOG_EVERY_S:
                logged = now
                log.info("%s: %s (%.0f s)", self.what, self.progress(), now - started)
            if now - last_life > self.stall_s:
                raise UserError(self.stalled(now))
        if "error" in out:
            raise out["error"]
        return out["rows"]

    def update(self, state: dict[int, tuple[str, int, float, bool]], now: float) -> bool:
        """Take the tasks' reports; True when one shows life since the last look."""
        alive = False
        for i, (node, pid, cpu_s, returned) in state.items():
            old = self.seen.get(i)
            if (
                old is None
                or returned != old.returned
                or cpu_s - old.cpu_s > ALIVE_CPU_SHARE * (now - old.alive_at)  # a rate
            ):
                self.seen[i] = Seen(node, pid, cpu_s, returned, now)
                alive = True
        return alive

    def progress(self) -> str:
        returned = sum(s.returned for s in self.seen.values())
        running = len(self.seen) - returned
        return f"{returned} of {self.tasks} task(s) returned, {running} running"

    def stalled(self, now: float) -> str:
        """The one-line refusal: the stage, each unfinished task and where it runs."""
        import ray

        lines = [
            f"task {i} on node {s.node[:12]} (pid {s.pid}): "
            + (
                f"its function returned {now - s.alive_at:.0f} s ago, its result never came back"
                if s.returned
                else f"no CPU used for {now - s.alive_at:.0f} s"
            )
            for i, s in sorted(self.seen.items())
            if not s.returned or all(t.returned for t in self.seen.values())
        ]
        waiting = self.tasks - len(self.seen)
        if waiting:
            free = ray.available_resources().get("CPU", 0.0)
            lines.append(
                f"{waiting} task(s) not started (each needs {self.cpus:g} CPU; "
                f"{free:g} of {ray.cluster_resources().get('CPU', 0.0):g} free)"
            )
        return (
            f"{self.what}: no sign of life from its tasks in {self.stall_s:.0f} s "
            f"(data.stall_timeout_s), {self.progress()}: " + "; ".join(lines)
        )


def _into(collect: Callable[[], list[dict[str, Any]]], out: dict[str, Any]) -> None:
    try:
        out["rows"] = collect()
    except BaseException as e:  # noqa: BLE001 - handed to the driver's thread, raised there
        out["error"] = e


def _run(
    row: dict[str, Any], fn: Callable[[Any], Any], items: list[Any], pulse: Any, beat_s: float
) -> dict[str, Any]:
    """One task: its number, its node and its result as bytes. A record of plain columns, which
    Ray Data stores in Arrow as it is: a Python object would make every task's block fall back
    to pickling with a warning, and a tuple or list come back as an Arrow list."""
    import ray

    i, node = row["i"], ray.get_runtime_context().get_node_id()

    def beat(returned: bool = False) -> None:
        pulse.beat.remote(i, node, os.getpid(), time.process_time(), returned)

    stop = threading.Event()

    def beating() -> None:
        while not stop.wait(beat_s):
            beat()

    beat()
    thread = threading.Thread(target=beating, daemon=True)
    thread.start()
    try:
        result = pickle.dumps(fn(items[i]), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        stop.set()
        thread.join()
    beat(returned=True)
    return {"i": i, "result": result, "node": node}
