"""Train: Ray Train `TorchTrainer` workers (DDP or FSDP, native AMP) fed from Parquet shards.

The driver fits the preprocessor, chooses the data path (app/data/ingest.py: each worker reads its rows
into memory, or streams them through its own Ray Data execution) and launches the trainer; each
worker runs `train_loop` top to bottom: build model -> maybe resume -> epochs of
(train, validate, report + checkpoint). The epoch itself is Ray-free (app/train/loop.py). Re-running with the same run name and storage path resumes.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from app import storage
from app.config import Config, dump, validate
from app.data import kinds
from app.data.preprocess import Preprocessor
from app.errors import ConfigError, UserError
from app.ray_private import lean_torch_trainer, quiet_train_logs
from app.ray_runtime import connect_ray
from app.tasks.registry import Task, check_metric, run_task
from app.train import checkpoint, elastic, finetune, parallel, tracking
from app.train.loop import (
    TrainState,
    all_reduce,
    best_index,
    budget_spent,
    epoch_batches,
    order_seed,
    should_stop_early,
    steady_median,
    steps_per_epoch,
    train_epoch,
)
from app.train.profiling import PROFILE_DIR, RunProbes

if TYPE_CHECKING:  # app.data.prepare (pandas, pyarrow) is imported on the driver only
    from app.data.ingest import DataPlan
    from app.data.prepare import DatasetManifest

log = logging.getLogger(__name__)
FAULT_ENV = "RAYTORCH_FAIL_AT"  # "rank:epoch", test-only, same as train.fail_at
# Test-only: "3,6": each rank waits at the start of those epochs while <run>/hold-epoch-<n>
# exists (rank 0 says so in <run>/held-epoch-<n>-world-<w>), so a test can change the cluster
# at a known point of a run.
HOLD_ENV = "RAYTORCH_HOLD_EPOCHS"
PREPROCESSOR_FILE = "preprocessor.json"


# --------------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------------


@dataclass
class RunPlan:
    """What the driver decided before launching: the run, its task, data and preprocessor."""

    name: str
    dir: str
    task: Task
    manifest: DatasetManifest
    preprocessor: Preprocessor
    data: DataPlan
    shards: dict[str, list[tuple[str, int]]]
    mlflow_run: str | None


def train(
    config: Config, callbacks: list[Any] | None = None, *, job_outlives_run: bool = False
) -> dict[str, Any]:
    """Run training; `callbacks` are Ray Train callbacks (jobs.tune passes Tune's reporter).

    `job_outlives_run`: this process can be killed while its job goes on (a Tune trial that
    ASHA stops), so the run's placement group needs Ray Train's cleaner to be released."""
    import ray.train

    run = plan_run(config)
    trainer = make_trainer(config, run, callbacks or [], pg_cleaner=job_outlives_run)
    t = config.train
    workers = (
        f"{t.min_workers}-{t.max_workers} workers, elastic"
        if t.elastic
        else f"{t.min_workers} workers"
    )
    log.info("train: run %s -> %s (%s, %s)", run.name, run.dir, workers, t.precision)
    try:
        result = trainer.fit()
        summary = summarize(config, run.task, run.name, result, run.data.to_dict())
    except ray.train.TrainingFailedError as e:
        tracking.finish_mlflow_run(run.mlflow_run, None)
        cause = startup_failure(config, e) or first_cause(e)
        raise UserError(f"training run {run.name} failed: {cause}") from None
    except BaseException:
        tracking.finish_mlflow_run(run.mlflow_run, None)
        raise
    tracking.finish_mlflow_run(run.mlflow_run, summary)
    return summary


def plan_run(config: Config) -> RunPlan:
    """Everything that can fail before a worker starts fails here, with one line."""
    from app.data.ingest import fit_preprocessor, plan_data_path, split_shards
    from app.data.prepare import read_manifest, verify_shards

    check_precision(config)
    elastic.warn_inexact(config.train)
    name = config.run_name()
    run_dir = storage.join(config.storage_path, name)
    manifest = read_manifest(config.data_output)
    for split in ("train", "val"):  # a damaged shard is refused here, naming the file
        verify_shards(config.data_output, manifest, split)
    preprocessor = run_preprocessor(config, run_dir, manifest, fit_preprocessor)
    task = run_task(config.train.task, manifest.kind)
    check_metric(config, task)
    # A model that cannot take this data, or cannot fit a worker, fails here (built on the meta
    # device: structure without memory).
    model = finetune.meta_model(lambda: finetune.trainable_model(config, preprocessor))
    mlflow_run = open_mlflow_run(config, name)  # an unreachable backend fails before training
    connect_ray()
    finetune.check_fits(
        finetune.memory_per_worker(model, config.train), config.train, memory_per_worker(config)
    )
    data = plan_data_path(config, manifest, preprocessor)
    log.info("train: data path %s: %s", data.mode, data.reason)
    # Each worker reads its own share of each split: held in memory, or streamed by Ray Data.
    shards = {split: split_shards(config, manifest, split) for split in ("train", "val")}
    return RunPlan(name, run_dir, task, manifest, preprocessor, data, shards, mlflow_run)


def memory_per_worker(config: Config) -> float | None:
    """Bytes of memory one train worker can use: the cluster's Ray memory over the workers (the
    most an elastic run may have)."""
    import ray

    memory = ray.cluster_resources().get("memory")
    return memory / config.train.max_workers if memory else None


def make_trainer(config: Config, run: RunPlan, callbacks: list[Any], pg_cleaner: bool) -> Any:
    import ray.train

    t = config.train
    set_controller_env(config)
    loop_config = {
        "config": dump(config),
        "preprocessor": run.preprocessor.to_json(),
        "run_dir": run.dir,
        "train_rows": run.manifest.rows["train"],
        "shards": run.shards,
        "stream": {split: run.data.split_mode(split) == "stream" for split in run.shards},
        "task": run.task,  # the object itself: a task registered in the driver only works too
        "reference_metrics": run.task.reference_metrics(config, run.manifest, run.preprocessor),
        "mlflow": {"uri": tracking.mlflow_uri(), "run_id": run.mlflow_run}
        if run.mlflow_run
        else None,
    }
    return lean_torch_trainer(pg_cleaner)(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(**scaling(config)),
        run_config=ray.train.RunConfig(
            name=run.name,
            storage_path=config.storage_path,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=t.keep_checkpoints,
                checkpoint_score_attribute=t.checkpoint_metric,
                checkpoint_score_order=t.checkpoint_mode,
            ),
            # ray.train's type stubs name Train V1's FailureConfig; V2's (the default) has the limit.
            failure_config=ray.train.FailureConfig(  # type: ignore[call-arg]
                max_failures=t.max_failures, controller_failure_limit=startup_retries(t)
            ),
            callbacks=callbacks,
        ),
    )


def scaling(config: Config) -> dict[str, Any]:
    """ScalingConfig's arguments; an elastic run's (min, max) and resize interval (Train V2's
    ScalingConfig, which ray.train's type stubs do not describe)."""
    t = config.train
    out: dict[str, Any] = {
        "num_workers": elastic.scaling_workers(t),
        "use_gpu": t.use_gpu,
        "resources_per_worker": worker_resources(config),
        "placement_strategy": t.placement_strategy,
    }
    if t.elastic:
        out["elastic_resize_monitor_interval_s"] = t.elastic_resize_interval_s
    return out


def set_controller_env(config: Config) -> None:
    """Ray Train settings its controller reads from the environment (Ray Train propagates this
    process's RAY_TRAIN_* variables to it); one the user exported wins."""
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(config.train.controller_poll_s))
    # The preemption watcher is one more actor process per worker group, started as the workers
    # start. It serves loops that call
    # ray.train.get_preemption_info, which this one does not: a drained node's ranks fail and the
    # run resumes from its last checkpoint, as for any other fault.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def open_mlflow_run(config: Config, run_name: str) -> str | None:
    try:
        return tracking.start_mlflow_run(config, run_name)
    except Exception as e:  # noqa: BLE001 - MLflow raises its own kinds; one line either way
        raise UserError(f"MLflow tracking ({tracking.URI_ENV}): {tracking.first_line(e)}") from None


