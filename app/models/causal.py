"""The contract every causal language model family keeps (GPT, app/models/gpt.py; the Llama-style
decoders, app/models/llama.py), which training, export and generation rely on instead of a
family's classes: the tokens in, next-token logits out, and the same computation on a KV cache
written for tracing (`step`), whose cache is `kv_heads` x `head_dim` a token and a block."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class CausalLM(Protocol):
    block_size: int  # the longest sequence it computes exactly
    blocks: nn.ModuleList
    norm: nn.Module  # the final norm, before the LM head

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    def head_weight(self) -> torch.Tensor:
        """The LM head's [vocab, dim] matrix (the token embedding's own when tied)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., dim] (before the final `norm`) -> logits [..., vocab]."""
        ...

    def step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`input_ids` [batch, tokens] at `position_ids` after the cache `past` (key, value per
        block, [batch, kv_heads, cached, head_dim]), `attention_mask` [batch, cached + tokens]
        marking the valid slots: the hidden states and the cache extended by the tokens."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def causal_lm(model: Any) -> CausalLM | None:
    """The model as a causal LM, or None when it does not keep the contract (a user's own)."""
    return model if isinstance(model, CausalLM) else None


def empty_cache(model: CausalLM, batch: int = 1) -> list[torch.Tensor]:
    shape = (batch, model.kv_heads, 0, model.head_dim)
    return [torch.zeros(shape, dtype=model.head_weight().dtype)] * (2 * len(model.blocks))
