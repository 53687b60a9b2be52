"""The training loop without Ray: state, one training epoch, one validation pass.

Ray Train workers (app/train/driver.py) and the plain-PyTorch DDP baseline of the benchmarks call these
same functions, so a benchmark ratio measures the data path and Ray, never two different loops.
Batches come from any iterable of dicts of tensors (app/data/feed.py); ranks agree through
`torch.distributed` when a process group exists.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from app.config import Config
from app.errors import CheckpointError
from app.train import checkpoint, parallel
from app.train.pipelining import PipelinedModel
from app.train.steps import LossFn, all_reduce, autocast

log = logging.getLogger(__name__)
# (model, batch, device) -> (mean loss, rows in the batch)


class TrainState:
    """Everything a resumed worker needs: model, optimizer, schedule, scaler, counters, RNG.

    The learning-rate schedule is counted in training rows (`rows`: the position in the data),
    so it ends at the run's last step whatever sizes an elastic run trains at; a state is
    created anew at each (re)start with the size it runs at (`world`)."""

    def __init__(self, model, optimizer, schedule, scaler, config: Config):
        self.model, self.optimizer = model, optimizer
        self.schedule: Schedule = schedule
        self.scaler = scaler
        self.config = config
        self.epoch, self.step = 0, 0
        self.rows = 0  # rows of training data the optimizer steps so far covered
        self.train_rows, self.world = 0, 1
        self.resume_history: list[int] = []
        self.worker_nodes: list[str] = []
        self.num_workers_history: list[dict[str, Any]] = []  # app/train/elastic.py:record_size
        self.data_wait_history: list[float] = []  # per epoch, the slowest rank's fraction
        self.epoch_seconds_history: list[float] = []  # per epoch, the slowest rank's loop time
        self.first_step_at: float | None = None  # wall clock of the run's first optimizer step
        self.history: list[dict[str, float | int]] = []  # every epoch's reported metrics
        self.total_steps = 0  # optimizer steps the run takes at this size (for progress lines)

    @classmethod
    def create(cls, model: nn.Module, config: Config, train_rows: int, world: int) -> TrainState:
        from app.train.finetune import adamw

        t = config.train
        optimizer = adamw(model, t)
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
        scaler = torch.amp.GradScaler("cuda", enabled=t.precision == "fp16")
        state = cls(model, optimizer, run_schedule(config, train_rows, world), scaler, config)
        state.train_rows, state.world = train_rows, world
        state.total_steps = steps_per_epoch(train_rows, world, config) * t.epochs
        if t.max_steps:
            state.total_steps = min(state.total_steps, t.max_steps)
        state.set_rate(0, 1)
        return state

    def advance(self) -> None:
        """Before an optimizer step: its learning rate, from the rows it covers (every rank's
        batches, within this epoch), and the counters moved past it."""
        t = self.config.train
        epoch_end = (self.epoch + 1) * self.train_rows
        step_rows = self.world * t.batch_size * t.grad_accum_steps
        end = max(self.rows, min(self.rows + step_rows, epoch_end))
        self.set_rate(self.rows, end)
        self.rows, self.step = end, self.step + 1

    def set_rate(self, start: float, end: float) -> None:
        """The learning rate for a step over rows [start, end) (and, with train.max_steps,
        the step budget's share: whichever ends first ends the schedule)."""
        limit = self.config.train.max_steps
        if limit:
            per_step = self.schedule.total / limit
            start, end = max(start, self.step * per_step), max(end, (self.step + 1) * per_step)
        factor = self.schedule(start, end)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def end_epoch(self, epoch: int) -> None:
        """An epoch's last step: the position is the epoch's end (a rank's share leaves out
        `rows % world`)."""
        self.epoch = epoch
        self.rows = max(self.rows, epoch * self.train_rows)

    def restore(self, folder: str, rank: int = 0) -> None:
        saved = checkpoint.load_train_state(folder)
        # A checkpoint's groups carry the optimizer's implementation (`fused`); this run's
        # stays (a GradScaler steps a fused AdamW and a looped one differently).
        fused = [group.get("fused") for group in self.optimizer.param_groups]
        rng = None
        if parallel.is_sharded(self.model):  # FSDP, pipeline: each rank reads its shards, its RNG
            rng = checkpoint.load_sharded(folder, self.model, self.optimizer, rank)
        elif checkpoint.is_sharded(folder):
            raise CheckpointError(
                f"{folder}: sharded (train.strategy=fsdp or pipeline); resume it with the "
                "strategy that wrote it"
            )
        else:
            checkpoint.load_weights(folder, self.model)
            self.optimizer.load_state_dict(saved["optimizer"])
        for group, flag in zip(self.optimizer.param_groups, fused, strict=True):
            group["fused"] = flag
        self.rows = int(saved["rows"])
        self.scaler.load_state_dict(saved["scaler"])
        checkpoint.set_rng_state(rng or saved["rng"])
        meta = checkpoint.read_meta(folder)
        self.epoch, self.step = meta.epoch, meta.step
        self.resume_history = [*meta.resume_history, self.epoch + 1]
        self.data_wait_history = list(meta.data_wait_history)
        self.epoch_seconds_history = list(meta.epoch_seconds_history)
        self.first_step_at = meta.first_step_at
        self.history = list(meta.history)
        self.num_workers_history = list(meta.num_workers_history)

    def train_state(self) -> dict[str, Any]:
        state = {
            "rows": self.rows,
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "rng": checkpoint.rng_state(),
        }
        if not parallel.is_sharded(self.model):  # sharded optimizer state goes to `sharded/`
            state["optimizer"] = self.optimizer.state_dict()
        return state


def steps_per_epoch(train_rows: int, world: int, config: Config) -> int:
    t = config.train
    steps = math.ceil(train_rows / world / t.batch_size / t.grad_accum_steps)
    return min(steps, t.max_steps_per_epoch or steps)


def short_budget(train_rows: int, config: Config) -> str | None:
    """One line when `train.max_steps` stops training short of one epoch of the
    training rows (at the size the run starts at), else None."""
    t = config.train
    if not t.max_steps or train_rows <= 0:
        return None
    per_step = t.min_workers // t.stages * t.batch_size * t.grad_accum_steps
    seen = t.max_steps * per_step / train_rows
    if seen >= 1:
        return None
    return (
        f"train.max_steps={t.max_steps} ends training after {seen:.2f} of one epoch of the "
        f"{train_rows:,} training rows ({t.max_steps} steps x {per_step} rows); raise or unset "
        "it to train on all of them"
    )


def epoch_batches(
    feed: Any, batch_size: int, seed: int, config: Config, steps_done: int = 0
) -> Iterable[Any]:
    """One epoch of a feed's batches: at most `train.max_steps_per_epoch` optimizer steps' worth,
    and no more than `train.max_steps` leaves (a seeded in-memory pass permutes the whole shard,
    so every epoch draws from all of it). A pipeline fills a short last batch itself
    (app/train/pipelining.py)."""
    t = config.train
    batches = feed.batches(batch_size, seed=seed)
    limits = [t.max_steps_per_epoch, t.max_steps and max(t.max_steps - steps_done, 0)]
    limit = min((x for x in limits if x is not None), default=None)
    if limit is None:
        return batches
    return itertools.islice(batches, limit * t.grad_accum_steps)


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item and whether it is the last (one item read ahead)."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def budget_spent(state: TrainState) -> bool:
    """Whether the run has taken its `train.max_steps` optimizer steps."""
    limit = state.config.train.max_steps
    return limit is not None and state.step >= limit


def order_seed(seed: int, epoch: int, rank: int) -> int:
    """Batch-order seed per epoch and rank: a fresh order each epoch, reproducible per seed."""
    return seed * 1_000_003 + epoch * 1009 + rank


def run_schedule(config: Config, train_rows: int, world: int) -> Schedule:
    """The run's schedule in rows: every epoch's training rows; warmup as a fraction of them
    or as `train.warmup_steps` of the run's steps at this size."""
    t = config.train
    total = max(t.epochs * train_rows, 1)
    if t.warmup_steps is None:
        warmup = int(t.warmup_fraction * total)
    else:
        planned = steps_per_epoch(train_rows, world, config) * t.epochs
        planned = min(planned, t.max_steps or planned)
        warmup = int(total * min(t.warmup_steps / max(planned, 1), 1.0))
    return Schedule(t.lr_schedule, warmup, total)


class Schedule:
    """The learning-rate factor at a position of the run (rows of training data): linear
    warmup to the base rate, then constant, linear decay to 0, or cosine decay to 10% of it
    (`train.lr_schedule`). A step covers [start, end): warmup counts to its end, decay from
    its start, so one row a step is the classic per-step schedule."""

    def __init__(self, decay: str, warmup: int, total: int):
        self.decay, self.warmup, self.total = decay, warmup, max(total, 1)

    def __call__(self, start: float, end: float | None = None) -> float:
        end = start + 1 if end is None else end
        if start < self.warmup:
            return min(end / self.warmup, 1.0)
        progress = min(1.0, (start - self.warmup) / max(1, self.total - self.warmup))
        if self.decay == "constant":
            return 1.0
        if self.decay == "linear":
            return 1.0 - progress
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train_epoch(
    state: TrainState,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    log_every: int,
    loss_fn: LossFn,
) -> dict[str, float]:
    """One pass over `batches`, timing the loop alone (first batch request to last step).

    `log_every` > 0 logs progress every that many batches (long streamed epochs). `loss_fn` is
    the task's (app/registry.py): (model, batch, device) -> (mean loss, rows).
    """
    t = state.config.train
    model = state.model
    model.train()
    loss_sum, rows, wait = 0.0, 0, 0.0
    start = tick = time.perf_counter()
    for micro, (batch, last) in enumerate(with_last(batches), start=1):
        wait += time.perf_counter() - tick
        # An epoch's last batch ends a step even when it ends an accumulation early.
        last_micro = last or micro % t.grad_accum_steps == 0
        loss, batch_rows = backward(state, batch, device, loss_fn, last_micro)
        if last_micro:
            optimizer_step(state)
        loss_sum += loss.item() * batch_rows
        rows += batch_rows
        if log_every and micro % log_every == 0:
            log_progress(state, loss.item(), rows, micro, time.perf_counter() - start)
        tick = time.perf_counter()
    elapsed = max(time.perf_counter() - start, 1e-9)
    # Every stage of a pipeline sees its row's batches: each counts a 1/stages share.
    total_loss, total_rows = (v / t.stages for v in all_reduce([loss_sum, float(rows)], device))
    # The slowest rank sets the pace: report its wait and its loop time.
    wait_fraction, epoch_seconds = all_reduce([wait / elapsed, elapsed], device, op="max")
    return {
        "train_loss": total_loss / max(total_rows, 1),
        "samples_per_second": total_rows / epoch_seconds,
        "epoch_seconds": epoch_seconds,
        "data_wait_fraction": wait_fraction,
        "learning_rate": state.optimizer.param_groups[0]["lr"],
    }


def backward(
    state: TrainState,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    loss_fn: LossFn,
    last_micro: bool,
) -> tuple[torch.Tensor, int]:
    """Forward and backward of one batch, its gradients added to the step's (synchronised
    across ranks on the step's last batch); its mean loss and rows."""
    t, model = state.config.train, state.model
    if isinstance(model, PipelinedModel):  # the schedule runs forward and backward together
        with autocast(device, t.precision):
            return model.train_step(batch, sync=last_micro)
    # Skip the gradient all-reduce on all but the last micro-batch of an accumulation.
    sync = nullcontext() if last_micro or not hasattr(model, "no_sync") else model.no_sync()
    with sync:
        with autocast(device, t.precision):
            loss, rows = loss_fn(model, batch, device)
        state.scaler.scale(loss / t.grad_accum_steps).backward()
    return loss, rows


def log_progress(state: TrainState, loss: float, rows: int, micro: int, seconds: float) -> None:
    """`step 40/200 loss 2.3101 31 rows/s ETA 3m05s`: the ETA at this epoch's step rate."""
    steps_per_second = micro / state.config.train.grad_accum_steps / max(seconds, 1e-9)
    left = max(state.total_steps - state.step, 0) / max(steps_per_second, 1e-9)
    eta = f"{int(left // 60)}m{int(left % 60):02d}s"
    log.info(
        "step %d/%d loss %.4f %.0f rows/s ETA %s",
        state.step,
        state.total_steps,
        loss,
        rows / max(seconds, 1e-9),
        eta,
    )


def optimizer_step(state: TrainState) -> None:
    t = state.config.train
    if t.grad_clip > 0:
        state.scaler.unscale_(state.optimizer)
        parallel.clip_grad_norm_(state.model, t.grad_clip)
    state.advance()
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    if state.first_step_at is None:
        state.first_step_at = time.time()


def should_stop_early(history: list[dict[str, Any]], config: Config) -> bool:
    """Whether `train.early_stopping_metric` has gone `train.early_stopping_patience` epochs
    without improving on its best by more than `train.early_stopping_min_delta`.

    A pure function of the reported history: the metrics in it are all-reduced, so every rank
    reaches the same answer (the worker all-reduces the flag as well, to be exact about it).
    """
    t = config.train
    if t.early_stopping_patience is None or not history:
        return False
    values = [float(m[t.early_stopping_metric]) for m in history]
    return len(values) - 1 - best_index(
        values, t.early_stopping_mode, t.early_stopping_min_delta
    ) >= (t.early_stopping_patience)


def best_index(values: list[float], mode: str, min_delta: float = 0.0) -> int:
    """Index of the best value: the first one that no later value beats by more than
    `min_delta`. NaN (a diverged run) never counts as an improvement."""
    best = 0
    for i, value in enumerate(values[1:], start=1):
        if math.isnan(value):
            continue
        current = values[best]
        gain = current - value if mode == "min" else value - current
        if math.isnan(current) or gain > min_delta:
            best = i
    return best


def steady_median(history: list[float]) -> float | None:
    """Median over epochs 2..N (epoch 1 may fill a cache), or epoch 1 alone in a 1-epoch run."""
    steady = history[1:] or history
    return statistics.median(steady) if steady else None
