"""A conversation -> its tokens, and which of them a chat fine-tune trains on.

The conversation is rendered whole by the model's chat template (its folder's, or the plain one:
app/chat_template.py) and tokenized as serving tokenizes a prompt. What is trained is found from
the template's own output, never from `{% generation %}` markers (most templates have none):

- where assistant turn i starts: the first character at which the full rendering leaves the
  rendering of the messages before it with the generation prompt (what serving feeds the model
  before it answers);
- where its content ends: the rendering with that content replaced by a sentinel string; what
  follows the sentinel there is what follows the content in the full rendering;
- its end of turn: the first `turn_end` token after the content (the special token the template
  closes an assistant turn with, found once by `turn_end_token`), so the model learns to stop.

Every token overlapping [start, end of turn] is trained: the content as rendered, including
whatever the template writes inside the turn (Qwen3's empty think block), and the end-of-turn
token. A template that renders later turns differently when a content changes, or closes no
turn with a special token, is refused rather than guessed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import numpy as np

from app.chat_template import TemplateRefused, compile_template, render
from app.data.packing import Tokenized

ROLES = ("system", "user", "assistant")
SENTINEL = "zq7Sentinel4xj"  # stands in for a content; no template rewrites such a word
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": SENTINEL}]
Messages = Sequence[dict[str, Any]]


class RowRefused(ValueError):
    """Why one conversation cannot be trained on (one line, the file and line added above)."""


@dataclass(frozen=True)
class ChatFormat:
    """How a dataset's conversations become tokens (it travels to every prepare task)."""

    template: str  # Jinja source: the folder's chat template, or PLAIN_TEMPLATE
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template reads them
    tokenizer: str  # the tokenizer as `tokenizers` serialises it
    add_special_tokens: bool  # the tokenizer's own specials around a rendering (plain template)
    turn_end: int  # the token that closes an assistant turn
    train_on: Literal["assistant", "all"]
    date: str  # what the template's strftime_now sees (shards stay byte-identical)
    max_tokens: int  # a row's width: model.max_length + 1
    truncate: bool  # cut a longer conversation instead of refusing it


def turn_end_token(template: str, special_tokens: dict[str, str], tokenizer: Any) -> int | None:
    """The special token the template closes an assistant turn with (the first special token
    after the content of a one-question conversation), or None when it writes none there.
    TemplateRefused when the template refuses that conversation."""
    text = _render(compile_template(template), PROBE, False, special_tokens, "2026-01-01")
    if SENTINEL not in text:
        return None
    tail = text[text.index(SENTINEL) + len(SENTINEL) :]
    specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    ids = tokenizer.encode(tail, add_special_tokens=False).ids
    return next((i for i in ids if i in specials), None)


class Renderer:
    """A `ChatFormat` compiled once per process: conversations -> `Tokenized`."""

    def __init__(self, fmt: ChatFormat):
        from tokenizers import Tokenizer

        self.fmt = fmt
        self.template = compile_template(fmt.template)
        self.tokenizer = Tokenizer.from_str(fmt.tokenizer)

    def tokenized(self, messages: Messages) -> Tokenized:
        full = self.render(messages, False)
        spans = [self.span(messages, i, full) for i in assistant_turns(messages)]
        encoding = self.tokenizer.encode(full, add_special_tokens=self.fmt.add_special_tokens)
        ids = np.asarray(encoding.ids, dtype=np.int32)
        trained = self.trained(ids, encoding.offsets, spans)
        if len(ids) > self.fmt.max_tokens:
            if not self.fmt.truncate:
                raise RowRefused(
                    f"{len(ids)} tokens, over model.max_length + 1 = {self.fmt.max_tokens} "
                    "(data.truncate=true cuts such conversations)"
                )
            ids, trained = ids[: self.fmt.max_tokens], trained[: self.fmt.max_tokens]
        if not trained.any():
            raise RowRefused(f"no assistant token within the first {self.fmt.max_tokens} tokens")
        return Tokenized(ids, trained)

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        f = self.fmt
        try:
            return _render(self.template, messages, add_generation_prompt, f.special_tokens, f.date)
        except TemplateRefused as e:
            raise RowRefused(f"the chat template refused it: {e}") from None

    def span(self, messages: Messages, turn: int, full: str) -> tuple[int, int]:
        """[start, end) characters of assistant turn `turn`'s content in `full`."""
        prompt = self.render(messages[:turn], True)
        start = common_prefix(prompt, full)
        probe = [dict(m) for m in messages]
        probe[turn]["content"] = SENTINEL
        text = self.render(probe, False)
        tail = text[text.index(SENTINEL) + len(SENTINEL) :] if SENTINEL in text else None
        if tail is None or not full.endswith(tail) or len(full) - len(tail) < start:
            raise RowRefused(
                f"messages[{turn}]: the chat template renders what follows this assistant turn "
                "differently when its content changes, so its end cannot be found"
            )
        return start, len(full) - len(tail)

    def trained(
        self, ids: np.ndarray, offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
    ) -> np.ndarray:
        """1 for every token of a turn from its start through its end-of-turn token (the first
        after its content, before the next turn starts)."""
        trained = np.zeros(len(ids), dtype=np.uint8)
        if self.fmt.train_on == "all":
            trained[1:] = 1
            return trained
        starts, ends = (np.asarray(side) for side in zip(*offsets, strict=True))
        real = ends > starts  # tokens the tokenizer added around the text cover no characters
        limits = [start for start, _ in spans[1:]] + [int(ends.max()) + 1]
        for turn, ((start, end), limit) in enumerate(zip(spans, limits, strict=True)):
            closing = np.flatnonzero(
                real & (starts >= end) & (starts < limit) & (ids == self.fmt.turn_end)
            )
            if not len(closing):
                raise RowRefused(
                    f"assistant turn {turn + 1}: the chat template closes it with no "
                    f"end-of-turn token ({self.tokenizer.id_to_token(self.fmt.turn_end)})"
                )
            first = int(np.flatnonzero(real & (ends > start))[0])
            trained[first : closing[0] + 1] = 1
        trained[0] = 0  # nothing before a sequence's first token predicts it
        return trained


def assistant_turns(messages: Messages) -> list[int]:
    """The assistant messages that are trained (OpenAI's `weight: 0` leaves one out)."""
    return [
        i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0
    ]


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    mismatch = next((i for i in range(n) if a[i] != b[i]), n)
    return mismatch


def _render(
    template: Any,
    messages: Messages,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    date: str,
) -> str:
    return render(
        template,
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        strftime_now=functools.partial(_pinned_strftime, date),
        **special_tokens,
    )


def _pinned_strftime(date: str, fmt: str) -> str:
    return datetime.fromisoformat(date).strftime(fmt)
