"""Sequences of tokens into fixed-width rows, several to a row, and back.

A chat dataset's rows (app/data/chat_source.py) each hold whole sequences (conversations) side
by side: `input_ids`, `trained` (1 where the token is a target the loss counts) and `segments`
(each token's sequence number in its row from 1, 0 for the padding after the last). Training
keeps them apart with a block-diagonal mask and positions that restart at each
(app/models/causal.py `packed_inputs`).

Packing is best-fit decreasing over a window of sequences in source order: each, longest first,
goes into the open row with the least room that still holds it, else a new row. Deterministic:
the same sequences in the same order give the same rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

WINDOW = 4096  # sequences packed together: rows fill better as it grows, each costs a scan


@dataclass(frozen=True)
class Tokenized:
    """One tokenized sequence and which of its tokens are trained targets."""

    ids: np.ndarray  # int32
    trained: np.ndarray  # uint8, 0 for the first token (nothing before it predicts it)


@dataclass(frozen=True)
class Rows:
    """Rows of `width` tokens: ids, trained flags and segments, each [rows, width]."""

    ids: np.ndarray
    trained: np.ndarray
    segments: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def packed(sequences: Iterable[Tokenized], width: int, pad: int, pack: bool = True) -> Rows:
    """The sequences (each at most `width` tokens) in rows, padded with `pad`; one a row
    when `pack` is false."""
    groups: list[list[Tokenized]] = []
    window: list[Tokenized] = []
    for seq in sequences:
        window.append(seq)
        if len(window) == WINDOW:
            groups += _fill(window, width, pack)
            window = []
    groups += _fill(window, width, pack)
    return _rows(groups, width, pad)


def _fill(window: list[Tokenized], width: int, pack: bool) -> list[list[Tokenized]]:
    if not pack:
        return [[s] for s in window]
    order = sorted(range(len(window)), key=lambda i: -len(window[i].ids))  # stable: ties in order
    rows: list[list[Tokenized]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted: the best fit is a bisection
    for i in order:
        need = len(window[i].ids)
        at = bisect.bisect_left(rooms, (need, -1))
        if at < len(rooms):
            room, r = rooms.pop(at)
            rows[r].append(window[i])
        else:
            room, r = width, len(rows)
            rows.append([window[i]])
        bisect.insort(rooms, (room - need, r))
    return rows


def _rows(groups: list[list[Tokenized]], width: int, pad: int) -> Rows:
    ids = np.full((len(groups), width), pad, dtype=np.int32)
    trained = np.zeros((len(groups), width), dtype=np.uint8)
    segments = np.zeros((len(groups), width), dtype=np.int32)
    for r, group in enumerate(groups):
        at = 0
        for number, seq in enumerate(group, start=1):
            end = at + len(seq.ids)
            ids[r, at:end], trained[r, at:end], segments[r, at:end] = seq.ids, seq.trained, number
            at = end
    return Rows(ids, trained, segments)


def unpacked(ids: np.ndarray, trained: np.ndarray, segments: np.ndarray) -> Iterator[Tokenized]:
    """Each sequence of packed rows, alone, in row order."""
    for row_ids, row_trained, row_segments in zip(ids, trained, segments, strict=True):
        for number in np.unique(row_segments[row_segments > 0]):
            at = row_segments == number
            yield Tokenized(row_ids[at], row_trained[at])


def padded(sequences: list[Tokenized], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences one a row, padded to `width` at the end: (ids, trained) [n, width]."""
    rows = _rows([[s] for s in sequences], width, pad)
    return rows.ids, rows.trained
