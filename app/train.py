"""Train: Ray Train `TorchTrainer` workers (DDP, native AMP) fed by streamed Ray Data shards.

The driver fits the preprocessor, builds the lazy datasets and launches the trainer; each worker
runs `train_loop` top to bottom: build model -> maybe resume -> epochs of (train, validate,
report + checkpoint). Re-running with the same run name and storage path resumes the run.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app import checkpoint, storage
from app.cli import UserError
from app.config import Config, ConfigError, dump, validate
from app.preprocess import LABEL_KEY, Preprocessor

log = logging.getLogger(__name__)
FAULT_ENV = "RAYTORCH_FAIL_AT"  # "rank:epoch", test-only, same as train.fail_at
PREPROCESSOR_FILE = "preprocessor.json"


# --------------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------------


def train(config: Config) -> dict[str, Any]:
    import ray.train
    from ray.train.torch import TorchTrainer

    from app.cli import connect_ray
    from app.data import fit_preprocessor, load_split
    from app.prepare import read_manifest

    check_precision(config)
    run_name = config.run_name()
    run_dir = storage.join(config.storage_path, run_name)
    manifest = read_manifest(config.data_output)
    preprocessor = run_preprocessor(config, run_dir, manifest, fit_preprocessor)
    from app.models import build_model

    build_model(
        config.model, preprocessor
    )  # a model that cannot take this data fails here, not in a worker
    connect_ray()
    datasets = {
        split: load_split(config, split, preprocessor, manifest) for split in ("train", "val")
    }
    t = config.train
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": dump(config),
            "preprocessor": preprocessor.to_json(),
            "run_dir": run_dir,
            "train_rows": manifest["rows"]["train"],
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=t.num_workers,
            use_gpu=t.use_gpu,
            resources_per_worker=worker_resources(config),
            placement_strategy=t.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=config.storage_path,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=t.keep_checkpoints,
                checkpoint_score_attribute=t.checkpoint_metric,
                checkpoint_score_order=t.checkpoint_mode,
            ),
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
        ),
        datasets=datasets,
        # Validation is split too: each worker scores its share and the sums are all-reduced.
        dataset_config=ray.train.DataConfig(datasets_to_split="all"),
    )
    log.info("train: run %s -> %s (%d workers, %s)", run_name, run_dir, t.num_workers, t.precision)
    result = trainer.fit()
    return summarize(config, run_name, result)


def check_precision(config: Config) -> None:
    """fp16 needs CUDA (GradScaler); refuse it up front rather than in a worker."""
    if config.train.precision == "fp16" and not config.train.use_gpu:
        raise ConfigError(
            "config error: train.precision: fp16 needs CUDA (GradScaler); set train.use_gpu=true "
            "on a GPU cluster, or use bf16 / fp32 on CPU"
        )


def worker_resources(config: Config) -> dict[str, float]:
    resources = {"CPU": config.train.cpus_per_worker}
    if config.train.use_gpu:
        resources["GPU"] = config.train.gpus_per_worker
    return resources


def run_preprocessor(config: Config, run_dir: str, manifest: dict[str, Any], fit) -> Preprocessor:
    """Fit once per run; a resumed run reuses the stored fit so its checkpoints stay consistent."""
    uri = storage.join(run_dir, PREPROCESSOR_FILE)
    if storage.exists(uri):
        log.info("train: reusing the preprocessor fitted for run %s", run_dir)
        return Preprocessor.from_json(storage.read_bytes(uri).decode())
    preprocessor = fit(config, manifest)
    storage.write_bytes(uri, preprocessor.to_json().encode())
    return preprocessor


def checkpoint_uri(config: Config, path: str) -> str:
    scheme = config.storage_path.split("://", 1)[0] if "://" in config.storage_path else ""
    return f"{scheme}://{path}" if scheme else path


def summarize(config: Config, run_name: str, result: Any) -> dict[str, Any]:
    if result.error:
        raise UserError(f"training run {run_name} failed: {str(result.error).splitlines()[0]}")
    t = config.train
    best = result.get_best_checkpoint(t.checkpoint_metric, t.checkpoint_mode) or result.checkpoint
    if best is None:
        raise UserError(f"training run {run_name} finished without a checkpoint")
    uri = checkpoint_uri(config, best.path)
    meta = storage.read_json(storage.join(uri, checkpoint.META))
    # The latest checkpoint tells how far the run got; the best one can be an earlier epoch.
    latest = result.checkpoint or best
    last = storage.read_json(storage.join(checkpoint_uri(config, latest.path), checkpoint.META))
    return {
        "stage": "train",
        "run_name": run_name,
        "checkpoint": uri,
        "num_workers": t.num_workers,
        "precision": t.precision,
        "epoch": meta["epoch"],
        "final_epoch": last["epoch"],
        "resume_history": last.get("resume_history", []),
        "worker_nodes": meta.get("worker_nodes", []),
        "metrics": meta["metrics"],
    }


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def train_loop(loop_config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    config = validate(loop_config["config"])
    t = config.train
    preprocessor = Preprocessor.from_json(loop_config["preprocessor"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(t.torch_threads)
    torch.manual_seed(t.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)

    from app.models import build_model

    model = build_model(config.model, preprocessor)
    steps_per_epoch = math.ceil(
        loop_config["train_rows"] / world / t.batch_size / t.grad_accum_steps
    )
    state = TrainState.create(model, config, total_steps=steps_per_epoch * t.epochs)
    resumed = ray.train.get_checkpoint()
    if resumed:
        with resumed.as_directory() as folder:
            state.restore(folder)
        log.info("rank %d: resumed from epoch %d (step %d)", rank, state.epoch, state.step)
    else:
        torch.manual_seed(t.seed + rank)  # ranks then differ in dropout and shuffling
    model = ray.train.torch.prepare_model(model)
    state.model = model
    device = ray.train.torch.get_device()
    if t.precision == "fp16" and device.type != "cuda":
        raise RuntimeError(f"train.precision=fp16 needs CUDA, but rank {rank} runs on {device}")
    metrics_sink = TrainMetrics(loop_config["run_dir"]) if rank == 0 else None
    state.worker_nodes = gather_node_ids(world)

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    for epoch in range(state.epoch + 1, t.epochs + 1):
        maybe_inject_fault(config, loop_config["run_dir"], rank, epoch)
        train_stats = train_epoch(state, train_shard, device, epoch, rank, world)
        val_stats = validate_epoch(model, val_shard, device, t.batch_size, t.precision)
        state.epoch = epoch
        metrics = {"epoch": epoch, "step": state.step, **train_stats, **val_stats}
        if rank == 0:
            log.info(
                "epoch %d/%d: train_loss %.4f val_loss %.4f val_accuracy %.4f %.0f samples/s data_wait %.1f%%",
                epoch,
                t.epochs,
                metrics["train_loss"],
                metrics["val_loss"],
                metrics["val_accuracy"],
                metrics["samples_per_second"],
                100 * metrics["data_wait_fraction"],
            )
            assert metrics_sink is not None
            metrics_sink.record(metrics)
        report(state, metrics, preprocessor, config, rank)


class TrainState:
    """Everything a resumed worker needs: model, optimizer, scheduler, scaler, counters, RNG."""

    def __init__(self, model, optimizer, scheduler, scaler, config: Config):
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.config = config
        self.epoch, self.step = 0, 0
        self.resume_history: list[int] = []
        self.worker_nodes: list[str] = []

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
        self.epoch, self.step = meta["epoch"], meta["step"]
        self.resume_history = [*meta.get("resume_history", []), self.epoch + 1]

    def train_state(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "rng": checkpoint.rng_state(),
        }


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
    state: TrainState, shard, device: torch.device, epoch: int, rank: int, world: int
) -> dict[str, float]:
    t = state.config.train
    model = state.model
    model.train()
    seed = t.seed * 1000 + epoch * 10 + rank
    batches = shard.iter_torch_batches(
        batch_size=t.batch_size,
        local_shuffle_buffer_size=t.shuffle_buffer or None,
        local_shuffle_seed=seed,
    )
    loss_sum, rows, wait, micro = 0.0, 0, 0.0, 0
    start = tick = time.perf_counter()
    for batch in batches:
        wait += time.perf_counter() - tick
        inputs, labels = split_batch(batch, device)
        micro += 1
        last_micro = micro % t.grad_accum_steps == 0
        sync = nullcontext() if last_micro or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(device, t.precision):
                loss = F.cross_entropy(model(**inputs), labels)
            state.scaler.scale(loss / t.grad_accum_steps).backward()
        if last_micro:
            optimizer_step(state)
        loss_sum += loss.item() * len(labels)
        rows += len(labels)
        if rank == 0 and micro % t.log_every_steps == 0:
            log.info(
                "epoch %d step %d loss %.4f %.0f rows/s",
                epoch,
                state.step,
                loss.item(),
                rows / (time.perf_counter() - start),
            )
        tick = time.perf_counter()
    if micro % t.grad_accum_steps:
        optimizer_step(state)
    elapsed = time.perf_counter() - start
    total_loss, total_rows = all_reduce_sums([loss_sum, float(rows)], device)
    return {
        "train_loss": total_loss / max(total_rows, 1),
        "samples_per_second": total_rows / max(elapsed, 1e-9),
        "data_wait_fraction": wait / max(elapsed, 1e-9),
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


@torch.no_grad()
def validate_epoch(
    model: nn.Module, shard, device: torch.device, batch_size: int, precision: str
) -> dict[str, float]:
    model.eval()
    loss_sum, correct, rows = 0.0, 0.0, 0.0
    for batch in shard.iter_torch_batches(batch_size=batch_size * 4):
        inputs, labels = split_batch(batch, device)
        with autocast(device, precision):
            logits = model(**inputs)
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        rows += len(labels)
    loss_sum, correct, rows = all_reduce_sums([loss_sum, correct, rows], device)
    return {"val_loss": loss_sum / max(rows, 1), "val_accuracy": correct / max(rows, 1)}


def all_reduce_sums(values: list[float], device: torch.device) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def gather_node_ids(world: int) -> list[str]:
    """The Ray node of every rank, in rank order (recorded so placement can be checked)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    if world == 1 or not dist.is_initialized():
        return [node]
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, node)
    return [str(n) for n in nodes]


