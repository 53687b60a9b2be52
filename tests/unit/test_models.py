"""app/models: forward shapes, the registry, bring-your-own callables, family vs data kind."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn

import app.train.driver
from app.config import ModelConfig
from app.data import kinds
from app.data.preprocess import FitOptions, Preprocessor
from app.errors import ConfigError
from app.models import REGISTRY, build_model, is_conv_net, resolve
from app.models.cnn import ResNetCNN
from app.models.mlp import MLP
from app.models.transformer import TransformerClassifier
from tests.unit.unit_helpers import REPO

pytestmark = pytest.mark.unit

LABELS = ["a", "b", "c"]


def image_pre(shape=(1, 8, 8)) -> Preprocessor:
    return kinds.from_state(
        {
            "kind": "image",
            "feature_columns": ["image"],
            "label_column": "label",
            "labels": LABELS,
            "image_shape": list(shape),
            "mean": 0.0,
            "std": 1.0,
        }
    )


def tabular_pre(features: int = 5) -> Preprocessor:
    cols = [f"f{i}" for i in range(features)]
    return kinds.from_state(
        {
            "kind": "tabular",
            "feature_columns": cols,
            "label_column": "label",
            "labels": LABELS,
            "mean": [0.0] * features,
            "std": [1.0] * features,
        }
    )


def text_pre(max_length: int = 12) -> Preprocessor:
    frame = pd.DataFrame(
        {"text": ["one two three", "four five six seven", "two four six"], "label": LABELS}
    )
    manifest = {"kind": "text", "feature_columns": ["text"], "label_column": "label"}
    return kinds.fit(iter([frame]), manifest, FitOptions(max_length=max_length, vocab_size=64))


def model_cfg(**kwargs) -> ModelConfig:
    return ModelConfig(**kwargs)


# --- forward shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 16, 16), (1, 5, 7)])
def test_cnn_forward_shape(shape):
    torch.manual_seed(0)
    model = build_model(model_cfg(name="cnn", channels=[4, 8]), image_pre(shape)).eval()
    assert isinstance(model, ResNetCNN)
    logits = model(x=torch.randn(4, *shape))
    assert logits.shape == (4, len(LABELS))
    assert torch.isfinite(logits).all()


def test_mlp_forward_shape():
    model = build_model(model_cfg(name="mlp", hidden=[16, 8]), tabular_pre(5)).eval()
    assert isinstance(model, MLP)
    assert model(x=torch.randn(6, 5)).shape == (6, len(LABELS))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(5, 16), (16, 8), (8, 3)]


def test_transformer_forward_shape_and_padding_is_ignored():
    torch.manual_seed(0)
    pre = text_pre(max_length=12)
    cfg = model_cfg(
        name="transformer", dim=16, heads=2, layers=2, ff_dim=32, max_length=12, dropout=0.0
    )
    model = build_model(cfg, pre).eval()
    assert isinstance(model, TransformerClassifier)
    inputs = {
        k: torch.from_numpy(v) for k, v in pre.features(["one two", "three four five six"]).items()
    }
    logits = model(**inputs)
    assert logits.shape == (2, len(LABELS))
    # Whatever sits at padded positions must not change the answer.
    ids = inputs["input_ids"].clone()
    ids[inputs["attention_mask"] == 0] = 5
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=inputs["attention_mask"]), logits
    )


def test_transformer_batch_rows_are_independent():
    torch.manual_seed(0)
    pre = text_pre()
    model = build_model(
        model_cfg(name="transformer", dim=16, heads=2, ff_dim=32, dropout=0.0), pre
    ).eval()
    batch = {k: torch.from_numpy(v) for k, v in pre.features(["one two", "four five six"]).items()}
    single = {k: v[:1] for k, v in batch.items()}
    torch.testing.assert_close(model(**batch)[:1], model(**single))


# --- registry and custom models -----------------------------------------------------------------


def test_registry_by_name():
    assert set(REGISTRY) >= {"cnn", "mlp", "transformer"}
    for name, builder in REGISTRY.items():
        assert resolve(name) is builder
    assert is_conv_net(build_model(model_cfg(name="cnn", channels=[4]), image_pre()))
    assert not is_conv_net(build_model(model_cfg(name="mlp"), tabular_pre()))


@pytest.mark.parametrize(
    "name", ["resnet9000", "no_such_module_xyz:build", "tests.unit.test_models:nope"]
)
def test_unknown_model_is_refused_naming_model_name(monkeypatch, name):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(ValueError, match="model.name") as info:
        resolve(name)
    assert name in str(info.value)


class Custom(nn.Module):
    def __init__(self, in_features: int, classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 0 + 42.0


def build(cfg: ModelConfig, pre: Preprocessor) -> nn.Module:
    """A bring-your-own builder: `model.name: "tests.unit.test_models:build"`."""
    assert isinstance(cfg, ModelConfig) and isinstance(pre, Preprocessor)
    return Custom(pre.num_features, len(pre.labels))


def test_custom_callable_model(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    model = build_model(model_cfg(name="tests.unit.test_models:build"), tabular_pre(4))
    assert type(model).__name__ == "Custom"
    out = model(x=torch.zeros(2, 4))
    assert out.shape == (2, 3)
    assert (out == 42.0).all()


# --- family vs data kind ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "pre"),
    [("cnn", tabular_pre), ("mlp", text_pre), ("transformer", image_pre), ("mlp", image_pre)],
)
def test_family_vs_data_kind_mismatch_is_refused(name, pre):
    p = pre()
    with pytest.raises(ValueError, match="model.name") as info:
        build_model(model_cfg(name=name), p)
    assert p.kind in str(info.value)


def test_mismatch_is_a_config_error_before_ray_starts(config_factory, monkeypatch):
    # A bad model/data pairing is a bad config value: exit 2 before any Ray work (the design
    # brief: "an unknown key or a bad value is a one-line error naming the key, exit code 2,
    # before any work starts"). Today it surfaces as a ValueError inside a Ray Train worker.
    from app.pipeline.stages import prepare
    from app.train.driver import train

    config = config_factory("data.source=wine", "model.name=cnn", "train.run_name=mismatch")
    prepare(config)

    def no_ray(*args, **kwargs):
        raise AssertionError("train() connected to Ray before checking the model against the data")

    monkeypatch.setattr(app.train.driver, "connect_ray", no_ray)
    with pytest.raises(ConfigError, match="model.name"):
        train(config)
