"""Model families as plain `torch.nn` modules (no Ray here) and a registry by name.

`build_model(model_cfg, preprocessor)` returns an `nn.Module` whose forward takes the
preprocessor's inputs (`x`, or `input_ids` and `attention_mask`) and returns logits. A user's own
model is `model.name: "pkg.module:callable"`, called the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from app.config import ConfigError, ModelConfig
from app.data.kinds.image import Image
from app.data.kinds.image_text import ImageText
from app.data.kinds.tabular import Tabular
from app.data.kinds.text import Text
from app.data.kinds.tokens import Tokens
from app.data.preprocess import Preprocessor
from app.models.cnn import ResNetCNN
from app.models.gpt import GPT
from app.models.mlp import MLP
from app.models.transformer import TransformerClassifier
from app.pretrained import Pretrained, Stored, open_pretrained

# Each takes the preprocessor of the kind of data ACCEPTS names for it.
Builder = Callable[[ModelConfig, Any], nn.Module]
FRESH = ("image_proj.", "text_proj.", "logit_scale")  # a dual encoder's own parts


def _cnn(cfg: ModelConfig, pre: Image) -> nn.Module:
    channels, _, _ = pre.shape
    return ResNetCNN(channels, len(pre.labels), widths=cfg.channels, dropout=cfg.dropout)


def _mlp(cfg: ModelConfig, pre: Tabular) -> nn.Module:
    return MLP(pre.num_features, len(pre.labels), hidden=cfg.hidden, dropout=cfg.dropout)


def _transformer(cfg: ModelConfig, pre: Text) -> nn.Module:
    return TransformerClassifier(
        vocab_size=pre.vocab_size,
        num_classes=len(pre.labels),
        dim=cfg.dim,
        layers=cfg.layers,
        heads=cfg.heads,
        ff_dim=cfg.ff_dim,
        max_length=cfg.sequence_length(),
        dropout=cfg.dropout,
    )


def _gpt(cfg: ModelConfig, pre: Tokens) -> nn.Module:
    # The vocabulary is the dataset's tokenizer's; its sequences must fit the position table.
    block = pre.block_size
    if block > cfg.sequence_length():
        raise ConfigError(
            f"config error: model.max_length: {cfg.sequence_length()} is shorter than the dataset's "
            f"sequences ({block} tokens); prepare the data again with this model.max_length"
        )
    return GPT(
        vocab_size=pre.vocab_size,
        block_size=cfg.sequence_length(),
        dim=cfg.dim,
        layers=cfg.layers,
        heads=cfg.heads,
        ff_dim=cfg.ff_dim,
        dropout=cfg.dropout,
    )


def _dual_encoder(cfg: ModelConfig, pre: ImageText) -> nn.Module:
    from app.models.dual_encoder import from_scratch

    return from_scratch(cfg, pre.vocab_size, pre.output_size, int(pre.state["max_length"]))


REGISTRY: dict[str, Builder] = {
    "cnn": _cnn,
    "mlp": _mlp,
    "transformer": _transformer,
    "gpt": _gpt,
    "dual_encoder": _dual_encoder,
}
# The kind of data each family takes, so a mismatch fails before training starts. Without
# `model.name`, the first family that takes the dataset's kind is built.
ACCEPTS: dict[str, type[Preprocessor]] = {
    "cnn": Image,
    "mlp": Tabular,
    "transformer": Text,
    "gpt": Tokens,
    "dual_encoder": ImageText,
}


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
    """The model for this data, with fresh weights. A run on a pretrained folder builds the
    folder's architecture (kept in the preprocessor, so a checkpoint rebuilds it without the
    folder); `load_pretrained` then copies the folder's weights in."""
    record = pre.state.get("pretrained")
    if record:
        from app.models.families import family

        return family(record["model_type"]).build(record["architecture"], pre, cfg)
    if "towers" in pre.state:  # a dual encoder with pretrained towers (one may be from scratch)
        from app.models.families import towers

        return towers(pre.state["towers"], pre, cfg)
    name = cfg.name or next((n for n, kind in ACCEPTS.items() if isinstance(pre, kind)), "cnn")
    expected = ACCEPTS.get(name)
    if expected and not isinstance(pre, expected):
        raise ConfigError(
            f"config error: model.name: {name!r} takes {expected.kind} data, "
            f"but the dataset is {pre.kind}"
        )
    return resolve(name)(cfg, pre)


