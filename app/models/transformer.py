"""A BERT-style Transformer encoder classifier, written out in plain layers.

Attention is spelled out with Linear layers and matmuls (rather than nn.MultiheadAttention's fused
fast path) so that the ONNX graph is made of MatMul/Gemm nodes that dynamic int8 quantization
turns into MatMulInteger, and the exported graph matches eager torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from app.models.encoder import masked_mean


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad_bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + pad_bias
        attn = self.dropout(torch.softmax(scores, dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, dim: int, heads: int, ff_dim: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff_dim), nn.GELU(), nn.Linear(ff_dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x), pad_bias))
        return x + self.dropout(self.ff(self.norm2(x)))


class TransformerClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        ff_dim: int = 128,
        max_length: int = 32,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_length, dim)
        self.layers = nn.ModuleList(
            EncoderLayer(dim, heads, ff_dim, dropout) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.tokens(input_ids) + self.positions(positions)

    def classify(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits from the last layer's token states: normed, averaged over real tokens."""
        return self.head(masked_mean(self.norm(x), attention_mask))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        bias = pad_bias(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, bias)
        return self.classify(x, attention_mask)


def pad_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias that hides padding keys: 0 where attended, a large negative where padded."""
    return ((1.0 - attention_mask.to(dtype)) * -1e4)[:, None, None, :]
