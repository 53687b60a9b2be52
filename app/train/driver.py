"""Train, the driver side: Ray Train `TorchTrainer` workers (DDP or FSDP, native AMP) fed from
Parquet shards.

The driver plans the run (fits the preprocessor, picks the task, chooses the data path:
app/data/ingest.py, each worker reads its rows into memory or streams them through its own Ray
Data execution, and checks the model fits a worker), sets up Ray Train and summarizes the result.
Each rank runs app/train/worker.py. Re-running with the same run name and storage path resumes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app import storage
from app.config import Config, dump
from app.data import kinds
from app.data.preprocess import Preprocessor
from app.errors import ConfigError, UserError
from app.ray_private import lean_torch_trainer
from app.ray_runtime import connect_ray
from app.registry import Task, check_metric, run_task
from app.train import checkpoint, elastic, finetune, pipelining, tracking
from app.train.loop import best_index, short_budget, steady_median
from app.train.parts import PIPELINE_BATCH, PIPELINE_LOSS, REFERENCE
from app.train.profiling import PROFILE_DIR
from app.train.worker import PLAN_KEY, WorkerPlan, rank_task, train_loop

if TYPE_CHECKING:  # app.data.prepare (pandas, pyarrow) is imported on the driver only
    from torch import nn

    from app.data.ingest import DataPlan
    from app.data.prepare import DatasetManifest

log = logging.getLogger(__name__)
PREPROCESSOR_FILE = "preprocessor.json"


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

    from app.ray_private import train_controller_released

    run = plan_run(config)
    trainer = make_trainer(config, run, callbacks or [], pg_cleaner=job_outlives_run)
    t = config.train
    workers = (
        f"{t.min_workers}-{t.max_workers} workers, elastic"
        if t.elastic
        else f"{t.min_workers} workers"
    )
    log.info("train: run %s -> %s (%s, %s)", run.name, run.dir, workers, t.precision)
    # A Tune trial's process may end before its run; other jobs return once theirs has ended.
    with train_controller_released(wait=not job_outlives_run):
        try:
            result = trainer.fit()
            summary = summarize(config, run.task, run.name, result, run.data.to_dict())
            # Set when train.max_steps stopped the run short of one epoch of the training rows.
            summary["short_budget"] = short_budget(run.manifest.rows["train"], config)
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
    from app.data.ingest import plan_data_path, split_shards
    from app.data.prepare import read_manifest, verify_shards
    from app.train.preprocessing import fit_preprocessor

    check_precision(config)
    elastic.warn_inexact(config.train)
    name = config.run_name()
    run_dir = storage.join(config.storage_path, name)
    manifest = read_manifest(config.data_output)
    for split in ("train", "val"):  # a damaged shard is refused here, naming the file
        verify_shards(config.data_output, manifest, split)
    check_val_rows(manifest.rows["val"], config.train.max_workers)
    preprocessor = run_preprocessor(config, run_dir, manifest, fit_preprocessor)
    task = run_task(config.train.task, manifest.kind)
    check_metric(config, task)
    # A model that cannot take this data, or cannot fit a worker, fails here (built on the meta
    # device: structure without memory).
    model = finetune.trainable_model(config, preprocessor, meta=True)
    finetune.check_initialisable(model, config.train)
    check_pipeline(config, task, model)
    mlflow_run = open_mlflow_run(config, name)  # an unreachable backend fails before training
    connect_ray()
    finetune.check_fits(
        finetune.memory_per_worker(model, config.train), config.train, memory_per_worker(config)
    )
    data = plan_data_path(config, manifest, preprocessor)
    log.info("train: data path %s: %s", data.mode, data.reason)
    if budget := short_budget(manifest.rows["train"], config):
        log.warning("train: %s", budget)
    # Each worker reads its own share of each split: held in memory, or streamed by Ray Data.
    shards = {split: split_shards(config, manifest, split) for split in ("train", "val")}
    return RunPlan(name, run_dir, task, manifest, preprocessor, data, shards, mlflow_run)


def check_pipeline(config: Config, task: Task, model: nn.Module) -> None:
    """Under train.strategy=pipeline: a task whose last stage can score an output alone, and a
    model the stages can split."""
    t = config.train
    if t.strategy != "pipeline":
        return
    if not (task.has(PIPELINE_BATCH) and task.has(PIPELINE_LOSS)):
        raise ConfigError(
            f"config error: train.strategy=pipeline: task {task.name!r} does not train in "
            "pipeline stages (it has no pipeline_batch and pipeline_loss parts); use "
            "train.strategy=ddp or fsdp"
        )
    try:
        pipelining.check_split(model, t)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None


def check_val_rows(rows: int, workers: int) -> None:
    """Every worker validates at least one row (each validates its share of every row)."""
    if rows < workers:
        raise UserError(
            f"data: the val split has {rows} rows, fewer than the {workers} workers "
            "train.num_workers allows: raise data.val_fraction or lower train.num_workers"
        )


def reference_metrics(config: Config, run: RunPlan) -> dict[str, float]:
    """What the task's driver computes once for the run (a baseline), if anything."""
    if not run.task.has(REFERENCE):
        return {}
    return run.task.part(REFERENCE)(config, run.manifest, run.preprocessor)


def mlflow_run(run: RunPlan) -> tracking.MlflowRun | None:
    uri = tracking.mlflow_uri()
    return tracking.MlflowRun(uri, run.mlflow_run) if run.mlflow_run and uri else None


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
    plan = WorkerPlan(
        config=dump(config),
        preprocessor=run.preprocessor.to_json(),
        run_dir=run.dir,
        train_rows=run.manifest.rows["train"],
        shards=run.shards,
        stream={split: run.data.split_mode(split) == "stream" for split in run.shards},
        task=rank_task(run.task),
        reference_metrics=reference_metrics(config, run),
        mlflow=mlflow_run(run),
    )
    return lean_torch_trainer(pg_cleaner)(
        train_loop,
        train_loop_config={PLAN_KEY: plan},
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
