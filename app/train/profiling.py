"""Per-step measurements of a training run: step times (compilation vs steady state) and a
`torch.profiler` trace per rank.

Both hang off the optimizer as step post-hooks, so the Ray-free epoch (app/train/loop.py) knows
nothing of them and every optimizer step is seen, whatever the task's loss or the feed. A hook
that is done turns into a no-op rather than removing itself: the optimizer is iterating over its
hooks while it runs one.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from app import storage

log = logging.getLogger(__name__)
PROFILE_DIR = "profile"
MAX_TIMED_STEPS = 200  # enough for a steady median; a long epoch does not grow a list


class StepTimer:
    """Wall time of each optimizer step of an attempt's first epoch.

    The first step carries the one-off costs (torch.compile's tracing and code generation, lazy
    allocations); the median of the later ones is the steady step time. `start()` marks the
    beginning of a training pass, so the time between passes (validation, reporting) is not
    counted.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.durations: list[float] = []
        self._last: float | None = None
        self.timing = True
        optimizer.register_step_post_hook(self._stepped)

    def start(self) -> None:
        self._last = time.perf_counter()

    def _stepped(self, *_: Any) -> None:
        if not self.timing:
            return
        now = time.perf_counter()
        if self._last is not None:
            self.durations.append(now - self._last)
        self._last = now
        self.timing = len(self.durations) < MAX_TIMED_STEPS

    def stop(self) -> None:
        """End of the first pass: later epochs are not timed."""
        self.timing = False

    @property
    def first_step_seconds(self) -> float | None:
        return self.durations[0] if self.durations else None

    @property
    def step_seconds(self) -> float | None:
        steady = self.durations[1:]
        return statistics.median(steady) if steady else None


def profile_uri(run_dir: str, rank: int) -> str:
    return storage.join(run_dir, PROFILE_DIR, f"rank{rank}.json")


class StepProfiler:
    """`torch.profiler` over `steps` optimizer steps of this rank, after one skipped step (it may
    compile) and one warm-up step, written as a Chrome trace (Perfetto, chrome://tracing,
    TensorBoard's trace viewer) to `<run_dir>/profile/rank<k>.json`, on any storage."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, steps: int, run_dir: str, rank: int, cuda: bool
    ):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.uri = profile_uri(run_dir, rank)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._export,
        )
        self.done = False
        self.profiler.start()
        optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_: Any) -> None:
        if not self.done:
            self.profiler.step()

    def _export(self, profiler: Any) -> None:
        with tempfile.TemporaryDirectory(prefix="raytorch-profile-") as tmp:
            local = os.path.join(tmp, "trace.json")
            profiler.export_chrome_trace(local)
            storage.upload_file(local, self.uri)
        self.done = True
        log.info("profile: %s", self.uri)

    def close(self) -> None:
        """Stop profiling; a run shorter than the schedule still writes what it recorded."""
        if not self.done:
            self.done = True
            self.profiler.stop()


class RunProbes:
    """What a worker measures besides the epoch's own metrics: peak parameter + gradient +
    optimizer bytes per rank (app/train/parallel.py:MemoryMeter), the first vs steady step time of
    the attempt's first epoch, and the optional profiler trace (`train.profile_steps`)."""

    def __init__(self, state: Any, config: Any, run_dir: str, rank: int, device: torch.device):
        from app.train.parallel import MemoryMeter

        t = config.train
        self.config, self.rank, self.device = config, rank, device
        self.meter = MemoryMeter(state.model, state.optimizer)
        self.timer = StepTimer(state.optimizer)
        self.profiler = (
            StepProfiler(state.optimizer, t.profile_steps, run_dir, rank, device.type == "cuda")
            if t.profile_steps
            else None
        )
        self.epochs = 0

    def before_epoch(self) -> None:
        if self.epochs == 0:
            self.timer.start()

    def after_epoch(self) -> dict[str, Any]:
        """Collective (every rank calls it after each epoch): the fields for `meta.json`."""
        from app.train.steps import all_reduce

        self.epochs += 1
        self.timer.stop()
        keys = ("params", "grads", "optimizer", "total")
        peak = all_reduce([float(self.meter.peak.get(k, 0)) for k in keys], self.device, "max")
        stats = {
            "memory_per_rank": {k: int(v) for k, v in zip(keys, peak, strict=True)},
            "first_step_seconds": self.timer.first_step_seconds,
            "step_seconds": self.timer.step_seconds,
        }
        if self.epochs == 1 and self.rank == 0:
            self.log_once(stats)
        return stats

    def log_once(self, stats: dict[str, Any]) -> None:
        t, mem = self.config.train, stats["memory_per_rank"]
        mib = {k: v / 2**20 for k, v in mem.items()}
        log.info(
            "memory per rank (%s, largest rank): params %.2f MiB + grads %.2f MiB + optimizer "
            "%.2f MiB = %.2f MiB",
            t.strategy,
            mib["params"],
            mib["grads"],
            mib["optimizer"],
            mib["total"],
        )
        first, steady = stats["first_step_seconds"], stats["step_seconds"]
        if first is not None and steady is not None:
            log.info(
                "step time: first %.2fs (%s), steady %.4fs",
                first,
                "includes torch.compile" if t.compile else "eager",
                steady,
            )

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
