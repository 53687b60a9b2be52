"""Train: Ray Train `TorchTrainer` workers (DDP, native AMP) fed by Ray Data.

The driver fits the preprocessor, chooses the data path (app/data.py: in-memory cache or
streaming), builds the lazy datasets and launches the trainer; each worker runs `train_loop` top
to bottom: build model -> maybe resume -> epochs of (train, validate, report + checkpoint). The
epoch itself is Ray-free (app/loop.py). Re-running with the same run name and storage path resumes.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from app import checkpoint, storage
from app.config import Config, dump, validate
from app.errors import ConfigError, UserError
from app.loop import (
    TrainState,
    order_seed,
    steady_median,
    steps_per_epoch,
    train_epoch,
    validate_epoch,
)
from app.preprocess import Preprocessor

if TYPE_CHECKING:  # app.prepare (pandas, pyarrow) is imported on the driver only
    from app.prepare import DatasetManifest

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
    from app.data import fit_preprocessor, ingest_options, load_split, plan_data_path
    from app.prepare import read_manifest, verify_shards

    check_precision(config)
    run_name = config.run_name()
    run_dir = storage.join(config.storage_path, run_name)
    manifest = read_manifest(config.data_output)
    for split in ("train", "val"):  # a damaged shard is refused here, naming the file
        verify_shards(config.data_output, manifest, split)
    preprocessor = run_preprocessor(config, run_dir, manifest, fit_preprocessor)
    from app.models import build_model

    # A model that cannot take this data fails here, not in a worker.
    build_model(config.model, preprocessor)
    connect_ray()
    plan = plan_data_path(config, manifest, preprocessor)
    log.info("train: data path %s: %s", plan.mode, plan.reason)
    datasets = {
        split: load_split(config, split, preprocessor, manifest, plan.mode)
        for split in ("train", "val")
    }
    t = config.train
    # Propagated by Ray Train from this process to its controller (see TrainConfig).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(t.controller_poll_s))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": dump(config),
            "preprocessor": preprocessor.to_json(),
            "run_dir": run_dir,
            "train_rows": manifest.rows["train"],
            "data_path": plan.mode,
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
        dataset_config=ray.train.DataConfig(
            datasets_to_split="all", execution_options=ingest_options(config, plan.mode)
        ),
    )
    log.info("train: run %s -> %s (%d workers, %s)", run_name, run_dir, t.num_workers, t.precision)
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        raise UserError(f"training run {run_name} failed: {first_cause(e)}") from None
    return summarize(config, run_name, result, plan.to_dict())


def first_cause(error: BaseException) -> str:
    """One line saying what really failed (a worker's own error, not Ray's wrapping of it)."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank, failure in sorted(failures.items()):
        lines = [ln for ln in str(failure).splitlines() if ln.strip()]
        return f"rank {rank}: {lines[-1] if lines else type(failure).__name__}"
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    return lines[-1] if lines else type(error).__name__


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


def run_preprocessor(config: Config, run_dir: str, manifest: DatasetManifest, fit) -> Preprocessor:
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


