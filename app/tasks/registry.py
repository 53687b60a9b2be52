"""The task registry: what a run learns, and every stage's part for it, in one object per task.

A prepared dataset's kind picks the task (`task_for_dataset`), an artifact's schema names it
(`task_of_schema`). Training, evaluation, export, the pipeline and serving ask the task for
their part instead of comparing names. Every part is named as "module:attribute" and imported
when first used: the registry itself imports only config and errors, so no stage imports
upward through it.

A new task is one `register(Task(...))`, from anywhere (tests register a toy one).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.config import Config
from app.errors import ConfigError

if TYPE_CHECKING:
    from app.data.prepare import DatasetManifest
    from app.data.preprocess import Preprocessor

# Reported by every task's training epoch (app/train/loop.py train_epoch) besides its own metrics.
TRAIN_METRICS = ("train_loss", "samples_per_second", "epoch_seconds", "learning_rate")


@dataclass(frozen=True)
class Task:
    """What differs between tasks; everything else (feeds, DDP/FSDP, checkpoints) is shared.

    Each part is named "module:attribute" and imported on first use (`part`), so looking a task
    up imports nothing: a serving process never pays for torch. Parts and their signatures:
      loss(model, batch, device) -> (mean loss, rows)
      validate(model, batches, device, precision, reference) -> metrics summed over ranks
      headline(metrics) -> the task's part of the epoch log line
      reference(config, manifest, preprocessor) -> metrics the driver computes once, reported
        with every epoch
      evaluate(config, checkpoint_uri, loaded_checkpoint, split) -> summary
      export(config, loaded_checkpoint, checkpoint_uri) -> summary (publishes the artifact)
      server: the Serve deployment class of one model's application
      smoke(config, url, model, headers) -> summary of one real request (jobs.pipeline)
      prepare(rows, splits, model_config) -> (rows, splits, extra files), for `source_kinds`
      preprocessor(config, manifest) -> Preprocessor, when the dataset carries its own
    """

    name: str
    dataset_kinds: tuple[str, ...]  # prepared datasets this task trains on
    metrics: tuple[str, ...]  # what `validate` reports
    loss: str
    validate: str
    headline: str
    evaluate: str
    export: str
    server: str
    smoke: str
    reference: str | None = None
    source_kinds: tuple[str, ...] = ()  # raw sources this task prepares itself
    prepare: str | None = None
    preprocessor: str | None = None  # None: a preprocessor fitted on the train split
    generates: bool = False  # answers /v1/completions streams instead of v2 inference

    def part(self, name: str) -> Any:
        """The function or class named by field `name`, imported on first use."""
        return _resolve(getattr(self, name))

    def validator(self, reference: dict[str, float] | None) -> Callable[..., dict[str, float]]:
        return functools.partial(self.part("validate"), reference=reference)

    def reference_metrics(
        self, config: Config, manifest: DatasetManifest, preprocessor: Preprocessor
    ) -> dict[str, float]:
        return self.part("reference")(config, manifest, preprocessor) if self.reference else {}


BUILTIN = (
    Task(
        name="classify",
        dataset_kinds=("image", "tabular", "text"),
        metrics=("val_loss", "val_accuracy"),
        loss="app.tasks.classify:classification_loss",
        validate="app.tasks.classify:validate_classifier",
        headline="app.tasks.classify:headline",
        evaluate="app.evaluate:evaluate_classifier",
        export="app.export.exporter:export_classifier",
        server="app.serve.replicas.apps:ModelApp",
        smoke="app.pipeline:sample_infer",
    ),
    Task(
        name="lm",
        dataset_kinds=("tokens",),
        metrics=("val_loss", "val_perplexity", "val_token_accuracy", "baseline_perplexity"),
        loss="app.tasks.lm:next_token_loss",
        validate="app.tasks.lm:validate_lm",
        headline="app.tasks.lm:headline",
        reference="app.tasks.lm:reference_metrics",
        evaluate="app.evaluate:evaluate_language_model",
        export="app.export.lm:export_lm",
        server="app.serve.replicas.apps:LMApp",
        smoke="app.pipeline:sample_completion",
        source_kinds=("documents",),
        prepare="app.data.corpus:tokenize_corpus",
        preprocessor="app.data.corpus:dataset_preprocessor",
        generates=True,
    ),
)
_TASKS: dict[str, Task] = {task.name: task for task in BUILTIN}
DEFAULT = "classify"  # artifacts whose schema names no task are classifiers


def register(task: Task) -> Task:
    _TASKS[task.name] = task
    return task


def task_named(name: str) -> Task:
    """A registered task, or the `Task` object at "pkg.module:NAME" (registered on first use,
    so a task from outside app/ is found in every process that can import its module)."""
    if name in _TASKS:
        return _TASKS[name]
    if ":" in name:
        task = _import_task(name)
        return _TASKS.setdefault(name, task)
    raise ConfigError(
        f"config error: train.task: unknown task {name!r} (known: {', '.join(sorted(_TASKS))}, "
        "or 'pkg.module:TASK')"
    )


def run_task(name: str | None, dataset_kind: str) -> Task:
    """The task of a run: `train.task` when set (it must train on this dataset), else the one the
    dataset's kind calls for."""
    if name is None:
        return task_for_dataset(dataset_kind)
    task = task_named(name)
    if dataset_kind not in task.dataset_kinds:
        raise ConfigError(
            f"config error: train.task: task {name!r} trains on {', '.join(task.dataset_kinds)} "
            f"datasets, but this one is {dataset_kind}"
        )
    return task


def _import_task(path: str) -> Task:
    try:
        task = _resolve(path)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"config error: train.task: cannot load {path!r} ({e})") from None
    if not isinstance(task, Task):
        raise ConfigError(f"config error: train.task: {path!r} is not a Task")
    # Stored under the path that found it, so checkpoints and artifacts name it the same way.
    return dataclasses.replace(task, name=path)


def task_for_dataset(kind: str) -> Task:
    """The task that trains on a prepared dataset of this kind."""
    for task in _TASKS.values():
        if kind in task.dataset_kinds:
            return task
    raise ConfigError(f"no task trains on datasets of kind {kind!r}")


def task_for_source(kind: str) -> Task | None:
    """The task that prepares raw rows of this kind itself, if any (else rows are kept as is)."""
    return next((t for t in _TASKS.values() if kind in t.source_kinds), None)


def task_of_schema(schema: dict[str, Any]) -> Task:
    """The task an artifact's schema.json names."""
    return task_named(str(schema.get("task", DEFAULT)))


def check_metric(config: Config, task: Task) -> None:
    """The checkpoint ranking metric must be one the task reports (before any worker starts)."""
    known = (*task.metrics, *TRAIN_METRICS)
    t = config.train
    keys = {"train.checkpoint_metric": t.checkpoint_metric}
    if t.early_stopping_patience is not None:
        keys["train.early_stopping_metric"] = t.early_stopping_metric
    for key, metric in keys.items():
        if metric not in known:
            raise ConfigError(
                f"config error: {key}: {metric!r} is not reported by task "
                f"{task.name!r} (reports: {', '.join(known)})"
            )


@functools.cache
def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