def report(
    state: TrainState,
    metrics: dict[str, Any],
    preprocessor: Preprocessor,
    config: Config,
    rank: int,
) -> None:
    """Every rank calls report (it is a barrier); rank 0 alone attaches the checkpoint."""
    import ray.train

    if rank != 0:
        ray.train.report(metrics)
        return
    meta = {
        "config": dump(config),
        "epoch": state.epoch,
        "step": state.step,
        "metrics": metrics,
        "resume_history": state.resume_history,
        "worker_nodes": state.worker_nodes,
        "preprocessor": preprocessor.to_json(),
        "torch_version": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as folder:
        checkpoint.save(folder, state.model, state.train_state(), meta)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def maybe_inject_fault(config: Config, run_dir: str, rank: int, epoch: int) -> None:
    """Test-only: raise once on `rank` at the start of `epoch` (train.fail_at or $RAYTORCH_FAIL_AT)."""
    target = config.train.fail_at
    spec = os.environ.get(FAULT_ENV)
    want = (
        (target.rank, target.epoch)
        if target
        else tuple(int(v) for v in spec.split(":"))
        if spec
        else None
    )
    if want != (rank, epoch):
        return
    marker = storage.join(run_dir, f"fault-injected-rank{rank}-epoch{epoch}")
    if storage.exists(marker):
        return  # already failed once in this run
    storage.write_bytes(marker, b"")
    raise RuntimeError(f"injected fault: rank {rank} at epoch {epoch}")


class TrainMetrics:
    """Ray custom metrics (dashboard / Prometheus), created lazily on rank 0."""

    def __init__(self, run_dir: str):
        from ray.util.metrics import Gauge

        self.tags = {"run": os.path.basename(run_dir.rstrip("/"))}
        names = [
            "train_loss",
            "val_loss",
            "val_accuracy",
            "samples_per_second",
            "data_wait_fraction",
        ]
        self.gauges = {
            n: Gauge(
                f"raytorch_{n}", description=f"training {n.replace('_', ' ')}", tag_keys=("run",)
            )
            for n in names
        }

    def record(self, metrics: dict[str, float]) -> None:
        for name, gauge in self.gauges.items():
            gauge.set(float(metrics[name]), tags=self.tags)
