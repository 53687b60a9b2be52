"""The worker side of training: what each Ray Train rank runs (`train_loop`).

`Worker.start` sets a rank up once (feeds, the model spread over ranks, the optimizer state,
resumed from the latest checkpoint if there is one, probes); `run_epoch` trains, validates and
reports one epoch (a barrier every rank calls); `report` writes the checkpoint. The epoch itself
is Ray-free (app/train/loop.py); the task's loss, validation and log line come from its spec
(app/train/parts.py).
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app import hooks
from app.config import Config, TrainConfig, dump, validate
from app.data import kinds
from app.data.feed import padded, padding_only
from app.data.ingest import padding_batches
from app.data.preprocess import Preprocessor
from app.models import has_pretrained
from app.models.init import tied_names
from app.ray_private import quiet_train_logs
from app.registry import Task
from app.train import checkpoint, consolidate, elastic, finetune, materialise, parallel, tracking
from app.train.loop import (
    TrainState,
    all_reduce,
    budget_spent,
    epoch_batches,
    order_seed,
    should_stop_early,
    train_epoch,
)
from app.train.parts import HEADLINE, LOSS, PIPELINE_BATCH, PIPELINE_LOSS, VALIDATE
from app.train.pipelining import PipelinedModel, Scoring
from app.train.profiling import RunProbes

log = logging.getLogger(__name__)
VAL_BATCH_FACTOR = 4  # validation batches are this many training batches (no gradients)


@dataclass(frozen=True)
class WorkerPlan:
    """What the driver hands every rank (app/train/driver.py `make_trainer`), pickled once by
    Ray Train as the loop's config (`{PLAN_KEY: plan}`)."""

    config: dict[str, Any]  # the run's config, dumped; validated again on the rank
    preprocessor: str  # fitted on the driver, as JSON
    run_dir: str
    train_rows: int
    shards: dict[str, list[tuple[str, int]]]  # split -> (uri, rows) of each shard
    stream: dict[str, bool]  # split -> streamed with Ray Data (else read once into memory)
    task: Task  # the object itself, cut by `rank_task` (a task registered in the driver only works)
    reference_metrics: dict[str, float]  # the task's baseline, computed once by the driver
    mlflow: tracking.MlflowRun | None


PLAN_KEY = "plan"
# The task's parts a rank calls. Ranks (and Ray Train's controller, which unpickles the plan too)
# get the task with these alone: its serving and export parts would import Ray Serve, FastAPI and
# the exporter (hundreds of modules) into every training process.
RANK_PARTS = (LOSS, PIPELINE_BATCH, PIPELINE_LOSS, VALIDATE, HEADLINE)


def rank_task(task: Task) -> Task:
    """`task` as the driver hands it to the ranks."""
    return task.only(*RANK_PARTS)


def train_loop(loop_config: dict[str, WorkerPlan]) -> None:
    """Ray Train's per-rank function: epochs until the last one, early stopping or the budget."""
    w = Worker.start(loop_config[PLAN_KEY])
    # A resumed run that had already stopped early stays stopped (unless patience was raised).
    done = should_stop_early(w.state.history, w.config) or budget_spent(w.state)
    last_epoch = w.state.epoch if done else w.config.train.epochs
    for epoch in range(w.state.epoch + 1, last_epoch + 1):
        if w.run_epoch(epoch):
            break
    w.close()


