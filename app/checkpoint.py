"""Resumable checkpoints: a folder of `model.safetensors`, `train_state.pt` and `meta.json`.

`train_state.pt` holds only tensors and plain containers (optimizer, scheduler, scaler, step, RNG
state) and is loaded with `weights_only=True`; weights are safetensors; nothing is unpickled.
This is the training-time format; the final, serving format is the artifact (app/export.py).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from app import storage
from app.config import Config, validate
from app.preprocess import Preprocessor

WEIGHTS, STATE, META = "model.safetensors", "train_state.pt", "meta.json"


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def save(folder: str, model: nn.Module, train_state: dict[str, Any], meta: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    save_model(unwrap(model), os.path.join(folder, WEIGHTS))
    torch.save(train_state, os.path.join(folder, STATE))
    with open(os.path.join(folder, META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def load_weights(folder: str, model: nn.Module) -> None:
    load_model(
        unwrap(model), os.path.join(folder, WEIGHTS), device=str(next(model.parameters()).device)
    )


def load_train_state(folder: str) -> dict[str, Any]:
    return torch.load(os.path.join(folder, STATE), map_location="cpu", weights_only=True)


def read_meta(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, META)) as f:
        return json.load(f)


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


# --- loading a finished checkpoint for evaluation and export -----------------------------------


class LoadedCheckpoint:
    def __init__(self, folder: str):
        self.meta = read_meta(folder)
        self.config: Config = validate(self.meta["config"])
        self.preprocessor = Preprocessor.from_json(self.meta["preprocessor"])
        from app.models import build_model

        self.model = build_model(self.config.model, self.preprocessor)
        load_weights(folder, self.model)
        self.model.eval()


def load_checkpoint(uri: str) -> LoadedCheckpoint:
    if not storage.exists(storage.join(uri, META)):
        from app.cli import UserError

        raise UserError(f"{uri}: not a checkpoint (no {META})")
    with tempfile.TemporaryDirectory() as tmp:
        return LoadedCheckpoint(storage.download_dir(uri, tmp))
