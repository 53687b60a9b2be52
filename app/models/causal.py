"""The contract every causal language model family keeps (GPT, app/models/gpt.py; the Llama-style
decoders, app/models/llama.py), which training, export and generation rely on instead of a
family's classes: the tokens in, next-token logits out (or, given targets, the loss computed in
chunks: `chunked_token_loss`), rows packed with several sequences (`packed_inputs`), and the
same computation on a KV cache written for tracing (`step`), whose cache is `kv_heads` x
`head_dim` a token and a block."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@runtime_checkable
class CausalLM(Protocol):
    block_size: int  # the longest sequence it computes exactly
    tokens: nn.Embedding  # the token embedding
    blocks: nn.ModuleList
    norm: nn.Module  # the final norm, before the LM head
    vocab_loss: nn.Module  # (hidden, norm, head weight, targets) -> TokenLoss: `VocabLoss`

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


# --- the loss every causal LM computes inside its forward when given targets ---------------------

IGNORE = -100  # a target that is not trained: a prompt token, padding, a row's first token
# fp32 logits one loss chunk holds at once (256 MiB): a 151,936-token vocabulary's logits of
# 4 x 1,024 tokens would be 2.3 GiB, and as much again for their gradient. Smaller chunks save
# little more and cost time: each adds the head's whole weight gradient once (bench/B28).
LOSS_CHUNK_ELEMENTS = 1 << 26


class TokenLoss(NamedTuple):
    """A batch's next-token loss, as sums (so that ranks and batches add up exactly)."""

    total: torch.Tensor  # summed cross entropy of the trained targets, in nats (differentiable)
    tokens: torch.Tensor  # trained targets
    correct: torch.Tensor  # trained targets that are the model's top-1 pick

    @property
    def mean(self) -> torch.Tensor:
        return self.total / self.tokens.clamp(min=1)


def chunked_token_loss(
    hidden: torch.Tensor,
    logits: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    vocab: int,
) -> TokenLoss:
    """Cross entropy of the trained `targets` [batch, tokens] (IGNORE elsewhere) against the
    logits of `hidden` [batch, tokens, dim], computed a chunk of trained tokens at a time: only
    the trained positions reach the head, and while training each chunk's logits are recomputed
    in backward instead of kept, so at most one chunk of fp32 logits exists at once."""
    trained = targets.flatten() != IGNORE
    h, t = hidden.flatten(0, 1)[trained], targets.flatten()[trained]
    chunk = max(1, LOSS_CHUNK_ELEMENTS // vocab)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    for start in range(0, len(t), chunk):
        part = (h[start : start + chunk], t[start : start + chunk], logits)
        if torch.is_grad_enabled():
            loss, hits = checkpoint(_chunk_loss, *part, use_reentrant=False)
        else:
            loss, hits = _chunk_loss(*part)
        total, correct = total + loss, correct + hits
    if not len(t):  # keep every parameter in the graph: DDP and FSDP expect their gradients
        total = total + 0.0 * logits(hidden.flatten(0, 1)[:1]).float().sum()
    return TokenLoss(total, trained.sum(), correct)


class VocabLoss(nn.Module):
    """The loss at a causal LM's head: `chunked_token_loss` of the normed hidden states against
    the head's rows. A module without parameters (checkpoints and FSDP see nothing of it), so
    that a sharded run can put its own in its place (app/train/vocab_parallel.py)."""

    def forward(
        self, hidden: torch.Tensor, norm: nn.Module, weight: torch.Tensor, targets: torch.Tensor
    ) -> TokenLoss:
        return chunked_token_loss(
            hidden, functools.partial(_head, norm, weight), targets, weight.shape[0]
        )


def _head(norm: nn.Module, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(norm(hidden), weight)


def _chunk_loss(
    h: torch.Tensor, t: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits(h).float()
    with torch.no_grad():
        hits = (scores.argmax(-1) == t).sum()
    return F.cross_entropy(scores, t, reduction="sum"), hits


def packed_inputs(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows holding several sequences side by side (`segments` [batch, tokens]: each token's
    sequence number in its row, 0 for padding) -> each token's position in its own sequence and
    the boolean [batch, 1, tokens, tokens] mask of the keys each query sees: earlier tokens of
    its own sequence (and itself, so no softmax is empty)."""
    tokens = segments.shape[1]
    index = torch.arange(tokens, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return index - first, (causal & same)[:, None]


def takes_targets(model: nn.Module) -> bool:
    """Whether `model` computes its own loss given `targets` (the contract's forward)."""
    import inspect

    return "targets" in inspect.signature(model.forward).parameters
