"""Elastic training (`train.num_workers: [min, max]`): the rules a run keeps while Ray Train
resizes its worker group.

Ray Train 2.60 starts the group once `min` workers fit, considers a resize every
`train.elastic_resize_interval_s` (its `elastic_resize_monitor_interval_s`) and restarts the
group at the new size from the latest checkpoint; a worker or node lost restarts it with the
workers that fit (within `train.max_failures`). Every restart recomputes each rank's share of
the data for the new world size (app/train/worker.py:feed). What this module adds:

- The global batch stays what `max` workers make: a rank accumulates gradients over
  ceil(max / world) times `train.grad_accum_steps` micro-batches (the same global batch when the
  world divides `max`, else the next multiple up), and the learning-rate schedule is as long
  as a run on `max` workers, so the optimizer sees the same steps whatever the size.
- `num_workers_history`: each size the run trained at, from which epoch and why, kept in the
  checkpoints (so it survives the restarts) and in the train summary; rank 0 logs each change.

How Ray 2.60 counts the workers that fit (ElasticScalingPolicy._count_possible_workers, whose
source carries "TODO: Fractional resources do not work well here"): per node,
floor(reserved / per-worker) for each resource, where "reserved" is what Ray Data's autoscaling
coordinator set aside for the run out of each node's *total* resources in per-worker bundles
(refreshed every 20 s). Two consequences for this project's fractional `train.cpus_per_worker`:
a value that is not a binary fraction (0.3, 0.1) can be counted one worker short (ten 0.1s add
up to 0.9999999999999999, and 1.0 // 0.1 is 9.0), so `warn_inexact` says so; the default 0.5,
0.25 or whole CPUs count exactly. And what other work holds (Serve replicas, Ray Data tasks,
another job) is not subtracted: a size that does not fit is tried, and fails to start within
RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, before a smaller one is.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from app.config import Config, TrainConfig

log = logging.getLogger(__name__)


def scaling_workers(t: TrainConfig) -> int | tuple[int, int]:
    """What ScalingConfig(num_workers=) takes: the count, or (min, max) for an elastic run."""
    return t.worker_range if t.elastic else t.min_workers


def accumulation(t: TrainConfig, world: int) -> int:
    """Micro-batches per optimizer step on `world` ranks (the global batch kept at `max`'s)."""
    return (
        t.grad_accum_steps * math.ceil(t.max_workers / world) if t.elastic else t.grad_accum_steps
    )


def warn_inexact(t: TrainConfig) -> None:
    """One warning for an elastic run whose per-worker CPUs Ray may count one worker short."""
    if t.elastic and not (t.cpus_per_worker * 1024).is_integer():
        log.warning(
            "train.cpus_per_worker=%g is not a binary fraction: Ray 2.60 may count one worker "
            "fewer than fit when it sizes this elastic run (use 1, 0.5 or 0.25)",
            t.cpus_per_worker,
        )


def for_world(config: Config, world: int) -> Config:
    """The config a rank of a `world`-rank group trains with."""
    steps = accumulation(config.train, world)
    if steps == config.train.grad_accum_steps:
        return config
    train = config.train.model_copy(update={"grad_accum_steps": steps})
    return config.model_copy(update={"train": train})


def record_size(
    history: list[dict[str, Any]],
    world: int,
    next_epoch: int,
    t: TrainConfig,
    announce: bool = False,
) -> list[dict[str, Any]]:
    """`history` with this start of the worker group added when its size changed (a first
    start, a grow, a shrink), the reason logged; a restart at the same size adds nothing."""
    last = history[-1]["workers"] if history else None
    if last == world:
        return history
    if last is None:
        reason = (
            "start"
            if not t.elastic
            else f"start: {world} of {t.min_workers}-{t.max_workers} workers fit"
        )
    elif world > last:
        reason = f"grew {last} -> {world}: the cluster had room for more workers"
    else:
        reason = f"shrank {last} -> {world}: workers were lost and {world} fit"
    if t.elastic and announce:
        log.info(
            "elastic: %s; training on from epoch %d, %d micro-batches per step per rank",
            reason,
            next_epoch,
            accumulation(t, world),
        )
    entry = {"at": time.time(), "workers": world, "from_epoch": next_epoch, "reason": reason}
    return [*history, entry]
