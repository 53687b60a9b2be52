"""Pieces the pretrained encoders (app/models/bert.py, app/models/vit.py) share.

Attention keeps separate `query`, `key` and `value` projections, as the Hugging Face weights
are laid out (and the names LoRA targets), and is spelled out as matmuls so that the ONNX graph
is MatMul nodes that int8 quantization handles, matching eager torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape

        def heads(project: nn.Module) -> torch.Tensor:
            return project(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query), heads(self.key), heads(self.value)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if bias is not None:
            scores = scores + bias
        attn = self.dropout(torch.softmax(scores, dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, t, d))


def padding_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, 1, 1, keys] additive bias: 0 for a real token, the dtype's minimum for padding."""
    hidden = 1.0 - attention_mask[:, None, None, :].to(dtype)
    return hidden * torch.finfo(dtype).min


def masked_mean(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the real tokens' states (padding excluded)."""
    mask = attention_mask.to(x.dtype)[..., None]
    return (x * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def pooled(
    pooler: nn.Module | None, x: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[batch, dim] from token states: the pooler on the first token when the model has one,
    else the mean of the real tokens (all of them without a mask)."""
    if pooler is not None:
        return torch.tanh(pooler(x[:, 0]))
    return x.mean(1) if attention_mask is None else masked_mean(x, attention_mask)


class Head(nn.Linear):
    """The classifier head a pretrained backbone gets: N(0, initializer_range), zero bias."""

    def __init__(self, dim: int, classes: int, std: float):
        self.std = std  # read by the reset nn.Linear's constructor calls
        super().__init__(dim, classes)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        nn.init.zeros_(self.bias)


def new_head(dim: int, classes: int, std: float) -> nn.Linear:
    return Head(dim, classes, std)


def block_rules(blocks: str, names: dict[str, str]) -> list[tuple[str, str]]:
    """Rename rules for a stack of blocks: `<blocks>.N.<name>.*` -> `blocks.N.<ours>.*` for
    each (name, ours) of `names` (dotted names, not patterns)."""
    stack = re.escape(blocks) + r"\.(\d+)\."
    return [
        (stack + re.escape(name) + r"\.(.*)", rf"blocks.\1.{ours}.\2")
        for name, ours in names.items()
    ]


def layer_rules(attention: str, norm1: str, norm2: str) -> list[tuple[str, str]]:
    """Hugging Face's encoder layers (`encoder.layer.N.*`, shared by BERT and ViT) ->
    `blocks.N.*`; the families differ in the attention's path and the names of the two norms."""
    projections = {f"{attention}.{p}": f"attn.{p}" for p in ("query", "key", "value")}
    return block_rules(
        "encoder.layer",
        {
            **projections,
            "attention.output.dense": "attn.out",
            norm1: "norm1",
            "intermediate.dense": "ff_in",
            "output.dense": "ff_out",
            norm2: "norm2",
        },
    )


def renamed(
    state: dict[str, torch.Tensor],
    prefixes: Iterable[str],
    rules: list[tuple[str, str]],
    ignore: str,
) -> dict[str, torch.Tensor]:
    """A folder's tensors under the module's names: a model prefix (`bert.`) stripped, each
    name rewritten by the first matching (regex, replacement) rule; names matching `ignore`
    (heads of the pretraining task, buffers) dropped. An unmatched name is kept as is, so the
    loader reports it as unexpected."""
    out = {}
    for name, tensor in state.items():
        for prefix in prefixes:
            name = name.removeprefix(prefix)
        if re.fullmatch(ignore, name):
            continue
        for pattern, replacement in rules:
            if re.fullmatch(pattern, name):
                name = re.sub(pattern, replacement, name)
                break
        out[name] = tensor
    return out


def encoder_sizes(arch: dict[str, Any], pre: Any, cfg: Any) -> dict[str, Any]:
    """What BERT and ViT configs name alike (the same config.json keys): the keyword
    arguments both classifiers take, the new head and the pooler choice included."""
    check_activation(arch, "hidden_act", ("gelu",), "gelu")
    return {
        "num_classes": len(pre.labels),
        "dim": arch["hidden_size"],
        "layers": arch["num_hidden_layers"],
        "heads": arch["num_attention_heads"],
        "ff_dim": arch["intermediate_size"],
        "eps": arch.get("layer_norm_eps", 1e-12),
        "dropout": cfg.dropout,
        "pooler": bool(pre.state["pretrained"].get("has_pooler")),
        "init_std": arch.get("initializer_range", 0.02),
    }


def check_activation(arch: dict, key: str, supported: tuple[str, ...], default: str) -> None:
    from app.errors import ConfigError

    value = arch.get(key, default)
    if value not in supported:
        raise ConfigError(
            f"config error: model.pretrained: config.json {key} {value!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )
