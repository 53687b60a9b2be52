"""The language model's step on a KV cache: an exported graph (app/tasks/lm/export.py) run by ONNX
Runtime, alone or for streams of different lengths together.

The graph takes `input_ids` [batch, tokens] after a KV cache (`past_key_<i>` / `past_value_<i>`
per block, [batch, kv_heads, cached, head_dim], possibly 0 cached), with `position_ids`,
`attention_mask` and `logit_positions` (which positions' logits it returns: a prompt's last, a
step's one, every one when scoring), and returns `logits` [batch, picked, vocab] and the
extended cache (`present_*`): the prefix is never recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def past_name(kind: str, layer: int) -> str:
    return f"past_{kind}_{layer}"


def present_name(kind: str, layer: int) -> str:
    return f"present_{kind}_{layer}"


POSITIONS, KEY_MASK, LOGIT_POSITIONS = "position_ids", "attention_mask", "logit_positions"


class KVDecoder:
    """One ONNX Runtime session of an exported LM graph and its cache layout. Its
    `position_ids` and `attention_mask` inputs let streams of different lengths step together
    (`KVBatch`)."""

    def __init__(self, session: Any):
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.layers = sum(1 for name in inputs if name.startswith("past_key_"))
        needed = ("input_ids", POSITIONS, KEY_MASK, LOGIT_POSITIONS)
        if any(name not in inputs for name in needed) or self.layers == 0:
            raise ValueError(
                "not a KV-cache language model graph of this version (input_ids, position_ids, "
                "attention_mask, logit_positions, past_key_0, ...): export the checkpoint again "
                "with jobs.export"
            )
        shape = inputs[past_name("key", 0)].shape  # [batch, heads, cached, head_dim]
        self.heads, self.head_dim = int(shape[1]), int(shape[3])
        self.vocab_size = int(session.get_outputs()[0].shape[-1])
        self.outputs = ["logits"] + [
            present_name(kind, i) for i in range(self.layers) for kind in ("key", "value")
        ]
        self.cache_inputs = [
            past_name(kind, i) for i in range(self.layers) for kind in ("key", "value")
        ]

    def empty_cache(self, batch: int = 1) -> list[np.ndarray]:
        empty = np.zeros((batch, self.heads, 0, self.head_dim), dtype=np.float32)
        return [empty] * (2 * self.layers)

    def step(
        self,
        ids: np.ndarray,
        cache: list[np.ndarray],
        positions: np.ndarray | None = None,
        mask: np.ndarray | None = None,
        picked: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list]:
        """Logits [batch, picked, vocab] for `ids` [batch, tokens] after `cache`; the new cache.
        `positions` and `mask`: by default every cache slot is the row's and the tokens
        follow it; `picked` [batch, n]: the positions (0 .. tokens - 1) whose logits come back,
        by default every one."""
        feed = {"input_ids": np.ascontiguousarray(ids, dtype=np.int64)}
        batch, tokens = feed["input_ids"].shape
        past = cache[0].shape[2]
        if positions is None:
            positions = np.broadcast_to(np.arange(past, past + tokens), (batch, tokens))
        if mask is None:
            mask = np.ones((batch, past + tokens), dtype=np.int64)
        if picked is None:
            picked = np.broadcast_to(np.arange(tokens), (batch, tokens))
        feed[POSITIONS] = np.ascontiguousarray(positions, dtype=np.int64)
        feed[KEY_MASK] = np.ascontiguousarray(mask, dtype=np.int64)
        feed[LOGIT_POSITIONS] = np.ascontiguousarray(picked, dtype=np.int64)
        feed.update(zip(self.cache_inputs, cache, strict=True))  # key_0, value_0, key_1, ...
        logits, *presents = self.session.run(self.outputs, feed)
        return logits, presents


class KVBatch:
    """The caches of streams stepped together, one row each: a row's keys fill the last
    `lengths[row]` slots (left padding, masked out), so every row's next token goes in the same
    new slot. Rows join with the cache of their prompt and leave when their stream ends."""

    def __init__(self, decoder: KVDecoder):
        self.decoder = decoder
        self.cache = decoder.empty_cache(0)
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    def slots(self) -> int:
        """Token slots the cache holds: rows x the padded width (what its memory is)."""
        first = self.cache[0]  # one read: another thread may swap the list
        return int(first.shape[0] * first.shape[2])

    def join(self, cache: list[np.ndarray]) -> int:
        """Adds a stream whose cache (batch 1) holds its prompt; its row number."""
        self.join_many([cache])
        return len(self.lengths) - 1

    def join_many(self, caches: Sequence[list[np.ndarray]]) -> None:
        """Adds several streams at once (one copy of the batch, not one per stream)."""
        if not caches:
            return
        lengths = [c[0].shape[2] for c in caches]
        width = max(self.cache[0].shape[2], *lengths)
        grow = width - self.cache[0].shape[2]
        self.cache = [
            np.concatenate(
                [
                    _left_pad(mine, grow),
                    *(_left_pad(c[k], width - n) for c, n in zip(caches, lengths, strict=True)),
                ]
            )
            for k, mine in enumerate(self.cache)
        ]
        self.lengths += lengths

    def leave(self, *rows: int) -> None:
        """Drops rows (the rows after them move up); slots no row uses any more are freed."""
        gone = set(rows)
        self.lengths = [n for i, n in enumerate(self.lengths) if i not in gone]
        keep = max(self.lengths, default=0)
        self.cache = [np.delete(c, rows, axis=0)[:, :, c.shape[2] - keep :] for c in self.cache]

    def row_cache(self, row: int) -> list[np.ndarray]:
        """A row's own cache (batch 1, its length), as it joined and has grown since."""
        n = self.lengths[row]
        return [c[row : row + 1, :, c.shape[2] - n :] for c in self.cache]

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """One new token per row -> each row's next-token logits [rows, vocab]."""
        width = self.cache[0].shape[2]
        lengths = np.asarray(self.lengths)
        mask = np.arange(width + 1)[None, :] >= (width - lengths)[:, None]
        ids = np.asarray(tokens, dtype=np.int64)[:, None]
        only = np.zeros((len(ids), 1), dtype=np.int64)
        logits, self.cache = self.decoder.step(ids, self.cache, lengths[:, None], mask, only)
        self.lengths = [n + 1 for n in self.lengths]
        return logits[:, -1]


