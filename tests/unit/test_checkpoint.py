"""app/train/checkpoint.py: weights round trip, weights_only train state, RNG restore, loading for export."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_model

from app.config import dump, load_config
from app.data import kinds
from app.data.preprocess import Preprocessor
from app.errors import UserError
from app.models import build_model
from app.train import checkpoint
from app.train.loop import TrainState

pytestmark = pytest.mark.unit

LABELS = ["x", "y", "z"]


def tabular_pre() -> Preprocessor:
    return kinds.from_state(
        {
            "kind": "tabular",
            "feature_columns": ["a", "b", "c", "d"],
            "label_column": "label",
            "labels": LABELS,
            "mean": [0.0] * 4,
            "std": [1.0] * 4,
        }
    )


@pytest.fixture
def config():
    return load_config(
        None,
        [
            "model.name=mlp",
            "model.hidden=[8]",
            "model.dropout=0.5",
            "data.source=wine",
            "train.lr=0.01",
        ],
    )


def make_state(config, seed: int) -> TrainState:
    torch.manual_seed(seed)
    return TrainState.create(build_model(config.model, tabular_pre()), config, 20 * 8, world=1)


def take_steps(state: TrainState, steps: int) -> None:
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        loss = F.cross_entropy(state.model(x=x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.advance()
        state.optimizer.step()
    state.epoch = 1


def meta_for(config, state: TrainState) -> checkpoint.CheckpointMeta:
    return checkpoint.CheckpointMeta(
        config=dump(config),
        epoch=state.epoch,
        step=state.step,
        metrics={"val_accuracy": 0.5, "epoch": state.epoch},
        resume_history=state.resume_history,
        preprocessor=tabular_pre().to_json(),
    )


def test_weights_round_trip(tmp_path, config):
    state = make_state(config, seed=0)
    take_steps(state, 3)
    folder = str(tmp_path / "ckpt")
    checkpoint.save(folder, state.model, state.train_state(), meta_for(config, state))
    assert sorted(os.listdir(folder)) == sorted(
        [checkpoint.WEIGHTS, checkpoint.STATE, checkpoint.META]
    )

    fresh = make_state(config, seed=99).model
    original = state.model.state_dict()
    assert not all(torch.equal(fresh.state_dict()[k], v) for k, v in original.items())
    checkpoint.load_weights(folder, fresh)
    for key, value in original.items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)


def test_ddp_wrapper_is_unwrapped():
    model = torch.nn.Linear(2, 2)

    class FakeDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module):  # no process group needed to test unwrap
            torch.nn.Module.__init__(self)
            self.module = module

    assert checkpoint.unwrap(FakeDDP(model)) is model
    assert checkpoint.unwrap(model) is model


def test_train_state_loads_with_weights_only_and_resumes(tmp_path, config):
    state = make_state(config, seed=0)
    take_steps(state, 4)
    folder = str(tmp_path / "ckpt")
    checkpoint.save(folder, state.model, state.train_state(), meta_for(config, state))
    # The uninterrupted run goes on right away (dropout draws from the global RNG)...
    expected_lr = state.optimizer.param_groups[0]["lr"]
    expected_opt = [{k: v.clone() for k, v in s.items()} for s in state.optimizer.state.values()]
    take_steps(state, 2)

    # ...and the file loads with torch's safe loader.
    raw = torch.load(os.path.join(folder, checkpoint.STATE), weights_only=True)
    assert raw["step"] == 4
    loaded = checkpoint.load_train_state(folder)
    assert set(loaded) == {"optimizer", "rows", "scaler", "step", "rng"}

    resumed = make_state(config, seed=99)
    resumed.restore(folder)
    assert (resumed.epoch, resumed.step) == (1, 4)
    assert resumed.resume_history == [2]  # resumed at the start of epoch 2
    assert resumed.rows == state.rows - 2 * state.config.train.batch_size
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)
    for a, b in zip(expected_opt, resumed.optimizer.state.values(), strict=True):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"])
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"])
    # Continuing from the checkpoint (weights, optimizer, schedule, RNG for dropout) gives
    # exactly what the uninterrupted run got.
    take_steps(resumed, 2)
    for key, value in state.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value)


def test_train_state_with_arbitrary_objects_is_refused(tmp_path, config):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    folder = str(tmp_path / "ckpt")
    state = make_state(config, seed=0)
    checkpoint.save(folder, state.model, {"step": 1, "payload": Evil()}, meta_for(config, state))
    with pytest.raises(checkpoint.CheckpointError, match=checkpoint.STATE) as info:
        checkpoint.load_train_state(folder)
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)  # refused by weights_only
    assert "\n" not in str(info.value)


def draw() -> tuple:
    np.random.standard_normal()  # leaves a cached gaussian in the legacy numpy state
    return (
        torch.rand(5).tolist(),
        np.random.rand(5).tolist(),
        np.random.standard_normal(),
        [random.random() for _ in range(5)],
    )


def test_rng_state_restore_reproduces_numbers(tmp_path):
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.standard_normal()  # odd number of gaussians: has_gauss = 1 in the saved state
    saved = checkpoint.rng_state()
    path = tmp_path / "rng.pt"
    torch.save({"rng": saved}, path)
    first = draw()
    draw()  # move on
    checkpoint.set_rng_state(torch.load(path, weights_only=True)["rng"])
    assert draw() == first


def test_meta_round_trip_and_loaded_checkpoint(tmp_path, config):
    state = make_state(config, seed=0)
    take_steps(state, 2)
    folder = str(tmp_path / "ckpt")
    meta = meta_for(config, state)
    checkpoint.save(folder, state.model, state.train_state(), meta)
    assert checkpoint.read_meta(folder) == meta
    on_disk = json.loads((Path(folder) / checkpoint.META).read_text())
    # The keys tools read stay as they were; ints stay ints.
    assert set(on_disk) >= {"config", "epoch", "step", "metrics", "preprocessor", "resume_history"}
    assert on_disk["metrics"] == {"val_accuracy": 0.5, "epoch": 1}

    loaded = checkpoint.load_checkpoint(folder)
    assert loaded.config == config
    assert loaded.preprocessor.to_json() == tabular_pre().to_json()
    assert not loaded.model.training
    x = torch.randn(3, 4)
    state.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x=x), state.model(x=x))


def test_save_checks_a_plain_dict_meta_before_writing(tmp_path, config):
    state = make_state(config, seed=0)
    meta = meta_for(config, state).to_json_dict()
    folder = tmp_path / "ckpt"
    checkpoint.save(str(folder), state.model, state.train_state(), meta)  # tools pass a dict
    assert checkpoint.read_meta(str(folder)).epoch == state.epoch
    del meta["step"]
    with pytest.raises(checkpoint.CheckpointError, match=r"meta\.json: step: Field required"):
        checkpoint.save(str(tmp_path / "other"), state.model, state.train_state(), meta)
    assert not (tmp_path / "other").exists()


def test_load_checkpoint_refuses_a_folder_without_meta(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a checkpoint"):
        checkpoint.load_checkpoint(str(tmp_path / "empty"))


# --- damaged checkpoints: refused by load_checkpoint with one line naming the file -------------


def saved(tmp_path, config) -> str:
    state = make_state(config, seed=0)
    folder = str(tmp_path / "ckpt")
    checkpoint.save(folder, state.model, state.train_state(), meta_for(config, state))
    return folder


def scramble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:16] = b"\xff" * 16  # safetensors: an 8-byte header length, then the JSON header
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def not_json(path: Path) -> None:
    path.write_text("{not json")


def without_config(path: Path) -> None:
    meta = json.loads(path.read_text())
    del meta["config"]
    path.write_text(json.dumps(meta))


def epoch_as_text(path: Path) -> None:
    meta = json.loads(path.read_text())
    meta["epoch"] = "three"
    path.write_text(json.dumps(meta))


def not_an_object(path: Path) -> None:
    path.write_text("[1, 2]")


def remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        (checkpoint.WEIGHTS, scramble_header),
        (checkpoint.WEIGHTS, truncate),
        (checkpoint.WEIGHTS, remove),
        (checkpoint.STATE, truncate),
        (checkpoint.STATE, remove),
        (checkpoint.META, remove),
        (checkpoint.META, not_json),
        (checkpoint.META, without_config),
        (checkpoint.META, epoch_as_text),
        (checkpoint.META, not_an_object),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, config, name, damage):
    folder = saved(tmp_path, config)
    damage(Path(folder) / name)
    with pytest.raises(UserError) as info:
        checkpoint.load_checkpoint(folder)
    message = str(info.value)
    assert message.startswith(f"{folder}/{name}: "), message
    assert "\n" not in message


def test_weights_of_another_model_are_refused_naming_the_file(tmp_path, config):
    folder = saved(tmp_path, config)
    other = config.model_copy(deep=True)
    other.model.hidden = [16, 4]
    save_model(build_model(other.model, tabular_pre()), os.path.join(folder, checkpoint.WEIGHTS))
    with pytest.raises(checkpoint.CheckpointError, match=f"{checkpoint.WEIGHTS}: unreadable") as e:
        checkpoint.load_checkpoint(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("damage", "field"), [(without_config, "config"), (epoch_as_text, "epoch")]
)
def test_meta_of_the_wrong_shape_names_the_file_and_field(tmp_path, config, damage, field):
    folder = saved(tmp_path, config)
    damage(Path(folder) / checkpoint.META)
    for load in (checkpoint.load_checkpoint, make_state(config, seed=0).restore):
        with pytest.raises(checkpoint.CheckpointError) as info:  # never a KeyError
            load(folder)
        message = str(info.value)
        assert message.startswith(f"{folder}/{checkpoint.META}: {field}: "), message
        assert "\n" not in message
