"""Model families as plain `torch.nn` modules (no Ray here) and a registry by name.

`build_model(model_cfg, preprocessor)` returns an `nn.Module` whose forward takes the
preprocessor's inputs (`x`, or `input_ids` and `attention_mask`) and returns logits. A user's own
model is `model.name: "pkg.module:callable"`, called the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from app.config import ConfigError, ModelConfig
from app.data.preprocess import Preprocessor
from app.models.cnn import ResNetCNN
from app.models.gpt import GPT
from app.models.mlp import MLP
from app.models.transformer import TransformerClassifier

Builder = Callable[[ModelConfig, Preprocessor], nn.Module]


def _cnn(cfg: ModelConfig, pre: Preprocessor) -> nn.Module:
    channels, _, _ = pre.state["image_shape"]
    return ResNetCNN(channels, len(pre.labels), widths=cfg.channels, dropout=cfg.dropout)


def _mlp(cfg: ModelConfig, pre: Preprocessor) -> nn.Module:
    return MLP(pre.num_features, len(pre.labels), hidden=cfg.hidden, dropout=cfg.dropout)


def _transformer(cfg: ModelConfig, pre: Preprocessor) -> nn.Module:
    return TransformerClassifier(
        vocab_size=pre.vocab_size,
        num_classes=len(pre.labels),
        dim=cfg.dim,
        layers=cfg.layers,
        heads=cfg.heads,
        ff_dim=cfg.ff_dim,
        max_length=cfg.max_length,
        dropout=cfg.dropout,
    )


def _gpt(cfg: ModelConfig, pre: Preprocessor) -> nn.Module:
    # The vocabulary is the dataset's tokenizer's; its sequences must fit the position table.
    block = pre.block_size
    if block > cfg.max_length:
        raise ConfigError(
            f"config error: model.max_length: {cfg.max_length} is shorter than the dataset's "
            f"sequences ({block} tokens); prepare the data again with this model.max_length"
        )
    return GPT(
        vocab_size=pre.vocab_size,
        block_size=cfg.max_length,
        dim=cfg.dim,
        layers=cfg.layers,
        heads=cfg.heads,
        ff_dim=cfg.ff_dim,
        dropout=cfg.dropout,
    )


REGISTRY: dict[str, Builder] = {
    "cnn": _cnn,
    "mlp": _mlp,
    "transformer": _transformer,
    "gpt": _gpt,
}
# Which preprocessor kinds each family accepts, so a mismatch fails before training starts.
ACCEPTS = {"cnn": "image", "mlp": "tabular", "transformer": "text", "gpt": "tokens"}


def resolve(name: str) -> Builder:
    if name in REGISTRY:
        return REGISTRY[name]
    module_name, sep, attr = name.partition(":")
    if not sep:
        raise ConfigError(
            f"config error: model.name: unknown model {name!r} (known: {sorted(REGISTRY)}, or 'pkg.module:callable')"
        )
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config error: model.name: cannot load {name!r} ({e})") from None


def build_model(cfg: ModelConfig, pre: Preprocessor) -> nn.Module:
    expected = ACCEPTS.get(cfg.name)
    if expected and expected != pre.kind:
        raise ConfigError(
            f"config error: model.name: {cfg.name!r} takes {expected} data, but the dataset is {pre.kind}"
        )
    return resolve(cfg.name)(cfg, pre)


def is_conv_net(model: nn.Module) -> bool:
    """Conv nets quantize best statically (QDQ + calibration); Linear-heavy ones dynamically."""
    return any(isinstance(m, nn.Conv2d | nn.Conv1d) for m in model.modules())