# Worker-group start-ups that time out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S each, 60 s by
# default) are retried this many times, then the run fails: Ray's default retries forever.
STARTUP_RETRIES = 2
# An elastic run sizes each restart by Ray's view of free resources, which lags a lost node by
# up to 20 s (Ray Data's autoscaling coordinator refreshes it on that tick): a restart may first
# try a size that no longer fits and time out, so such runs get more tries.
ELASTIC_STARTUP_RETRIES = 5


def startup_retries(t: Any) -> int:
    return ELASTIC_STARTUP_RETRIES if t.elastic else STARTUP_RETRIES


def startup_failure(config: Config, error: BaseException) -> str | None:
    """One line for a run whose workers never got their resources, naming what was missing."""
    failure = getattr(error, "controller_failure", None)
    if type(failure).__name__ != "WorkerGroupStartupTimeoutError":
        return None
    import ray

    t = config.train
    need = {k: v * t.min_workers for k, v in worker_resources(config).items()}
    free = ray.available_resources()
    total = ray.cluster_resources()
    have = ", ".join(f"{k} {free.get(k, 0):g} free of {total.get(k, 0):g}" for k in sorted(need))
    wanted = ", ".join(f"{k} {v:g}" for k, v in sorted(need.items()))
    return (
        f"its {t.min_workers} workers did not start in {startup_retries(t) + 1} tries: they need "
        f"{wanted} together and the cluster has {have}; stop what holds them, add nodes, or "
        "lower train.num_workers / train.cpus_per_worker"
    )


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
        return kinds.from_json(storage.read_bytes(uri).decode())
    preprocessor = fit(config, manifest)
    storage.write_bytes(uri, preprocessor.to_json().encode())
    return preprocessor


