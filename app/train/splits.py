"""How each transformer family divides into pipeline stages (app/train/pipelining.py).

A `Split` names what the first stage holds and runs before the blocks (embeddings), how one
block runs on the state that crosses from stage to stage, and what the last stage holds and
runs after them (final norm, pooler, head). The state is a tuple of tensors: the hidden states,
and for a padded text encoder its attention mask, which every stage's blocks need. A new
family is an entry in `SPLITS`; model code stays plain `torch.nn` (a stage holds the model's
own attributes, so the model's `embed` methods run on it unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from app.models.bert import BertClassifier
from app.models.encoder import padding_bias, pooled
from app.models.gpt import GPT
from app.models.llama import LlamaLM
from app.models.transformer import TransformerClassifier, pad_bias
from app.models.vit import ViTClassifier

State = tuple[torch.Tensor, ...]  # what one stage hands the next


@dataclass(frozen=True)
class Split:
    first: tuple[str, ...]  # attributes the first stage holds (read by `embed`)
    last: tuple[str, ...]  # attributes the last stage holds (read by `finish`)
    embed: Callable[..., State]  # (stage, the model's inputs, by name) -> state
    block: Callable[[nn.Module, State], State]  # (block, state) -> state
    finish: Callable[[Any, State], torch.Tensor]  # (stage, state) -> the model's output


def _gpt_embed(stage: Any, input_ids: torch.Tensor) -> State:
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (stage.dropout(stage.tokens(input_ids) + stage.positions(positions)),)


def _llama_embed(stage: Any, input_ids: torch.Tensor) -> State:
    """Token embeddings and each position's rotation, which every stage's blocks read."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    cos, sin = stage.rotary(positions.expand(input_ids.shape[0], -1))
    return (stage.tokens(input_ids), cos, sin)


def _bert_finish(stage: Any, state: State) -> torch.Tensor:
    x, mask = state
    return stage.head(stage.dropout(pooled(stage.pooler, x, mask)))


def _vit_finish(stage: Any, state: State) -> torch.Tensor:
    x = stage.norm(state[0])
    return stage.head(pooled(stage.pooler, x))


SPLITS: dict[type[nn.Module], Split] = {
    GPT: Split(
        first=("tokens", "positions", "dropout"),
        last=("norm", "head"),
        embed=_gpt_embed,
        block=lambda block, s: (block(s[0])[0],),  # a GPT block also returns keys and values
        finish=lambda stage, s: stage.head(stage.norm(s[0])),
    ),
    LlamaLM: Split(
        first=("tokens", "rotary"),
        last=("norm", "lm_head"),  # a tied head's weight is the embedding's: on both stages
        embed=_llama_embed,
        block=lambda block, s: (block(s[0], s[1], s[2], None), s[1], s[2]),
        finish=lambda stage, s: stage.lm_head(stage.norm(s[0])),
    ),
    BertClassifier: Split(
        first=("embeddings",),
        last=("pooler", "dropout", "head"),
        embed=lambda stage, input_ids, attention_mask: (
            stage.embeddings(input_ids),
            attention_mask,
        ),
        block=lambda block, s: (block(s[0], padding_bias(s[1], s[0].dtype)), s[1]),
        finish=_bert_finish,
    ),
    ViTClassifier: Split(
        first=("patch", "cls_token", "positions", "dropout"),
        last=("norm", "pooler", "head"),
        embed=lambda stage, x: (ViTClassifier.embed(stage, x),),
        block=lambda block, s: (block(s[0]),),
        finish=_vit_finish,
    ),
    TransformerClassifier: Split(
        first=("tokens", "positions"),
        last=("norm", "head"),
        embed=lambda stage, input_ids, attention_mask: (
            TransformerClassifier.embed(stage, input_ids),
            attention_mask,
        ),
        block=lambda block, s: (block(s[0], pad_bias(s[1], s[0].dtype)), s[1]),
        finish=lambda stage, s: TransformerClassifier.classify(stage, *s),
    ),
}


def split_of(model: nn.Module) -> Split:
    split = SPLITS.get(type(model))
    if split is None:
        known = ", ".join(sorted(t.__name__ for t in SPLITS))
        raise ValueError(f"train.strategy=pipeline: {type(model).__name__} has no split ({known})")
    return split
