"""CLIP as a dual encoder, in plain `torch.nn`: Hugging Face's `CLIPModel` weights load by name.

Both towers are pre-norm transformers with quick-GELU. The text tower is causal, reads
positions up to the first end-of-text token and pools that token's state after a final norm; the
image tower embeds patches with a convolution (no bias) behind a class embedding and learned
positions, normalises before the layers and pools the class token after a final norm. Both
pools go through CLIP's projections (no bias) into the joint space (app/models/dual_encoder.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from app.models.dual_encoder import DualEncoder
from app.models.encoder import Attention, block_rules, check_activation, padding_bias, renamed


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, ff_dim: int, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads, 0.0)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.ff_in = nn.Linear(dim, ff_dim)
        self.ff_out = nn.Linear(ff_dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bias)
        return x + self.ff_out(quick_gelu(self.ff_in(self.norm2(x))))


class TextTower(nn.Module):
    def __init__(self, sizes: dict[str, Any], eos_id: int):
        super().__init__()
        dim = sizes["hidden_size"]
        self.tokens = nn.Embedding(sizes["vocab_size"], dim)
        self.positions = nn.Embedding(sizes["max_position_embeddings"], dim)
        self.blocks = nn.ModuleList(_layers(sizes))
        self.norm = nn.LayerNorm(dim, eps=sizes.get("layer_norm_eps", 1e-5))
        self.eos_id = eos_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(t, device=input_ids.device))
        causal = torch.full((t, t), torch.finfo(x.dtype).min, device=x.device).triu(1)
        bias = causal[None, None] + padding_bias(attention_mask, x.dtype)
        for block in self.blocks:
            x = block(x, bias)
        x = self.norm(x)
        # The first end-of-text token's state (older configs, whose eos id is 2, take the
        # highest id: CLIP's tokenizer gives the end of text the largest id).
        marker = (
            input_ids == self.eos_id
            if self.eos_id != 2
            else input_ids == input_ids.max(-1, keepdim=True).values
        )
        at = marker.to(torch.int64).argmax(-1)
        return x[torch.arange(x.shape[0], device=x.device), at]


class ImageTower(nn.Module):
    def __init__(self, sizes: dict[str, Any]):
        super().__init__()
        dim, patch = sizes["hidden_size"], sizes["patch_size"]
        patches = (sizes["image_size"] // patch) ** 2
        eps = sizes.get("layer_norm_eps", 1e-5)
        self.patch = nn.Conv2d(sizes.get("num_channels", 3), dim, patch, stride=patch, bias=False)
        self.cls_token = nn.Parameter(torch.zeros(dim))
        self.positions = nn.Embedding(patches + 1, dim)
        self.pre_norm = nn.LayerNorm(dim, eps=eps)
        self.blocks = nn.ModuleList(_layers(sizes))
        self.post_norm = nn.LayerNorm(dim, eps=eps)

    def reset_parameters(self) -> None:
        """Its own tensor (app/models/init.py): the class token starts at 0."""
        nn.init.zeros_(self.cls_token)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1), x], dim=1)
        x = self.pre_norm(x + self.positions.weight)
        for block in self.blocks:
            x = block(x)
        return self.post_norm(x[:, 0])


def _layers(sizes: dict[str, Any]) -> list[Layer]:
    check_activation(sizes, "hidden_act", ("quick_gelu",), "quick_gelu")
    eps = sizes.get("layer_norm_eps", 1e-5)
    return [
        Layer(sizes["hidden_size"], sizes["num_attention_heads"], sizes["intermediate_size"], eps)
        for _ in range(sizes["num_hidden_layers"])
    ]


def from_config(arch: dict[str, Any], pre: Any, cfg: Any) -> DualEncoder:
    """The model a CLIP folder's config.json describes (its text and vision sections)."""
    text, vision = arch["text_config"], arch["vision_config"]
    eos = int(text.get("eos_token_id", 2))
    return DualEncoder(
        ImageTower(vision),
        TextTower(text, eos),
        vision["hidden_size"],
        text["hidden_size"],
        int(arch.get("projection_dim", 512)),
        scale=float(arch.get("logit_scale_init_value", 2.6592)),
    )


LAYER = {
    "self_attn.q_proj": "attn.query",
    "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value",
    "self_attn.out_proj": "attn.out",
    "layer_norm1": "norm1",
    "mlp.fc1": "ff_in",
    "mlp.fc2": "ff_out",
    "layer_norm2": "norm2",
}
RULES = [
    (r"text_model\.embeddings\.token_embedding\.(.*)", r"text.tokens.\1"),
    (r"text_model\.embeddings\.position_embedding\.(.*)", r"text.positions.\1"),
    *[(f"text_model\\.{p}", f"text.{r}") for p, r in block_rules("encoder.layers", LAYER)],
    (r"text_model\.final_layer_norm\.(.*)", r"text.norm.\1"),
    (r"vision_model\.embeddings\.class_embedding", "image.cls_token"),
    (r"vision_model\.embeddings\.patch_embedding\.(.*)", r"image.patch.\1"),
    (r"vision_model\.embeddings\.position_embedding\.(.*)", r"image.positions.\1"),
    (r"vision_model\.pre_layrnorm\.(.*)", r"image.pre_norm.\1"),
    *[(f"vision_model\\.{p}", f"image.{r}") for p, r in block_rules("encoder.layers", LAYER)],
    (r"vision_model\.post_layernorm\.(.*)", r"image.post_norm.\1"),
    (r"visual_projection\.(.*)", r"image_proj.\1"),
    (r"text_projection\.(.*)", r"text_proj.\1"),
]
IGNORE = r".*position_ids"


def rename(
    state: dict[str, torch.Tensor], arch: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    return renamed(state, (), RULES, IGNORE)
