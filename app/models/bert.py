"""BERT-architecture encoders (BERT, MiniLM, ...) as a sequence classifier, in plain `torch.nn`.

Post-norm layers as in the BERT paper: x = norm(x + attention(x)), then x = norm(x + ffn(x)).
The pretrained weights load by name (`rename` maps Hugging Face's names onto these modules); the
classifier head is new and sits on the pooler's output when the folder has pooler weights, else
on the mean of the real tokens' states.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.models.encoder import (
    Attention,
    check_activation,
    encoder_sizes,
    layer_rules,
    new_head,
    padding_bias,
    pooled,
    renamed,
)


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ff_dim: int, dropout: float, eps: float):
        super().__init__()
        self.attn = Attention(dim, heads, dropout)
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.ff_in = nn.Linear(dim, ff_dim)
        self.ff_out = nn.Linear(ff_dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.attn(x, bias)))
        return self.norm2(x + self.dropout(self.ff_out(F.gelu(self.ff_in(x)))))


class BertEmbeddings(nn.Module):
    def __init__(
        self, vocab: int, dim: int, positions: int, types: int, dropout: float, eps: float
    ):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(positions, dim)
        self.token_types = nn.Embedding(types, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # One sequence per row: every token is of type 0.
        x = self.tokens(input_ids) + self.positions(positions) + self.token_types.weight[0]
        return self.dropout(self.norm(x))


class BertClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        dim: int,
        layers: int,
        heads: int,
        ff_dim: int,
        max_positions: int,
        type_vocab_size: int = 2,
        eps: float = 1e-12,
        dropout: float = 0.1,
        pooler: bool = True,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.embeddings = BertEmbeddings(
            vocab_size, dim, max_positions, type_vocab_size, dropout, eps
        )
        self.blocks = nn.ModuleList(
            BertLayer(dim, heads, ff_dim, dropout, eps) for _ in range(layers)
        )
        self.pooler = nn.Linear(dim, dim) if pooler else None
        self.dropout = nn.Dropout(dropout)
        self.head = new_head(dim, num_classes, init_std)

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token states [batch, time, dim], pooled [batch, dim])."""
        x = self.embeddings(input_ids)
        bias = padding_bias(attention_mask, x.dtype)
        for block in self.blocks:
            x = block(x, bias)
        return x, pooled(self.pooler, x, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.encode(input_ids, attention_mask)[1]))


def from_config(arch: dict[str, Any], pre: Any, cfg: Any) -> BertClassifier:
    check_activation(arch, "position_embedding_type", ("absolute",), "absolute")
    return BertClassifier(
        vocab_size=arch["vocab_size"],
        max_positions=arch.get("max_position_embeddings", 512),
        type_vocab_size=arch.get("type_vocab_size", 2),
        **encoder_sizes(arch, pre, cfg),
    )


RULES = [
    (r"embeddings\.word_embeddings\.(.*)", r"embeddings.tokens.\1"),
    (r"embeddings\.position_embeddings\.(.*)", r"embeddings.positions.\1"),
    (r"embeddings\.token_type_embeddings\.(.*)", r"embeddings.token_types.\1"),
    (r"embeddings\.LayerNorm\.(.*)", r"embeddings.norm.\1"),
    *layer_rules("attention.self", "attention.output.LayerNorm", "output.LayerNorm"),
    (r"pooler\.dense\.(.*)", r"pooler.\1"),
]
# The pretraining heads (masked LM, next sentence), an old classifier, and buffers.
IGNORE = r"(cls|classifier|qa_outputs)\..*|embeddings\.position_ids"


def rename(
    state: dict[str, torch.Tensor], arch: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    return renamed(state, ("bert.",), RULES, IGNORE)
