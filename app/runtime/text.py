"""Text out of token ids, one token at a time: whole characters only, and stop strings held back
until they cannot match."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EOS = "<|endoftext|>"  # app/data/corpus.py's document separator: the model's end of text
REPLACEMENT = "\ufffd"  # what a byte-level decoder yields for an incomplete UTF-8 sequence


class IncrementalDecoder:
    """Token ids in, new text out, one token at a time. Decodes a short window (the tokens since
    the last complete piece) and emits only once the text no longer ends in a partial UTF-8
    character, so a multi-byte character split over tokens comes out whole."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """What is still held back (an incomplete character comes out as U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]


class StopFilter:
    """Holds back text that could still become one of the `stop` strings; cuts the text at the
    first stop string found. `done` turns true once one is found."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.done = False

    def feed(self, text: str) -> str:
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if found:
            out, self.pending, self.done = self.pending[: min(found)], "", True
            return out
        hold = max((self._partial(s) for s in self.stop), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _partial(self, stop: str) -> int:
        """The length of the longest end of `pending` that begins `stop`."""
        for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(stop[:n]):
                return n
        return 0

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
