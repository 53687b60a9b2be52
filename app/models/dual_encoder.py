"""A dual encoder for text-image retrieval, in plain `torch.nn`: an image tower and a text tower,
each followed by a linear projection into one joint space, L2-normalised, and a learnable
temperature (CLIP's: `logit_scale`, initialised at ln(1/0.07), clamped at ln 100 by the loss).

The towers are the project's own small encoders (from scratch), a BERT-family text folder and a
ViT image folder (new projections, as Hugging Face's `VisionTextDualEncoderModel`), or a CLIP
folder's two transformers and projections (app/models/clip.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.models.transformer import TransformerClassifier

INITIAL_SCALE = math.log(1 / 0.07)
MAX_SCALE = math.log(100.0)


class DualEncoder(nn.Module):
    def __init__(
        self,
        image: nn.Module,
        text: nn.Module,
        image_dim: int,
        text_dim: int,
        embed_dim: int,
        scale: float = INITIAL_SCALE,
    ):
        super().__init__()
        self.image, self.text = image, text
        self.image_proj = nn.Linear(image_dim, embed_dim, bias=False)
        self.text_proj = nn.Linear(text_dim, embed_dim, bias=False)
        self.initial_scale = float(scale)
        self.logit_scale = nn.Parameter(torch.tensor(self.initial_scale))

    def reset_parameters(self) -> None:
        """Its own tensor (app/models/init.py): the temperature starts at `scale`."""
        nn.init.constant_(self.logit_scale, self.initial_scale)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image_proj(self.image(pixels)), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text_proj(self.text(input_ids, attention_mask)), dim=-1)

    def forward(
        self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both embeddings of each pair, and the temperature's inverse: exp(logit_scale), at
        most 100 (from forward, so DDP and FSDP see the parameter used)."""
        scale = self.logit_scale.clamp(max=MAX_SCALE).exp()
        return self.encode_image(pixels), self.encode_text(input_ids, attention_mask), scale


class ImageTower(nn.Module):
    """Three strided convolutions and a linear layer over the flattened map: where a thing is
    in the picture stays in the features (a global pool would lose it)."""

    def __init__(self, image_size: int, width: int, channels: tuple[int, ...] = (32, 64, 64)):
        super().__init__()
        layers: list[nn.Module] = []
        c, size = 3, image_size
        for out in channels:
            layers += [nn.Conv2d(c, out, 3, stride=2, padding=1), nn.GELU()]
            c, size = out, (size + 1) // 2
        self.convs = nn.Sequential(*layers)
        self.out = nn.Linear(c * size * size, width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.out(self.convs(pixels).flatten(1))


class Pooled(nn.Module):
    """A pretrained classifier's encoder as a tower: its pooled state (the classifier's head,
    new and untrained, is not part of it)."""

    def __init__(self, encoder: Any):
        super().__init__()
        self.encoder = encoder
        self.encoder.head = nn.Identity()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.encoder.encode(*inputs)[1]


def from_scratch(cfg: Any, vocab_size: int, image_size: int, max_length: int) -> DualEncoder:
    """The project's own towers, sized by the model section (`dim`, `layers`, `heads`,
    `ff_dim`, `embed_dim`)."""
    width = cfg.dim
    text = TransformerClassifier(
        vocab_size=vocab_size,
        num_classes=width,
        dim=width,
        layers=cfg.layers,
        heads=cfg.heads,
        ff_dim=cfg.ff_dim,
        max_length=max_length,
        dropout=cfg.dropout,
    )
    return DualEncoder(ImageTower(image_size, width), text, width, width, cfg.embed_dim)