def checkpoint_uri(config: Config, path: str) -> str:
    scheme = config.storage_path.split("://", 1)[0] if "://" in config.storage_path else ""
    return f"{scheme}://{path}" if scheme else path


def summarize(
    config: Config, task: Task, run_name: str, result: Any, data_path: dict[str, Any]
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
        "task": task.name,
        "checkpoint": uri,
        # The size the run ended at; every size it trained at, from which epoch and why.
        "num_workers": last.num_workers_history[-1]["workers"]
        if last.num_workers_history
        else t.min_workers,
        "num_workers_history": last.num_workers_history,
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
        # Every epoch's report, from the latest checkpoint (TensorBoard holds the same values).
        "history": last.history,
        "early_stopping": early_stopping_summary(config, last),
        "tensorboard": storage.join(config.storage_path, run_name, tracking.TENSORBOARD_DIR),
        "mlflow_run_id": last.mlflow_run_id,
        **parallel_summary(config, run_name, last),
    }


def parallel_summary(
    config: Config, run_name: str, last: checkpoint.CheckpointMeta
) -> dict[str, Any]:
    """How the run was spread over ranks and what that cost: bytes per rank, step times."""
    t = config.train
    first, steady = last.first_step_seconds, last.step_seconds
    compile_s = first - steady if t.compile and first is not None and steady is not None else None
    profile = storage.join(config.storage_path, run_name, PROFILE_DIR) if t.profile_steps else None
    return {
        "strategy": t.strategy,
        "activation_checkpointing": t.activation_checkpointing,
        # The largest rank's parameter / gradient / optimizer-state bytes (local shards).
        "memory_per_rank": last.memory_per_rank,
        # The latest attempt's first optimizer step vs its steady step time; with
        # train.compile the difference is the compilation.
        "first_step_seconds": first,
        "step_seconds": steady,
        "compile_seconds": compile_s,
        "profile": profile,
    }


def early_stopping_summary(
    config: Config, last: checkpoint.CheckpointMeta
) -> dict[str, Any] | None:
    """Whether the run stopped early, after which epoch, and its best epoch by the metric."""
    t = config.train
    if t.early_stopping_patience is None:
        return None
    values = [float(m[t.early_stopping_metric]) for m in last.history]
    best = best_index(values, t.early_stopping_mode, t.early_stopping_min_delta) if values else None
    return {
        "metric": t.early_stopping_metric,
        "mode": t.early_stopping_mode,
        "patience": t.early_stopping_patience,
        "stopped": last.stopped_early,
        "stopped_after_epoch": last.epoch if last.stopped_early else None,
        "best_epoch": last.history[best]["epoch"] if best is not None else None,
    }


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


@dataclass
class Worker:
    """One rank's run: what `train_loop` sets up once and every epoch uses."""

    config: Config
    rank: int
    world: int
    device: torch.device
    task: Task
    validate: Callable[..., dict[str, float]]
    preprocessor: Preprocessor
    train_feed: Any
    val_feed: Any
    state: TrainState
    build: Callable[[], nn.Module]
    probes: RunProbes
    run_dir: str
    mlflow_run: str | None
    metrics_sink: TrainMetrics | None
    tracker: tracking.EpochTracker | None

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        self.probes.close()


def train_loop(loop_config: dict[str, Any]) -> None:
    w = start_worker(loop_config)
    # A resumed run that had already stopped early stays stopped (unless patience was raised).
    done = should_stop_early(w.state.history, w.config) or budget_spent(w.state)
    last_epoch = w.state.epoch if done else w.config.train.epochs
    for epoch in range(w.state.epoch + 1, last_epoch + 1):
        if run_epoch(w, epoch):
            break
    w.close()


