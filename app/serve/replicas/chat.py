"""Chat messages into one prompt. A model whose tokenizer carries a chat template (Hugging Face's
`chat_template`, kept in the artifact's preprocessor) renders it as transformers does: Jinja in
an immutable sandbox (a template cannot reach Python objects or change state), with `messages`,
`add_generation_prompt=True`, the tokenizer's `bos_token` and `eos_token`, `raise_exception` and
`tojson`. A model without one gets the plain template: each message as `<role>: <content>` on
its own line, then `assistant:` for the model to continue.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from app.runtime.types import RequestError

Messages = Sequence[dict[str, str]]


def plain_template(messages: Messages) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


class ChatTemplate:
    """How one model turns `messages` into its prompt."""

    def __init__(self, template: str | None, special_tokens: dict[str, str] | None = None):
        self.source = template
        self.special_tokens = special_tokens or {}
        self._template = _compile(template) if template else None

    @property
    def name(self) -> str:
        return "model" if self._template is not None else "plain"

    def render(self, messages: Messages) -> str:
        if self._template is None:
            return plain_template(messages)
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=True,
                    **self.special_tokens,
                )
            )
        except Exception as e:  # noqa: BLE001 - the template's own error, said to the client
            message = f"messages: the model's chat template refused them: {e}"[:500]
            raise RequestError(400, message) from None


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def from_preprocessor(state: dict[str, Any]) -> ChatTemplate:
    """The artifact's template (`chat_template`, `chat_special_tokens`), or the plain one."""
    return ChatTemplate(state.get("chat_template"), state.get("chat_special_tokens"))
