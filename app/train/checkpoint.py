"""Resumable checkpoints: a folder of `model.safetensors`, `train_state.pt` and `meta.json`.

FSDP runs add a `sharded/` folder (torch.distributed.checkpoint, below) and keep the rest.
`train_state.pt` holds only tensors and plain containers (optimizer, schedule position, scaler, step, RNG
state) and is loaded with `weights_only=True`; weights are safetensors; nothing is unpickled.
This is the training-time format; the final, serving format is the artifact (app/export/exporter.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field
from safetensors.torch import load_model, save_model
from torch import nn

from app import storage
from app.config import Config, validate
from app.data import kinds
from app.errors import CheckpointError

WEIGHTS, STATE, META = "model.safetensors", "train_state.pt", "meta.json"


class CheckpointMeta(storage.Contract):
    """`meta.json`: what a checkpoint was trained with and how far its run got.

    Written by rank 0 each epoch (app/train/worker.py `report`); read to resume (app/train/loop.py), to
    summarize a run (app/train/driver.py), and to evaluate and export (`LoadedCheckpoint`).
    """

    error = CheckpointError
    config: dict[str, Any]  # the run's full config, as app.config.dump wrote it
    epoch: int = Field(ge=0)
    step: int = Field(ge=0)
    # The epoch's report (losses, accuracy, timings); ints stay ints (epoch, step): pydantic
    # keeps an exact type match of a union member.
    metrics: dict[str, float | int]
    preprocessor: str  # the fitted preprocessor's JSON
    resume_history: list[int] = []  # the epoch each restart began at
    data_wait_history: list[float] = []  # per epoch, the slowest rank's data-wait fraction
    epoch_seconds_history: list[float] = []  # per epoch, the slowest rank's loop time
    first_step_at: float | None = None  # wall clock of the run's first optimizer step
    worker_nodes: list[str] = []  # the Ray node of each rank
    # Each size the worker group trained at: {"at", "workers", "from_epoch", "reason"}
    # (app/train/elastic.py:record_size).
    num_workers_history: list[dict[str, Any]] = []
    torch_version: str | None = None
    # Every epoch's report so far, in order (training curves, TensorBoard checks, early stopping
    # after a resume).
    history: list[dict[str, float | int]] = []
    stopped_early: bool = False  # this epoch's report ended the run (train.early_stopping_*)
    mlflow_run_id: str | None = None  # the MLflow run the train job logged to, if any
    # The largest rank's parameter / gradient / optimizer-state bytes ("total": their sum), as
    # app/train/parallel.py:MemoryMeter measured them after the first optimizer step of the attempt.
    memory_per_rank: dict[str, int] = {}
    # This attempt's first optimizer step (includes torch.compile) and its steady step time
    # (the median of the first epoch's later steps), in seconds.
    first_step_seconds: float | None = None
    step_seconds: float | None = None


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def save(
    folder: str,
    model: nn.Module | None,
    train_state: dict[str, Any],
    meta: CheckpointMeta | dict[str, Any],
) -> None:
    """Write a checkpoint folder (`model` None: its `model.safetensors` is written already, as
    a sharded run's is). `meta` as a dict (tools) is checked against the contract first, so a
    checkpoint that could not be read back is never written."""
    path = os.path.join(folder, META)
    if not isinstance(meta, CheckpointMeta):
        meta = CheckpointMeta.parse(meta, path)
    os.makedirs(folder, exist_ok=True)
    if model is not None:
        save_model(unwrap(model), os.path.join(folder, WEIGHTS))
    torch.save(train_state, os.path.join(folder, STATE))
    with open(path, "w") as f:
        json.dump(meta.to_json_dict(), f, indent=2, sort_keys=True)


@contextlib.contextmanager
def reading(folder: str, name: str, origin: str | None = None) -> Iterator[str]:
    """Yield the path of one checkpoint file; any failure to read it becomes a CheckpointError
    naming it (under `origin`, the checkpoint's URI, when `folder` is a local copy of it)."""
    path = os.path.join(folder, name)
    shown = storage.join(origin or folder, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"{shown}: missing; not a complete checkpoint")
    try:
        yield path
    except CheckpointError:
        raise  # already one line naming the file
    except Exception as e:  # noqa: BLE001 - safetensors, torch and json raise many kinds
        lines = str(e).strip().splitlines() or [type(e).__name__]
        detail = f"no {lines[0]} key" if isinstance(e, KeyError) else lines[0]
        raise CheckpointError(f"{shown}: unreadable ({detail})") from e


def load_weights(folder: str, model: nn.Module, origin: str | None = None) -> None:
    with reading(folder, WEIGHTS, origin) as path:
        load_model(unwrap(model), path, device=str(next(model.parameters()).device))


def load_train_state(folder: str, origin: str | None = None) -> dict[str, Any]:
    # weights_only: tensors and plain containers only; anything else is refused, never run.
    with reading(folder, STATE, origin) as path:
        return torch.load(path, map_location="cpu", weights_only=True)


def read_meta(folder: str, origin: str | None = None) -> CheckpointMeta:
    with reading(folder, META, origin) as path:
        raw = Path(path).read_bytes()
    return CheckpointMeta.parse_json(raw, storage.join(origin or folder, META))


# --- RNG state as tensors and plain tuples, so that weights_only loading accepts it -------------


def rng_state() -> dict[str, Any]:
    np_state: tuple[Any, ...] = np.random.get_state()  # type: ignore[assignment]
    return {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# --- sharded (FSDP) checkpoints ------------------------------------------------------------------
# Every rank writes its own shards of the model and the optimizer with torch.distributed.checkpoint
# into `sharded/` of its local checkpoint folder (Ray Train merges the ranks' folders into one), and
# its RNG state as `sharded/rng-rank<k>.pt`. Rank 0 also writes the usual consolidated
# `model.safetensors`, `train_state.pt` (without the optimizer) and `meta.json`, so evaluate and
# export read a sharded checkpoint exactly like a DDP one. Every tensor is keyed by the
# parameter's name in the unsplit model (the optimizer's state too, flattened), so loading
# reshards: a run may resume on another number of ranks, or a pipeline at another stage count.
SHARDED = "sharded"


def is_sharded(folder: str) -> bool:
    return os.path.isdir(os.path.join(folder, SHARDED))


def _by_name() -> Any:
    """Optimizer state keyed by parameter name (`state.<name>.exp_avg`), not by position."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_sharded(
    folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> None:
    """Collective: every rank calls it with its own (local) `folder`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = os.path.join(folder, SHARDED)
    model_state, optim_state = get_state_dict(model, optimizer, options=_by_name())
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    torch.save(rng_state(), os.path.join(path, f"rng-rank{rank}.pt"))


def load_sharded(
    folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> dict[str, Any] | None:
    """Collective: restore this rank's shards of model and optimizer from `folder/sharded`.
    Returns this rank's saved RNG state (None when the saving run had fewer ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(folder, SHARDED)
    options = _by_name()
    model_state, optim_state = get_state_dict(model, optimizer, options=options)  # to read into
    try:  # in place, into the tensors of the two state dicts
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    except Exception as e:  # noqa: BLE001 - DCP wraps each rank's failure in its own kind
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise CheckpointError(f"{path}: unreadable sharded checkpoint ({lines[0]})") from e
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=options,
    )
    rng = os.path.join(path, f"rng-rank{rank}.pt")
    return torch.load(rng, weights_only=True) if os.path.isfile(rng) else None


# --- loading a finished checkpoint for evaluation and export -----------------------------------


class LoadedCheckpoint:
    """A checkpoint ready for evaluation and export: every file is read (and so checked) here,
    the train state too, so a damaged checkpoint fails with one line before any work."""

    def __init__(self, folder: str, origin: str | None = None):
        self.meta = read_meta(folder, origin)
        with reading(folder, META, origin):  # a bad config or preprocessor: the file's fault
            self.config: Config = validate(self.meta.config)
            self.preprocessor = kinds.from_json(self.meta.preprocessor)
        load_train_state(folder, origin)  # not needed to export, but a truncated one is damage
        from app.models import build_model
        from app.models.lora import merge_lora
        from app.train.finetune import adapt

        self.model = adapt(build_model(self.config.model, self.preprocessor), self.config.train)
        load_weights(folder, self.model, origin)
        merge_lora(self.model)  # LoRA adapters folded in: evaluate and export see plain layers
        self.model.eval()


def load_checkpoint(uri: str) -> LoadedCheckpoint:
    if not storage.exists(storage.join(uri, META)):
        raise CheckpointError(f"{storage.join(uri, META)}: missing; {uri} is not a checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        return LoadedCheckpoint(storage.download_dir(uri, tmp), origin=uri)