@dataclass
class Worker:
    """One rank's run: what `start` sets up once and every epoch uses."""

    config: Config
    rank: int
    world: int
    data_rank: int  # this rank's share of the data (ranks of one pipeline share theirs)
    data_world: int
    device: torch.device
    task: Task
    validate: Callable[..., dict[str, float]]
    preprocessor: Preprocessor
    train_feed: Any
    val_feed: Any
    val_padding: int  # padding batches after this rank's val share (equal forward passes)
    state: TrainState
    probes: RunProbes
    run_dir: str
    mlflow_run: str | None
    metrics_sink: TrainMetrics | None
    tracker: tracking.EpochTracker | None

    @classmethod
    def start(cls, plan: WorkerPlan) -> Worker:
        """Feeds, model (parallelized), optimizer state (resumed if a checkpoint exists)."""
        import ray.train
        import ray.train.torch

        quiet_train_logs()
        preprocessor = kinds.from_json(plan.preprocessor)
        task = plan.task
        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        # An elastic run keeps its global batch whatever the world size.
        config = elastic.for_world(validate(plan.config), world)
        t, run_dir = config.train, plan.run_dir
        torch.set_num_threads(t.torch_threads)
        torch.manual_seed(t.seed)  # same initial weights on every rank (DDP broadcasts rank 0's)
        device = ray.train.torch.get_device()
        if t.precision == "fp16" and device.type != "cuda":
            raise RuntimeError(f"train.precision=fp16 needs CUDA, but rank {rank} runs on {device}")
        shards, stream = plan.shards, plan.stream
        data_rank, data_world = rank // t.stages, world // t.stages
        train_feed, val_feed = (
            feed(config, shards[s], stream[s], preprocessor, data_rank, data_world, s == "val")
            for s in ("train", "val")
        )
        val_rows = sum(rows for _, rows in shards["val"])
        val_batch = t.batch_size * VAL_BATCH_FACTOR
        val_padding = padding_batches(val_rows, data_rank, data_world, val_batch)
        resumed = ray.train.get_checkpoint()
        if not resumed:  # streamed: Ray Data starts its first pass while the model is built
            train_feed.prefetch(t.batch_size, seed=order_seed(t.seed, 1, data_rank))
        build = functools.partial(finetune.trainable_model, config, preprocessor)
        state = start_state(
            config, build, plan.train_rows, resumed, rank, world, device, task,
            preprocessor,
        )  # fmt: skip
        mlflow = plan.mlflow
        return cls(
            config=config,
            rank=rank,
            world=world,
            data_rank=data_rank,
            data_world=data_world,
            device=device,
            task=task,
            validate=functools.partial(task.part(VALIDATE), reference=plan.reference_metrics),
            preprocessor=preprocessor,
            train_feed=train_feed,
            val_feed=val_feed,
            val_padding=val_padding,
            state=state,
            # Memory, step times, profiler trace: optimizer hooks, so after restoring.
            probes=RunProbes(state, config, run_dir, rank, device),
            run_dir=run_dir,
            mlflow_run=mlflow.run_id if mlflow else None,
            metrics_sink=TrainMetrics(run_dir, task) if rank == 0 else None,
            tracker=tracking.EpochTracker(run_dir, mlflow) if rank == 0 else None,
        )

    def run_epoch(self, epoch: int) -> bool:
        """Train, validate, report (a barrier every rank calls); whether the run stops here."""
        t, state = self.config.train, self.state
        hooks.fire(
            "train.epoch", run_dir=self.run_dir, rank=self.rank, world=self.world, epoch=epoch
        )
        seed = order_seed(t.seed, epoch, self.data_rank)
        batches = epoch_batches(self.train_feed, t.batch_size, seed, self.config, state.step)
        self.probes.before_epoch()
        log_every = t.log_every_steps if self.rank == 0 else 0
        stats = train_epoch(state, batches, self.device, log_every, self.task.part(LOSS))
        if epoch < t.epochs and not budget_spent(state):  # the next pass overlaps validation
            next_seed = order_seed(t.seed, epoch + 1, self.data_rank)
            self.train_feed.prefetch(t.batch_size, seed=next_seed)
        val_size = t.batch_size * VAL_BATCH_FACTOR
        val_batches = padded(self.val_feed.batches(val_size), self.val_padding)
        if isinstance(state.model, PipelinedModel) and not state.model.holds_output:
            val_batches = padding_only(val_batches)  # the row's last stage counts them
        stats |= self.validate(state.model, val_batches, self.device, t.precision)
        state.end_epoch(epoch)
        state.data_wait_history.append(stats["data_wait_fraction"])
        state.epoch_seconds_history.append(stats["epoch_seconds"])
        metrics = {"epoch": epoch, "step": state.step, **stats}
        state.history.append(dict(metrics))
        # Every rank must leave the loop after the same report (it is a barrier): the decision
        # is on all-reduced metrics, and the flag is all-reduced too.
        stopping = float(should_stop_early(state.history, self.config))
        stop = all_reduce([stopping], self.device, "max")[0] > 0
        if self.metrics_sink is not None:
            log_epoch(metrics, t.epochs, self.task)
            self.metrics_sink.record(metrics)
        self.report(metrics, stop, self.probes.after_epoch())
        if self.tracker is not None:
            self.tracker.log(metrics)
        if stop and self.rank == 0:
            log.info(
                "early stopping after epoch %d: %s has not improved for %d epochs",
                epoch,
                t.early_stopping_metric,
                t.early_stopping_patience,
            )
        return stop or budget_spent(state)

    def report(
        self, metrics: dict[str, Any], stopped_early: bool, run_stats: dict[str, Any]
    ) -> None:
        """Every rank reports (a barrier); rank 0 alone attaches the checkpoint, except under
        FSDP and pipelines, where every rank attaches its shards and Ray Train merges them."""
        report(
            self.state,
            metrics,
            self.preprocessor,
            self.config,
            self.rank,
            stopped_early,
            self.mlflow_run,
            run_stats=run_stats,
        )

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        self.probes.close()


