"""The training loop without Ray: state, one training epoch, one validation pass.

Ray Train workers (app/train.py) and the plain-PyTorch DDP baseline of the benchmarks call these
same functions, so a benchmark ratio measures the data path and Ray, never two different loops.
Batches come from any iterable of dicts of tensors (app/feed.py); ranks agree through
`torch.distributed` when a process group exists.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app import checkpoint
from app.config import Config
from app.preprocess import LABEL_KEY

log = logging.getLogger(__name__)


class TrainState:
    """Everything a resumed worker needs: model, optimizer, scheduler, scaler, counters, RNG."""

    def __init__(self, model, optimizer, scheduler, scaler, config: Config):
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.config = config
        self.epoch, self.step = 0, 0
        self.resume_history: list[int] = []
        self.worker_nodes: list[str] = []
        self.data_wait_history: list[float] = []  # per epoch, the slowest rank's fraction
        self.epoch_seconds_history: list[float] = []  # per epoch, the slowest rank's loop time
        self.first_step_at: float | None = None  # wall clock of the run's first optimizer step

    @classmethod
    def create(cls, model: nn.Module, config: Config, total_steps: int) -> TrainState:
        t = config.train
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        warmup = int(t.warmup_fraction * total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, total_steps))
        scaler = torch.amp.GradScaler("cuda", enabled=t.precision == "fp16")
        return cls(model, optimizer, scheduler, scaler, config)

    def restore(self, folder: str) -> None:
        checkpoint.load_weights(folder, self.model)
        saved = checkpoint.load_train_state(folder)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        checkpoint.set_rng_state(saved["rng"])
        meta = checkpoint.read_meta(folder)
        self.epoch, self.step = meta.epoch, meta.step
        self.resume_history = [*meta.resume_history, self.epoch + 1]
        self.data_wait_history = list(meta.data_wait_history)
        self.epoch_seconds_history = list(meta.epoch_seconds_history)
        self.first_step_at = meta.first_step_at

    def train_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "rng": checkpoint.rng_state(),
        }


def steps_per_epoch(train_rows: int, world: int, config: Config) -> int:
    t = config.train
    return math.ceil(train_rows / world / t.batch_size / t.grad_accum_steps)


def order_seed(seed: int, epoch: int, rank: int) -> int:
    """Batch-order seed per epoch and rank: a fresh order each epoch, reproducible per seed."""
    return seed * 1_000_003 + epoch * 1009 + rank


class WarmupCosine:
    """Linear warmup to the base rate, then cosine decay to 10% of it."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, max(total, 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def split_batch(
    batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    labels = batch[LABEL_KEY].to(device)
    inputs = {k: v.to(device) for k, v in batch.items() if k != LABEL_KEY}
    return inputs, labels


def train_epoch(
    state: TrainState,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    log_every: int = 0,
) -> dict[str, float]:
    """One pass over `batches`, timing the loop alone (first batch request to last step).

    `log_every` > 0 logs progress every that many batches (long streamed epochs).
    """
    t = state.config.train
    model = state.model
    model.train()
    loss_sum, rows, wait, micro = 0.0, 0, 0.0, 0
    start = tick = time.perf_counter()
    for batch in batches:
        wait += time.perf_counter() - tick
        inputs, labels = split_batch(batch, device)
        micro += 1
        last_micro = micro % t.grad_accum_steps == 0
        # Skip the gradient all-reduce on all but the last micro-batch of an accumulation.
        sync = nullcontext() if last_micro or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(device, t.precision):
                loss = F.cross_entropy(model(**inputs), labels)
            state.scaler.scale(loss / t.grad_accum_steps).backward()
        if last_micro:
            optimizer_step(state)
        loss_sum += loss.item() * len(labels)
        rows += len(labels)
        if log_every and micro % log_every == 0:
            rate = rows / (time.perf_counter() - start)
            log.info("step %d loss %.4f %.0f rows/s", state.step, loss.item(), rate)
        tick = time.perf_counter()
    if micro % t.grad_accum_steps:
        optimizer_step(state)
    elapsed = max(time.perf_counter() - start, 1e-9)
    total_loss, total_rows = all_reduce([loss_sum, float(rows)], device)
    # The slowest rank sets the pace: report its wait and its loop time.
    wait_fraction, epoch_seconds = all_reduce([wait / elapsed, elapsed], device, op="max")
    return {
        "train_loss": total_loss / max(total_rows, 1),
        "samples_per_second": total_rows / epoch_seconds,
        "epoch_seconds": epoch_seconds,
        "data_wait_fraction": wait_fraction,
        "learning_rate": state.scheduler.get_last_lr()[0],
    }


def optimizer_step(state: TrainState) -> None:
    t = state.config.train
    if t.grad_clip > 0:
        state.scaler.unscale_(state.optimizer)
        nn.utils.clip_grad_norm_(state.model.parameters(), t.grad_clip)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1
    if state.first_step_at is None:
        state.first_step_at = time.time()


@torch.no_grad()
def validate_epoch(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
) -> dict[str, float]:
    model.eval()
    loss_sum, correct, rows = 0.0, 0.0, 0.0
    for batch in batches:
        inputs, labels = split_batch(batch, device)
        with autocast(device, precision):
            logits = model(**inputs)
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        rows += len(labels)
    loss_sum, correct, rows = all_reduce([loss_sum, correct, rows], device)
    return {"val_loss": loss_sum / max(rows, 1), "val_accuracy": correct / max(rows, 1)}


def all_reduce(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Sum (or max) `values` over ranks; the values themselves without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


def steady_median(history: list[float]) -> float | None:
    """Median over epochs 2..N (epoch 1 may fill a cache), or epoch 1 alone in a 1-epoch run."""
    steady = history[1:] or history
    return statistics.median(steady) if steady else None