def _left_pad(cache: np.ndarray, slots: int) -> np.ndarray:
    if slots == 0:
        return cache
    return np.pad(cache, ((0, 0), (0, 0), (slots, 0), (0, 0)))


def prefill(
    decoder: KVDecoder, prompts: Sequence[Sequence[int]]
) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Several prompts in one call: each one's last-position logits
    [prompts, vocab] and its own cache (batch 1, its length). The prompts are right-padded:
    a prompt's tokens come before its padding, so no real token ever attends to a pad (and the
    pads, masked, see real tokens: no row of the softmax is empty)."""
    lengths = [len(p) for p in prompts]
    rows, width = len(prompts), max(lengths)
    ids = np.zeros((rows, width), dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, : lengths[i]], mask[i, : lengths[i]] = prompt, 1
    positions = np.broadcast_to(np.arange(width), (rows, width))
    last = (np.asarray(lengths) - 1)[:, None]
    logits, cache = decoder.step(ids, decoder.empty_cache(rows), positions, mask, last)
    return logits[:, 0], [[c[i : i + 1, :, :n] for c in cache] for i, n in enumerate(lengths)]


def prompt_step(decoder: KVDecoder, prompt: Sequence[int]) -> tuple[np.ndarray, list]:
    """One prompt's cache and its last position's logits [1, 1, vocab]."""
    last = np.asarray([[len(prompt) - 1]])
    return decoder.step(np.asarray([prompt]), decoder.empty_cache(), picked=last)


def greedy(decoder: KVDecoder, prompt: Sequence[int], tokens: int) -> list[int]:
    """`tokens` argmax continuations of `prompt` (the export gate compares fp32 and int8)."""
    logits, cache = prompt_step(decoder, prompt)
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(logits[0, -1].argmax()))
        logits, cache = decoder.step(np.asarray([[out[-1]]]), cache)
    return out