def start_state(
    config: Config,
    build: Callable[..., nn.Module],
    train_rows: int,
    resumed: Any,
    rank: int,
    world: int,
    device: torch.device,
    task: Task,
    preprocessor: Preprocessor,
) -> TrainState:
    """DDP, FSDP or a pipeline, activation checkpointing, torch.compile (app/train/parallel.py);
    the optimizer over what that leaves (under FSDP and pipelines, this rank's part). A fresh
    run starts from the pretrained folder's weights; a resumed one from its checkpoint."""
    t = config.train
    scoring = None
    if t.strategy == "pipeline":
        scoring = Scoring(task.part(PIPELINE_BATCH), task.part(PIPELINE_LOSS))
    if t.strategy == "ddp":
        model = parallel.parallelize(build(base_weights=not resumed), t, device, scoring)
    else:
        model = sharded_model(build, t, device, scoring, None if resumed else preprocessor)
    state = TrainState.create(model, config, train_rows, world // t.stages)
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
    return state


def sharded_model(
    build: Callable[..., nn.Module],
    t: TrainConfig,
    device: torch.device,
    scoring: Scoring | None,
    pretrained: Preprocessor | None,
) -> nn.Module:
    """FSDP and pipeline ranks never hold the whole model: built on the meta device, sharded or
    cut into stages, then this rank's part allocated and drawn (app/train/materialise.py) and,
    on a fresh run from a pretrained folder, its part of the folder's weights read in."""
    materialise.return_freed_buffers()  # these strategies are for memory: keep it bounded
    meta = build(meta=True)
    ties = tied_names(meta)
    model = parallel.parallelize(meta, t, device, scoring)
    if pretrained is not None and has_pretrained(pretrained):
        read = materialise.load_parts(model, pretrained, ties)
        log.info("read %.1f MiB of pretrained weights (this rank's part)", read / 2**20)
    return model


def feed(
    config: Config,
    shards: list[tuple[str, int]],
    stream: bool,
    preprocessor: Preprocessor,
    rank: int,
    world: int,
    every_row: bool = False,
):
    """This worker's batches of one split: its row range of `shards` read once and kept in
    memory (the memory path), or streamed by Ray Data each epoch. Training shares are equal,
    validation shares cover every row (`rank_range`)."""
    from app.data.feed import MemoryFeed, StreamFeed
    from app.data.ingest import read_rank_share, stream_split

    if not stream:
        return MemoryFeed(lambda: read_rank_share(shards, rank, world, preprocessor, every_row))
    d = config.data
    share = stream_split(config, shards, preprocessor, rank, world, every_row)
    return StreamFeed(share, d.stream.prefetch_blocks, config.train.shuffle_buffer)


def log_epoch(metrics: dict[str, Any], epochs: int, task: Task) -> None:
    log.info(
        "epoch %d/%d: train_loss %.4f %s | %.2fs %.0f samples/s data_wait %.1f%%",
        metrics["epoch"],
        epochs,
        metrics["train_loss"],
        task.part(HEADLINE)(metrics),
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
    run_stats: dict[str, Any] | None = None,
) -> None:
    """Every rank calls report (it is a barrier); rank 0 alone attaches the checkpoint, except
    under FSDP and pipelines, where every rank attaches its shards and Ray Train merges the
    folders.

    The upload mode is `train.checkpoint_upload`; either way Ray deletes the local folder once
    the checkpoint is persisted under `train.storage_path`. A sharded run's consolidated
    `model.safetensors` is written as its shards are gathered (`sharded_checkpoint`);
    `run_stats` are extra `meta.json` fields.
    """
    import ray.train

    folder, weights = None, state.model
    if parallel.is_sharded(state.model):
        folder, weights = sharded_checkpoint(state, rank), None
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


def sharded_checkpoint(state: TrainState, rank: int) -> str:
    """Collective (FSDP, pipeline): every rank writes its shards into a local folder of its
    own; rank 0 also writes the consolidated `model.safetensors`, one tensor at a time."""
    folder = tempfile.mkdtemp(prefix="raytorch-ckpt-")
    checkpoint.save_sharded(folder, state.model, state.optimizer, rank)
    path = os.path.join(folder, checkpoint.WEIGHTS) if rank == 0 else None
    consolidate.write_consolidated(path, state.model)
    return folder


class TrainMetrics:
    """Ray custom metrics (dashboard / Prometheus) of rank 0: every metric the run's epoch
    reports, named after it (`raytorch_<metric>`), the task's own validation metrics included."""

    def __init__(self, run_dir: str, task: Task):
        from ray.util.metrics import Gauge

        self.tags = {"run": os.path.basename(run_dir.rstrip("/"))}
        names = ["train_loss", "samples_per_second", "data_wait_fraction", *task.metrics]
        self.gauges = {
            n: Gauge(
                f"raytorch_{n}", description=f"training {n.replace('_', ' ')}", tag_keys=("run",)
            )
            for n in dict.fromkeys(names)
        }

    def record(self, metrics: dict[str, float]) -> None:
        for name, gauge in self.gauges.items():
            if name in metrics:
                gauge.set(float(metrics[name]), tags=self.tags)
