"""The task registry: what a run learns, as one spec of real functions per task.

Each stage declares the part it calls as a typed `Part`, beside the Protocol the part follows
(`LOSS = Part[Loss]("loss")` in app/train/parts.py, `EXPORT` in app/export/exporter.py, ...),
and asks a task for it: `task.part(EXPORT)(config, loaded, uri)`. A task is a `Task` holding
its parts; the built-in ones are composed in app/tasks/<task>/task.py (the top layer, which imports every
stage), where mypy checks each function against its part's Protocol (`EXPORT.of(fn)`).

A prepared dataset's kind picks the task (`task_for_dataset`), an artifact's schema names it
(`task_of_schema`). The registry loads the composition root the first time a task is looked up,
so every process (a job, Serve building an application, a Tune trial) finds the built-ins; a
user's own task is `train.task: "pkg.module:TASK"`, a `Task` object imported by that name.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from app.config import Config
from app.errors import ConfigError

# Reported by every task's training epoch (app/train/loop.py train_epoch) besides its own metrics.
TRAIN_METRICS = ("train_loss", "samples_per_second", "epoch_seconds", "learning_rate")
COMPOSITION_ROOT = "app.tasks.builtin"  # registers the built-in tasks (its `register`)
DEFAULT = "classify"  # artifacts whose schema names no task are classifiers

P = TypeVar("P")


@dataclass(frozen=True)
class Part(Generic[P]):
    """A part of a task that a stage calls, typed by the Protocol it follows."""

    name: str

    def of(self, impl: P) -> tuple[str, P]:
        """`impl` as this part (type-checked against the Protocol)."""
        return self.name, impl


@dataclass(frozen=True)
class Task:
    """What differs between tasks; everything else (feeds, DDP/FSDP, checkpoints) is shared."""

    name: str
    dataset_kinds: tuple[str, ...]  # prepared datasets this task trains on
    metrics: tuple[str, ...]  # what its validation reports
    parts: Mapping[str, Any]  # part name -> the function or class (see `Part`)
    generates: bool = False  # answers /v1/completions streams instead of v2 inference
    checkpoint: tuple[str, str] = ("val_accuracy", "max")  # ranks checkpoints by default

    def part(self, key: Part[P]) -> P:
        if key.name not in self.parts:
            raise ConfigError(f"config error: task {self.name!r} has no {key.name} part")
        return cast(P, self.parts[key.name])

    def has(self, key: Part[Any]) -> bool:
        return key.name in self.parts

    def only(self, *keys: Part[Any]) -> Task:
        """This task with only the parts `keys` name (those it has): a process this task is
        pickled to imports what those parts need and nothing more."""
        names = {key.name for key in keys}
        return dataclasses.replace(
            self, parts={name: part for name, part in self.parts.items() if name in names}
        )


_TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    _TASKS[task.name] = task
    return task


def _tasks() -> dict[str, Task]:
    if not _TASKS:
        importlib.import_module(COMPOSITION_ROOT).register()
    return _TASKS


def looked_up() -> list[Task]:
    """The tasks this process has loaded so far, without loading the built-ins (which import
    every stage): a task from outside app/ is here once something looked it up."""
    return list(_TASKS.values())


def builtin_routers() -> list[Any]:
    """The built-in tasks' HTTP routers, imported alone (no task spec, no stage)."""
    return list(importlib.import_module(COMPOSITION_ROOT).routers())


def task_named(name: str) -> Task:
    """A registered task, or the `Task` object at "pkg.module:NAME" (registered on first use,
    so a task from outside app/ is found in every process that can import its module)."""
    tasks = _tasks()
    if name in tasks:
        return tasks[name]
    if ":" in name:
        return tasks.setdefault(name, _import_task(name))
    raise ConfigError(
        f"config error: train.task: unknown task {name!r} (known: {', '.join(sorted(tasks))}, "
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
    module, _, attr = path.partition(":")
    try:
        task = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"config error: train.task: cannot load {path!r} ({e})") from None
    if not isinstance(task, Task):
        raise ConfigError(f"config error: train.task: {path!r} is not a Task")
    # Stored under the path that found it, so checkpoints and artifacts name it the same way.
    return dataclasses.replace(task, name=path)


def task_for_dataset(kind: str) -> Task:
    """The task that trains on a prepared dataset of this kind."""
    for task in _tasks().values():
        if kind in task.dataset_kinds:
            return task
    raise ConfigError(f"no task trains on datasets of kind {kind!r}")


def task_of_schema(schema: dict[str, Any]) -> Task:
    """The task an artifact's schema.json names."""
    return task_named(str(schema.get("task", DEFAULT)))


def check_metric(config: Config, task: Task) -> None:
    """The checkpoint ranking metric must be one the task reports (before any worker starts);
    left unset, it is the task's own (set on `config`)."""
    known = (*task.metrics, *TRAIN_METRICS)
    t = config.train
    if t.checkpoint_metric is None:
        t.checkpoint_metric, mode = task.checkpoint
        t.checkpoint_mode = t.checkpoint_mode or mode  # type: ignore[assignment]
    elif t.checkpoint_mode is None:
        lower = any(word in t.checkpoint_metric for word in ("loss", "perplexity"))
        t.checkpoint_mode = "min" if lower else "max"
    keys = {"train.checkpoint_metric": t.checkpoint_metric}
    if t.early_stopping_patience is not None:
        keys["train.early_stopping_metric"] = t.early_stopping_metric
    for key, metric in keys.items():
        if metric not in known:
            raise ConfigError(
                f"config error: {key}: {metric!r} is not reported by task "
                f"{task.name!r} (reports: {', '.join(known)})"
            )