def is_custom(cfg: ModelConfig, pre: Preprocessor) -> bool:
    """A user's own model (`model.name: pkg.module:callable`), not one of the families here."""
    return not has_pretrained(pre) and bool(cfg.name) and cfg.name not in REGISTRY


def has_pretrained(pre: Preprocessor) -> bool:
    return "pretrained" in pre.state or "towers" in pre.state


def load_pretrained(model: nn.Module, pre: Preprocessor) -> None:
    """Copy the pretrained folders' weights into `model` (built by `build_model`): the folder's,
    or each tower's under its prefix (a dual encoder of two folders)."""
    for prefix, record in pretrained_records(pre):
        load_folder(model, record, prefix)


def pretrained_records(pre: Preprocessor) -> list[tuple[str, dict[str, Any]]]:
    """(name prefix in the model, folder record) of each pretrained folder the model takes."""
    if "towers" in pre.state:
        return [(f"{prefix}.encoder.", r) for prefix, r in pre.state["towers"].items()]
    return [("", pre.state["pretrained"])]


def stored_weights(pre: Preprocessor) -> dict[str, Stored]:
    """Every pretrained tensor the model takes, by its name in the model, unread (a sharded
    rank reads only its part of each: app/train/materialise.py)."""
    from app.models.families import family_of

    stored: dict[str, Stored] = {}
    for prefix, record in pretrained_records(pre):
        base = _unchanged(record)
        renamed = family_of(base).rename(base.stored(), base.config)
        stored |= {prefix + k: v for k, v in renamed.items()}
    return stored


def is_fresh(name: str, prefix: str = "") -> bool:
    """A tensor no folder provides: the new head, a dual encoder's projections and
    temperature, LoRA adapters."""
    return (
        name.removeprefix(prefix).startswith("head.") or ".lora_" in name or name.startswith(FRESH)
    )


def _unchanged(record: dict[str, Any]) -> Pretrained:
    base = open_pretrained(record["uri"])
    if base.weights_sha256() != record["weights_sha256"]:
        raise ConfigError(
            f"config error: model.pretrained: {record['uri']}: the weights changed since this "
            "run began (sha256 differs); start a new run"
        )
    return base


def load_folder(model: nn.Module, record: dict[str, Any], prefix: str) -> None:
    """Every backbone tensor of the folder must be there with its shape; only the new head,
    projections and temperature (and LoRA adapters) stay fresh."""
    from app.models.families import family_of

    base = _unchanged(record)
    renamed = family_of(base).rename(base.weights(), base.config)
    state = {prefix + k: v for k, v in renamed.items()}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch: torch lists them, the first says enough
        detail = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise ConfigError(f"config error: model.pretrained: {record['uri']}: {detail}") from None
    mine = [k for k in result.missing_keys if k.startswith(prefix)]
    missing = [k for k in mine if not is_fresh(k, prefix)]
    if missing or result.unexpected_keys:
        what = (
            f"lacks {missing[:3]}"
            if missing
            else f"has unknown tensors {result.unexpected_keys[:3]}"
        )
        raise ConfigError(f"config error: model.pretrained: {record['uri']}: the weights {what}")


def is_conv_net(model: nn.Module) -> bool:
    """Conv nets quantize best statically (QDQ + calibration); Linear-heavy ones dynamically."""
    return any(isinstance(m, nn.Conv2d | nn.Conv1d) for m in model.modules())
