"""Vision Transformer (ViT) encoders as an image classifier, in plain `torch.nn`.

Patches embedded by a strided convolution, a class token and learned positions, pre-norm layers
(x + attention(norm(x)), then x + ffn(norm(x))) and a final norm. The pretrained weights load by
name (`rename`); the classifier head is new and sits on the pooler's output when the folder has
pooler weights, else on the mean of the token states.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.models.encoder import (
    Attention,
    encoder_sizes,
    layer_rules,
    new_head,
    pooled,
    renamed,
)


class ViTLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ff_dim: int, dropout: float, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.ff_in = nn.Linear(dim, ff_dim)
        self.ff_out = nn.Linear(ff_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.ff_out(F.gelu(self.ff_in(self.norm2(x)))))


class ViTClassifier(nn.Module):
    def __init__(
        self,
        num_classes: int,
        image_size: int,
        patch_size: int,
        channels: int,
        dim: int,
        layers: int,
        heads: int,
        ff_dim: int,
        eps: float = 1e-12,
        dropout: float = 0.0,
        pooler: bool = True,
        init_std: float = 0.02,
    ):
        super().__init__()
        patches = (image_size // patch_size) ** 2
        self.patch = nn.Conv2d(channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(torch.zeros(1, patches + 1, dim))
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            ViTLayer(dim, heads, ff_dim, dropout, eps) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.pooler = nn.Linear(dim, dim) if pooler else None
        self.head = new_head(dim, num_classes, init_std)

    def reset_parameters(self) -> None:
        """Its own tensors (app/models/init.py): the class token and the positions start at 0."""
        nn.init.zeros_(self.cls_token)
        nn.init.zeros_(self.positions)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[batch, 1 + patches, dim]: the class token, then each patch, with their positions."""
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        return self.dropout(x)

    def encode(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token states [batch, 1 + patches, dim] after the final norm, pooled [batch, dim])."""
        x = self.embed(pixel_values)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x, pooled(self.pooler, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(x)[1])


def from_config(arch: dict[str, Any], pre: Any, cfg: Any) -> ViTClassifier:
    return ViTClassifier(
        image_size=arch.get("image_size", 224),
        patch_size=arch.get("patch_size", 16),
        channels=arch.get("num_channels", 3),
        **encoder_sizes(arch, pre, cfg),
    )


RULES = [
    (r"embeddings\.cls_token", "cls_token"),
    (r"embeddings\.position_embeddings", "positions"),
    (r"embeddings\.patch_embeddings\.projection\.(.*)", r"patch.\1"),
    *layer_rules("attention.attention", "layernorm_before", "layernorm_after"),
    (r"layernorm\.(.*)", r"norm.\1"),
    (r"pooler\.dense\.(.*)", r"pooler.\1"),
]
IGNORE = r"classifier\..*|embeddings\.mask_token"


def rename(
    state: dict[str, torch.Tensor], arch: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    return renamed(state, ("vit.",), RULES, IGNORE)