def summarize(
    config: Config, run_name: str, result: Any, data_path: dict[str, Any]
) -> dict[str, Any]:
    if result.error:
        raise UserError(f"training run {run_name} failed: {first_cause(result.error)}")
    t = config.train
    best = result.get_best_checkpoint(t.checkpoint_metric, t.checkpoint_mode) or result.checkpoint
    if best is None:
        raise UserError(f"training run {run_name} finished without a checkpoint")
    uri = checkpoint_uri(config, best.path)
    meta = checkpoint.CheckpointMeta.read(storage.join(uri, checkpoint.META))
    # The latest checkpoint tells how far the run got; the best one can be an earlier epoch.
    latest = result.checkpoint or best
    last = checkpoint.CheckpointMeta.read(
        storage.join(checkpoint_uri(config, latest.path), checkpoint.META)
    )
    waits, epoch_seconds = last.data_wait_history, last.epoch_seconds_history
    return {
        "stage": "train",
        "run_name": run_name,
        "checkpoint": uri,
        "num_workers": t.num_workers,
        "precision": t.precision,
        "epoch": meta.epoch,
        "final_epoch": last.epoch,
        "resume_history": last.resume_history,
        "worker_nodes": meta.worker_nodes,
        "metrics": meta.metrics,
        "data_path": data_path,
        # Median over epochs 2..N of the slowest rank's share of loop time spent waiting.
        "data_wait_fraction": steady_median(waits),
        "data_wait_history": waits,
        # Training-loop time of a steady epoch (median over epochs 2..N), slowest rank.
        "epoch_seconds": steady_median(epoch_seconds),
        "epoch_seconds_history": epoch_seconds,
        "first_step_at": last.first_step_at,
    }


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def train_loop(loop_config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    config = validate(loop_config["config"])
    t = config.train
    quiet_ray_train_logs()
    preprocessor = Preprocessor.from_json(loop_config["preprocessor"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(t.torch_threads)
    torch.manual_seed(t.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)

    from app.models import build_model

    model = build_model(config.model, preprocessor)
    total_steps = steps_per_epoch(loop_config["train_rows"], world, config) * t.epochs
    state = TrainState.create(model, config, total_steps)
    resumed = ray.train.get_checkpoint()
    if resumed:
        with resumed.as_directory() as folder:
            state.restore(folder)
        log.info("rank %d: resumed from epoch %d (step %d)", rank, state.epoch, state.step)
    else:
        torch.manual_seed(t.seed + rank)  # ranks then differ in dropout
    model = ray.train.torch.prepare_model(model)
    state.model = model
    device = ray.train.torch.get_device()
    if t.precision == "fp16" and device.type != "cuda":
        raise RuntimeError(f"train.precision=fp16 needs CUDA, but rank {rank} runs on {device}")
    metrics_sink = TrainMetrics(loop_config["run_dir"]) if rank == 0 else None
    state.worker_nodes = gather_node_ids(world)

    train_feed, val_feed = (feed(config, loop_config["data_path"], s) for s in ("train", "val"))
    log_every = t.log_every_steps if rank == 0 else 0
    for epoch in range(state.epoch + 1, t.epochs + 1):
        maybe_inject_fault(config, loop_config["run_dir"], rank, epoch)
        batches = train_feed.batches(t.batch_size, seed=order_seed(t.seed, epoch, rank))
        train_stats = train_epoch(state, batches, device, log_every)
        if epoch < t.epochs:  # the next pass starts while this epoch validates and reports
            train_feed.prefetch(t.batch_size, seed=order_seed(t.seed, epoch + 1, rank))
        val_batches = val_feed.batches(t.batch_size * 4)
        val_stats = validate_epoch(model, val_batches, device, t.precision)
        state.epoch = epoch
        state.data_wait_history.append(train_stats["data_wait_fraction"])
        state.epoch_seconds_history.append(train_stats["epoch_seconds"])
        metrics = {"epoch": epoch, "step": state.step, **train_stats, **val_stats}
        if rank == 0:
            log_epoch(metrics, t.epochs)
            assert metrics_sink is not None
            metrics_sink.record(metrics)
        report(state, metrics, preprocessor, config, rank)


def quiet_ray_train_logs() -> None:
    """Ray Train logs every report's full metrics dict and checkpoint path at INFO, per rank,
    per epoch; the job log keeps our one line per epoch instead. (Its logger is named after
    the module's file path, not its dotted name.)"""
    from ray.train.v2._internal.execution import context, storage

    for module in (context, storage):
        for name in (module.__name__, getattr(module, "__file__", "")):
            logging.getLogger(name).setLevel(logging.WARNING)


def feed(config: Config, mode: str, split: str):
    """This worker's batches of one split: its shard kept in memory, or streamed each epoch."""
    import ray.train

    from app.feed import MemoryFeed, StreamFeed

    shard = ray.train.get_dataset_shard(split)
    if mode == "memory":
        return MemoryFeed.from_shard(shard)
    d = config.data
    return StreamFeed(shard, d.stream_prefetch_batches, config.train.shuffle_buffer)


def log_epoch(metrics: dict[str, Any], epochs: int) -> None:
    log.info(
        "epoch %d/%d: train_loss %.4f val_loss %.4f val_accuracy %.4f | %.2fs %.0f samples/s "
        "data_wait %.1f%%",
        metrics["epoch"],
        epochs,
        metrics["train_loss"],
        metrics["val_loss"],
        metrics["val_accuracy"],
        metrics["epoch_seconds"],
        metrics["samples_per_second"],
        100 * metrics["data_wait_fraction"],
    )


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
    """Every rank calls report (it is a barrier); rank 0 alone attaches the checkpoint.

    The upload mode is `train.checkpoint_upload`; either way Ray deletes the local folder once
    the checkpoint is persisted under `train.storage_path`.
    """
    import ray.train

    if rank != 0:
        ray.train.report(metrics)
        return
    meta = checkpoint.CheckpointMeta(
        config=dump(config),
        epoch=state.epoch,
        step=state.step,
        metrics=metrics,
        resume_history=state.resume_history,
        data_wait_history=state.data_wait_history,
        epoch_seconds_history=state.epoch_seconds_history,
        first_step_at=state.first_step_at,
        worker_nodes=state.worker_nodes,
        preprocessor=preprocessor.to_json(),
        torch_version=torch.__version__,
    )
    folder = tempfile.mkdtemp(prefix="raytorch-ckpt-")
    checkpoint.save(folder, state.model, state.train_state(), meta)
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(folder),
        checkpoint_upload_mode=ray.train.CheckpointUploadMode[
            config.train.checkpoint_upload.upper()
        ],
        delete_local_checkpoint_after_upload=True,
    )


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
