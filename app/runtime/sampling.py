"""Picking each next token: sampling parameters (temperature, top-k, top-p, seed, OpenAI's
penalties) and token log-probabilities as OpenAI reports them. numpy only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DRAW_BLOCK = 64  # tokens per block of the sampler's two-level running sum


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature` 0 is greedy (argmax); `top_k` 0 and `top_p` 1
    are off; `seed` makes sampling reproducible (None: fresh entropy per generation);
    `presence_penalty` and `frequency_penalty` lower the logit of each token already generated,
    once and once per time (OpenAI's definition), greedy decoding included. `logprobs` (None:
    off) reports each token's log-probability with that many most likely alternatives."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # each token's log-probability and this many alternatives

    def penalized(self, logits: np.ndarray, counts: dict[int, int]) -> np.ndarray:
        """`logits` less the penalties for the tokens generated so far (`counts`: id -> times)."""
        if not counts or (self.presence_penalty == 0 and self.frequency_penalty == 0):
            return logits
        ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
        times = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        out = logits.astype(np.float64)
        out[ids] -= self.presence_penalty + self.frequency_penalty * times
        return out


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a position's logits: `sample_rows` with one row."""
    return sample_rows(logits[None], [params], [rng])[0]


def sample_rows(
    logits: np.ndarray, params: Sequence[SamplingParams], rngs: Sequence[np.random.Generator]
) -> list[int]:
    """A token id for each row of `logits` [rows, vocab], row i by `params[i]` with its own
    generator `rngs[i]` (one draw each, so a row's token never depends on its batch mates):
    greedy at temperature 0, else softmax sampling restricted to the `top_k` most likely
    tokens and to the smallest set whose probability reaches `top_p` (nucleus). The rows
    sampling the plain softmax share one vectorised pass; greedy rows one argmax."""
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    vocab = logits.shape[1]
    plain = [
        i
        for i, p in enumerate(params)
        if p.temperature != 0 and not 0 < p.top_k < vocab and p.top_p >= 1.0
    ]
    if greedy:
        for i, token in zip(greedy, logits[greedy].argmax(axis=1).tolist(), strict=True):
            tokens[i] = token
    if plain:
        temperatures = np.asarray([params[i].temperature for i in plain], np.float32)[:, None]
        z = logits[plain].astype(np.float32) / temperatures  # float32: exp costs a third
        weights = np.exp(z - z.max(axis=1, keepdims=True))
        for i, token in zip(plain, _draw(weights, [rngs[i] for i in plain]), strict=True):
            tokens[i] = token
    for i in sorted(set(range(len(params))) - set(greedy) - set(plain)):
        weights = _restricted(logits[i].astype(np.float64) / params[i].temperature, params[i])
        tokens[i] = _draw(weights[None], [rngs[i]])[0]
    return tokens


def _draw(weights: np.ndarray, rngs: Sequence[np.random.Generator]) -> list[int]:
    """A token for each row of unnormalised probabilities `weights` [rows, vocab], by inverse
    transform: the first token whose cumulative weight passes a uniform draw of the row's
    total. The running sum is taken over blocks of DRAW_BLOCK tokens, then within the one
    block the draw falls in (a full-vocabulary running sum is a serial pass per row)."""
    rows, vocab = weights.shape
    if pad := -vocab % DRAW_BLOCK:
        weights = np.pad(weights, ((0, 0), (0, pad)))
    upto = np.cumsum(weights.reshape(rows, -1, DRAW_BLOCK).sum(axis=2, dtype=np.float64), axis=1)
    tokens = []
    for row, rng in enumerate(rngs):
        target = rng.random() * upto[row, -1]
        block = min(int(np.searchsorted(upto[row], target, side="right")), upto.shape[1] - 1)
        start = block * DRAW_BLOCK
        within = np.cumsum(weights[row, start : start + DRAW_BLOCK], dtype=np.float64)
        rest = target - (upto[row, block - 1] if block else 0.0)
        at = int(np.searchsorted(within, rest, side="right"))
        if at == DRAW_BLOCK:  # rounding put the draw past the block's end: its last token
            at = int(np.flatnonzero(within < within[-1]).max(initial=-1)) + 1
        tokens.append(start + at)
    return tokens


def _restricted(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row's softmax of scaled logits `z`, kept on its top-k tokens and its nucleus."""
    if 0 < params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    return nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """`probs` kept on the smallest most-likely prefix whose mass reaches `top_p` (ties in
    token order, as a stable full sort), renormalised. The prefix is found among a growing
    candidate set (the tokens at least as likely as the k-th), so a peaked distribution sorts
    a few dozen tokens rather than the whole vocabulary on the decode thread."""
    k = min(64, len(probs))
    while True:
        order = descending_prefix(probs, k)
        sorted_probs = probs[order]
        before = np.cumsum(sorted_probs) - sorted_probs
        mass = before[-1] + sorted_probs[-1]
        if mass >= top_p or len(order) == len(probs):
            break
        # Grow by the mass still missing (twice over), and past a quarter of the vocabulary
        # sort it all: every round repartitions the whole vocabulary, and a flat
        # distribution's nucleus is most of it.
        k = math.ceil(2 * len(order) * top_p / max(mass, 1e-12))
        k = k if 4 * k < len(probs) else len(probs)
    # Keep a token while the mass before it is below top_p: the most likely always stays.
    keep = before < top_p
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out / out.sum()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token as OpenAI's `logprobs` report it: its text and UTF-8 bytes, its
    log-probability under the model (before temperature, top-k/top-p and penalties, as vLLM
    reports them) and the `top` most likely tokens at that position, most likely first."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


class TokenTexts:
    """A token id's text and bytes. Byte-level BPE tokens map back to their bytes exactly (a
    token that ends inside a multi-byte character has bytes but no whole text of its own)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        text = self.tokenizer.decode([token])
        piece = self.tokenizer.id_to_token(token) or ""
        if piece and all(c in self.byte_of for c in piece):
            return text, tuple(self.byte_of[c] for c in piece)
        return text, tuple(text.encode())

    def logprobs(self, logits: np.ndarray, token: int, top: int) -> TokenLogprob:
        z = logits.astype(np.float64)
        z -= z.max()
        logp = z - np.log(np.exp(z).sum())
        best = top_tokens(logp, top)
        alternatives = tuple((*self(int(i)), float(logp[i])) for i in best)
        return TokenLogprob(*self(token), float(logp[token]), alternatives)


def top_tokens(scores: np.ndarray, top: int) -> np.ndarray:
    """The ids of the `top` highest scores, highest first (ties in token order)."""
    top = min(max(top, 0), len(scores))
    if top == 0:
        return np.zeros(0, dtype=np.int64)
    return descending_prefix(scores, top)[:top]


def descending_prefix(values: np.ndarray, k: int) -> np.ndarray:
    """The ids of every value at least as large as the k-th largest (k or more, ties kept),
    largest first, ties in id order: the start of a stable descending sort, found by partial
    selection, never a sort of the whole vocabulary."""
    if k >= len(values):
        return np.argsort(-values, kind="stable")
    kth = np.partition(values, len(values) - k)[len(values) - k]
    candidates = np.flatnonzero(values >= kth)
    return candidates[np.argsort(-values[candidates], kind="stable")]


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character table (byte b is character [b]): printable bytes stand for
    themselves, the rest are shifted past 255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]
