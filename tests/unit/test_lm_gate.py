"""The LM export gate's greedy agreement counts decisions, not the divergence after one flip."""

from __future__ import annotations

import numpy as np
import pytest

from app.tasks.lm.export import greedy_agreement

pytestmark = pytest.mark.unit
VOCAB = 10


class CountingDecoder:
    """Next token = last token + 1 (mod VOCAB), except after `flip_after`, where it picks 0.

    Fed as KVDecoder is: `step(ids, cache, picked=...)` -> logits for the picked positions
    (every fed one by default) and the cache (here just the tokens so far).
    """

    def __init__(self, flip_after: int | None = None):
        self.flip_after = flip_after

    def empty_cache(self):
        return []

    def step(self, ids, cache, picked=None):
        tokens = list(cache) + [int(t) for t in ids[0]]
        logits = np.zeros((1, len(ids[0]), VOCAB), dtype=np.float32)
        for i, token in enumerate(tokens[len(cache) :]):
            pick = 0 if token == self.flip_after else (token + 1) % VOCAB
            logits[0, i, pick] = 1.0
        if picked is not None:
            logits = np.take_along_axis(logits, np.asarray(picked)[..., None], axis=1)
        return logits, tokens


def test_one_early_flip_costs_one_decision_not_the_rest_of_the_continuation():
    decoders = {"fp32": CountingDecoder(), "int8": CountingDecoder(flip_after=2)}
    # fp32 continues 1 -> 2, 3, 4, ..., 9 (8 tokens); int8 would pick 0 after the 2.
    report = greedy_agreement(decoders, [[1]], tokens=8)
    assert report["token_agreement"] == pytest.approx(7 / 8)
    # Free-running, int8 left fp32's path at its second token and never came back.
    assert report["prefix_agreement"] == pytest.approx(1 / 8)
    same = greedy_agreement({"fp32": CountingDecoder(), "int8": CountingDecoder()}, [[1]], 8)
    assert same["token_agreement"] == same["prefix_agreement"] == 1.0
