"""A decoder-only causal language model (GPT-2 style), in plain `torch.nn`.

Token + learned position embeddings, pre-norm blocks (causal self-attention through
`F.scaled_dot_product_attention`, then a GELU MLP), a final LayerNorm and an output head tied to
the token embedding. The blocks are one `nn.ModuleList` named `blocks`, the unit that sharded
training (FSDP) wraps one by one.

`forward(input_ids)` returns next-token logits for every position. `decode(input_ids, past)`
is the same computation that also takes and returns each block's keys and values, so generation
can feed one new token at a time instead of recomputing the prefix (a KV cache); `step` is it
written for tracing, the contract every causal LM family keeps (app/models/llama.py too).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from app.models.causal import TokenLoss, VocabLoss

# One block's cached keys and values, each [batch, heads, past_length, head_dim].
KeyValue = tuple[torch.Tensor, torch.Tensor]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, past: KeyValue | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KeyValue]:
        """`mask`: the keys each query sees ([batch, 1, tokens, tokens], packed sequences);
        None: causal after `past`."""
        b, t, d = x.shape
        q, k, v = (
            self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        )
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=causal_mask(t, k.shape[2], x.device) if mask is None else mask,
            dropout_p=self.dropout if self.training else 0.0,
            # SDPA's own causal mask is aligned top-left, which is only right without a past.
            is_causal=mask is None and k.shape[2] == t and t > 1,
        )
        return self.resid_dropout(self.proj(out.transpose(1, 2).reshape(b, t, d))), (k, v)


def causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask letting query i (position keys - queries + i) see keys up to its own position.

    None where SDPA needs none: without a past (`is_causal` covers it) or for a single new token,
    which sees the whole cache.
    """
    if queries == keys or queries == 1:
        return None
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, ff_dim: int, dropout: float, eps: float = 1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = nn.Sequential(
            nn.Linear(dim, ff_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(ff_dim, dim),
            nn.Dropout(dropout),
        )

    def forward(
        self, x: torch.Tensor, past: KeyValue | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, KeyValue]:
        attended, present = self.attn(self.norm1(x), past, mask)
        x = x + attended
        return x + self.mlp(self.norm2(x)), present


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        block_size: int = 128,
        dim: int = 128,
        layers: int = 4,
        heads: int = 4,
        ff_dim: int | None = None,
        dropout: float = 0.0,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.block_size = block_size
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(block_size, dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(dim, heads, ff_dim or 4 * dim, dropout, eps) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # tied: one matrix embeds and un-embeds
        self.vocab_loss = VocabLoss()
        self.depth = layers
        for name, module in self.named_modules():
            self.init_module(name, module)

    def init_module(self, name: str, module: nn.Module) -> None:
        """GPT-2's scheme over the layers' defaults (app/models/init.py calls it per module):
        N(0, 0.02) everywhere, and the projections that add into the residual stream scaled by
        1/sqrt(2 * layers) so its variance does not grow with depth."""
        if not isinstance(module, nn.Linear | nn.Embedding):
            return
        residual = re.fullmatch(r"blocks\.\d+\.(attn\.proj|mlp\.2)", name)
        std = 0.02 / math.sqrt(2 * self.depth) if residual else 0.02
        with torch.no_grad():
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor | TokenLoss:
        """[batch, time] token ids -> [batch, time, vocab] next-token logits, or given `targets`
        (the next ids, IGNORE where untrained) the loss (app/models/causal.py). Packed rows
        bring each token's `position_ids` and the boolean [batch, 1, time, time]
        `attention_mask` of the keys each query sees."""
        if position_ids is None and attention_mask is None and targets is None:
            return self.decode(input_ids)[0]
        if input_ids.shape[1] > self.block_size:
            raise ValueError(
                f"sequence of {input_ids.shape[1]} tokens exceeds the block size {self.block_size}"
            )
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.dropout(self.tokens(input_ids) + self.positions(position_ids))
        for block in self.blocks:
            x = block(x, None, attention_mask)[0]
        if targets is None:
            return self.logits(x)
        return self.vocab_loss(x, self.norm, self.head_weight(), targets)

    def decode(
        self, input_ids: torch.Tensor, past: list[KeyValue] | None = None
    ) -> tuple[torch.Tensor, list[KeyValue]]:
        """Logits for `input_ids` following the cached `past` (one entry per block), and the
        cache extended by them."""
        start = past[0][0].shape[2] if past else 0
        end = start + input_ids.shape[1]
        if end > self.block_size:
            raise ValueError(f"sequence of {end} tokens exceeds the block size {self.block_size}")
        positions = torch.arange(start, end, device=input_ids.device)
        x = self.dropout(self.tokens(input_ids) + self.positions(positions))
        presents = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, past[i] if past else None)
            presents.append(present)
        return self.head(self.norm(x)), presents

    # --- the KV-cache contract every causal LM family keeps (app/tasks/lm/export.py) -------

    @property
    def kv_heads(self) -> int:
        return cast(Block, self.blocks[0]).attn.heads

    @property
    def head_dim(self) -> int:
        return cast(Block, self.blocks[0]).attn.head_dim

    def head_weight(self) -> torch.Tensor:
        return self.head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden), self.head_weight())

    def step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`decode` written for tracing: the same weights and arithmetic, every shape taken from
        tensors and the mask always explicit (`decode` picks its mask with Python branches on
        the lengths, which a trace would freeze). Each row says where its tokens sit
        (`position_ids` [batch, tokens]) and which cache slots hold its keys (`attention_mask`
        [batch, past + tokens], 1 or 0): streams of different lengths share a step, each cache
        left-padded and its padding masked out. Returns the hidden states (before the final
        norm) and the cache extended by the tokens."""
        batch, tokens = input_ids.shape
        start = past[0].shape[2]
        query_slots = torch.arange(tokens, device=input_ids.device) + start
        key_slots = torch.arange(attention_mask.shape[1], device=input_ids.device)
        causal = key_slots.unsqueeze(0) <= query_slots.unsqueeze(1)  # [tokens, slots]
        visible = causal[None, None] & (attention_mask[:, None, None, :] > 0)
        x = self.tokens(input_ids) + self.positions(position_ids)
        presents: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            block = cast(Block, block)
            attn = block.attn
            qkv = attn.qkv(block.norm1(x)).reshape(batch, tokens, 3, attn.heads, attn.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            k = torch.cat([past[2 * i], k], dim=2)
            v = torch.cat([past[2 * i + 1], v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
            x = x + attn.proj(out.transpose(1, 2).reshape(batch, tokens, -1))
            x = x + block.mlp(block.norm2(x))
            presents += [k, v]
        return x, presents


# --- GPT-2 checkpoints (model.pretrained with model_type gpt2, app/pretrained.py) ---------------


def from_gpt2(arch: dict[str, Any], pre: Any, cfg: Any) -> GPT:
    """GPT-2's architecture is this module's: its config.json sizes it."""
    from app.models.encoder import check_activation

    check_activation(arch, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    dim = arch["n_embd"]
    return GPT(
        vocab_size=arch["vocab_size"],
        block_size=arch["n_positions"],
        dim=dim,
        layers=arch["n_layer"],
        heads=arch["n_head"],
        ff_dim=arch.get("n_inner") or 4 * dim,
        dropout=cfg.dropout,
        eps=arch.get("layer_norm_epsilon", 1e-5),
    )


# GPT-2's block names -> the project's (app/models/gpt.py:Block).
GPT2_BLOCK = {
    "ln_1": "norm1",
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.proj",
    "ln_2": "norm2",
    "mlp.c_fc": "mlp.0",
    "mlp.c_proj": "mlp.2",
}
# The output head is tied to wte; the attention mask buffers of older checkpoints.
GPT2_IGNORE = r"lm_head\.weight|h\.\d+\.attn\.(bias|masked_bias)"
# GPT-2's Conv1D stores [in, out]: transposed into nn.Linear's [out, in].
CONV1D = r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight"


def rename_gpt2(
    state: dict[str, torch.Tensor], arch: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    import re

    from app.models.encoder import block_rules, renamed

    state = {
        name: tensor.t().contiguous()
        if re.fullmatch(CONV1D, name.removeprefix("transformer."))
        else tensor
        for name, tensor in state.items()
    }
    rules = [
        (r"wte\.weight", "tokens.weight"),
        (r"wpe\.weight", "positions.weight"),
        *block_rules("h", GPT2_BLOCK),
        (r"ln_f\.(.*)", r"norm.\1"),
    ]
    return renamed(state, ("transformer.",), rules, GPT2_IGNORE)