def start_worker(loop_config: dict[str, Any]) -> Worker:
    """Feeds, model (parallelized), optimizer state (resumed if a checkpoint exists), probes."""
    import ray.train
    import ray.train.torch

    config = validate(loop_config["config"])
    t, run_dir = config.train, loop_config["run_dir"]
    quiet_train_logs()
    preprocessor = kinds.from_json(loop_config["preprocessor"])
    task: Task = loop_config["task"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    config = elastic.for_world(config, world)  # an elastic run keeps its global batch
    t = config.train
    torch.set_num_threads(t.torch_threads)
    torch.manual_seed(t.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    device = ray.train.torch.get_device()
    if t.precision == "fp16" and device.type != "cuda":
        raise RuntimeError(f"train.precision=fp16 needs CUDA, but rank {rank} runs on {device}")
    shards, stream = loop_config["shards"], loop_config["stream"]
    train_feed, val_feed = (
        feed(config, shards[s], stream[s], preprocessor, rank, world) for s in ("train", "val")
    )
    resumed = ray.train.get_checkpoint()
    if not resumed:  # streamed: Ray Data starts its first pass while the model is built
        train_feed.prefetch(t.batch_size, seed=order_seed(t.seed, 1, rank))
    build = functools.partial(finetune.trainable_model, config, preprocessor)
    # DDP or FSDP, activation checkpointing, torch.compile (app/train/parallel.py); the
    # optimizer is built over what that leaves (under FSDP, this rank's shards). A fresh run
    # starts from the pretrained folder's weights; a resumed one from its checkpoint.
    model = parallel.parallelize(build(base_weights=not resumed), t, device)
    total_steps = steps_per_epoch(loop_config["train_rows"], world, config) * t.epochs
    state = TrainState.create(model, config, total_steps)
    if resumed:
        with resumed.as_directory() as folder:
            state.restore(folder, rank)
        log.info("rank %d: resumed from epoch %d (step %d)", rank, state.epoch, state.step)
    else:
        torch.manual_seed(t.seed + rank)  # ranks then differ in dropout
    state.worker_nodes = gather_node_ids(world)
    state.num_workers_history = elastic.record_size(
        state.num_workers_history, world, state.epoch + 1, t, announce=rank == 0
    )
    mlflow = loop_config.get("mlflow")
    return Worker(
        config=config,
        rank=rank,
        world=world,
        device=device,
        task=task,
        validate=task.validator(loop_config.get("reference_metrics")),
        preprocessor=preprocessor,
        train_feed=train_feed,
        val_feed=val_feed,
        state=state,
        build=build,
        # Memory, step times, profiler trace: optimizer hooks, so after restoring (may step).
        probes=RunProbes(state, config, run_dir, rank, device),
        run_dir=run_dir,
        mlflow_run=mlflow and mlflow["run_id"],
        metrics_sink=TrainMetrics(run_dir) if rank == 0 else None,
        tracker=tracking.EpochTracker(run_dir, mlflow) if rank == 0 else None,
    )


def run_epoch(w: Worker, epoch: int) -> bool:
    """Train, validate, report (a barrier every rank calls); whether the run stops early."""
    t, state = w.config.train, w.state
    maybe_inject_fault(w.config, w.run_dir, w.rank, epoch)
    maybe_hold(w.run_dir, w.rank, w.world, epoch)
    seed = order_seed(t.seed, epoch, w.rank)
    batches = epoch_batches(w.train_feed, t.batch_size, seed, w.config, state.step)
    w.probes.before_epoch()
    log_every = t.log_every_steps if w.rank == 0 else 0
    train_stats = train_epoch(state, batches, w.device, log_every, w.task.part("loss"))
    if epoch < t.epochs and not budget_spent(state):  # the next pass overlaps validation
        w.train_feed.prefetch(t.batch_size, seed=order_seed(t.seed, epoch + 1, w.rank))
    val_stats = w.validate(state.model, w.val_feed.batches(t.batch_size * 4), w.device, t.precision)
    state.epoch = epoch
    state.data_wait_history.append(train_stats["data_wait_fraction"])
    state.epoch_seconds_history.append(train_stats["epoch_seconds"])
    metrics = {"epoch": epoch, "step": state.step, **train_stats, **val_stats}
    state.history.append(dict(metrics))
    # Every rank must leave the loop after the same report (it is a barrier): the decision is
    # on all-reduced metrics, and the flag is all-reduced too.
    stop = all_reduce([float(should_stop_early(state.history, w.config))], w.device, "max")[0] > 0
    if w.metrics_sink is not None:
        log_epoch(metrics, t.epochs, w.task)
        w.metrics_sink.record(metrics)
    run_stats = w.probes.after_epoch()
    report(
        state,
        metrics,
        w.preprocessor,
        w.config,
        w.rank,
        stop,
        w.mlflow_run,
        build=w.build,
        run_stats=run_stats,
    )
    if w.tracker is not None:
        w.tracker.log(metrics)
    if stop and w.rank == 0:
        log.info(
            "early stopping after epoch %d: %s has not improved for %d epochs",
            epoch,
            t.early_stopping_metric,
            t.early_stopping_patience,
        )
    return stop or budget_spent(state)


def feed(
    config: Config,
    shards: list[tuple[str, int]],
    stream: bool,
    preprocessor: Preprocessor,
    rank: int,
    world: int,
):
    """This worker's batches of one split: its row range of `shards` read once and kept in
    memory (the memory path), or streamed by Ray Data each epoch."""
    from app.data.feed import MemoryFeed, StreamFeed
    from app.data.ingest import read_rank_share, stream_split

    if not stream:
        return MemoryFeed(lambda: read_rank_share(shards, rank, world, preprocessor))
    d = config.data
    share = stream_split(config, shards, preprocessor, rank, world)
    return StreamFeed(share, d.stream.prefetch_blocks, config.train.shuffle_buffer)


def log_epoch(metrics: dict[str, Any], epochs: int, task: Task) -> None:
    log.info(
        "epoch %d/%d: train_loss %.4f %s | %.2fs %.0f samples/s data_wait %.1f%%",
        metrics["epoch"],
        epochs,
        metrics["train_loss"],
        task.part("headline")(metrics),
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
    stopped_early: bool = False,
    mlflow_run_id: str | None = None,
    *,
    build: Callable[[], nn.Module] | None = None,
    run_stats: dict[str, Any] | None = None,
) -> None:
    """Every rank calls report (it is a barrier); rank 0 alone attaches the checkpoint, except
    under FSDP, where every rank attaches its shards and Ray Train merges the folders.

    The upload mode is `train.checkpoint_upload`; either way Ray deletes the local folder once
    the checkpoint is persisted under `train.storage_path`. `build` makes a plain copy of the
    model (FSDP's consolidated `model.safetensors`); `run_stats` are extra `meta.json` fields.
    """
    import ray.train

    folder, weights = None, state.model
    if parallel.is_sharded(state.model):
        assert build is not None, "an FSDP checkpoint needs the model builder"
        folder, weights = sharded_checkpoint(state, build, rank)
    upload = {
        "checkpoint_upload_mode": ray.train.CheckpointUploadMode[
            config.train.checkpoint_upload.upper()
        ],
        "delete_local_checkpoint_after_upload": True,
    }
    if rank != 0:
        if folder is None:
            ray.train.report(metrics)
        else:
            ray.train.report(
                metrics, checkpoint=ray.train.Checkpoint.from_directory(folder), **upload
            )
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
        num_workers_history=state.num_workers_history,
        preprocessor=preprocessor.to_json(),
        torch_version=torch.__version__,
        history=state.history,
        stopped_early=stopped_early,
        mlflow_run_id=mlflow_run_id,
        **(run_stats or {}),
    )
    folder = folder or tempfile.mkdtemp(prefix="raytorch-ckpt-")
    checkpoint.save(folder, weights, state.train_state(), meta)
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder), **upload)


