"""Chat messages into one prompt. A model whose tokenizer carries a chat template (Hugging Face's
`chat_template`, kept in the artifact's preprocessor) renders it as transformers does, in a
bounded immutable sandbox (app/chat_template.py), with `messages`, `add_generation_prompt=True`
and the tokenizer's `bos_token` and `eos_token`. A model without one gets the plain template
(app/chat_template.py `PLAIN_TEMPLATE`, which chat fine-tuning renders with too): each message as
`<role>: <content>` on its own line, an assistant's ended by the end-of-text token, then
`assistant:` for the model to continue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.chat_template import PLAIN_TEMPLATE, TemplateRefused, compile_template, render
from app.runtime.types import RequestError

Messages = Sequence[dict[str, str]]


class ChatTemplate:
    """How one model turns `messages` into its prompt."""

    def __init__(self, template: str | None, special_tokens: dict[str, str] | None = None):
        self.source = template
        self.special_tokens = special_tokens or {}
        self._template = compile_template(template or PLAIN_TEMPLATE)

    @property
    def name(self) -> str:
        return "model" if self.source else "plain"

    @property
    def writes_specials(self) -> bool:
        """Whether a rendering holds the model's special tokens itself (its own template
        writes its BOS), so the tokenizer must not add its own around it."""
        return bool(self.source)

    def render(self, messages: Messages) -> str:
        try:
            return render(
                self._template,
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except TemplateRefused as e:  # the template's own error or bound, said to the client
            message = f"messages: the model's chat template refused them: {e}"[:500]
            raise RequestError(400, message) from None


def from_preprocessor(state: dict[str, Any]) -> ChatTemplate:
    """The artifact's template (`chat_template`, `chat_special_tokens`), or the plain one (its
    turns ended by the trained tokenizer's end of text when no folder names one)."""
    from app.data.kinds.tokens import EOS

    specials = state.get("chat_special_tokens") or {"eos_token": EOS}
    return ChatTemplate(state.get("chat_template"), specials)