def sharded_checkpoint(
    state: TrainState, build: Callable[[], nn.Module], rank: int
) -> tuple[str, nn.Module | None]:
    """Collective (FSDP): every rank writes its shards into a local folder of its own; rank 0
    also gets a plain, consolidated copy of the model for `model.safetensors`."""
    folder = tempfile.mkdtemp(prefix="raytorch-ckpt-")
    checkpoint.save_sharded(folder, state.model, state.optimizer, rank)
    full = parallel.full_state_dict(state.model)  # gathered to rank 0, on CPU
    return folder, parallel.plain_model(build, full) if rank == 0 else None


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


def maybe_hold(run_dir: str, rank: int, world: int, epoch: int) -> None:
    """Test-only ($RAYTORCH_HOLD_EPOCHS): wait here while the test holds this epoch."""
    import time

    if str(epoch) not in os.environ.get(HOLD_ENV, "").split(","):
        return
    hold = storage.join(run_dir, f"hold-epoch-{epoch}")
    if rank == 0 and storage.exists(hold):
        storage.write_bytes(storage.join(run_dir, f"held-epoch-{epoch}-world-{world}"), b"")
    while storage.exists(hold):
        time.sleep(0.2)


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
            if name in metrics:  # val_accuracy is the classifiers' only
                gauge.set(float(metrics[name]), tags=self.tags)
