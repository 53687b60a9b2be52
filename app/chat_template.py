"""Hugging Face chat templates, compiled and rendered as transformers does, within bounds.

The environment is transformers' (`apply_chat_template`): Jinja's immutable sandbox with
`trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension (`break`, `continue`), the
`{% generation %}` block, `raise_exception`, `strftime_now`, `dict`, a `namespace` that refuses
underscore names and a `tojson` filter with its keyword arguments. A template is untrusted code
from a downloaded folder, so rendering is also bounded: at most `MAX_STEPS` lines of template
code (loop iterations included) and `MAX_CHARS` characters of output, and `*` / `**` may not build
values beyond that size. A template past a bound stops itself with `TemplateRefused`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import Any

MAX_STEPS = 1_000_000  # lines of template code one rendering may run (well under a second)
MAX_CHARS = 1_000_000  # characters one rendering may produce
TEMPLATE_FILE = "<template>"  # the file name Jinja compiles a template from a string under


# The template of a model that brings none: each message as `<role>: <content>` on its own line,
# an assistant's ended by the end-of-text token (what a model trained on chats learns to stop
# at), then `assistant:` for the model to continue.
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


class TemplateRefused(ValueError):
    """A template that does not compile, raised, or went past a bound (one line)."""


def compile_template(source: str) -> Any:
    """The compiled template, or TemplateRefused with Jinja's message and line."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return _compiled(source)
    except TemplateSyntaxError as e:
        raise TemplateRefused(f"line {e.lineno}: {e.message}") from None
    except SyntaxError as e:  # what Jinja compiled is no Python (`{% break %}` outside a loop)
        raise TemplateRefused(f"does not compile ({e.msg})") from None


def render(template: Any, **context: Any) -> str:
    """`template` rendered with `context`, within MAX_STEPS and MAX_CHARS."""
    out: list[str] = []
    size = 0
    with _step_budget(MAX_STEPS):
        try:
            for piece in template.generate(**context):
                size += len(piece)
                if size > MAX_CHARS:
                    raise TemplateRefused(f"the template wrote over {MAX_CHARS:,} characters")
                out.append(piece)
        except TemplateRefused:
            raise
        except Exception as e:  # noqa: BLE001 - the template's own error (raise_exception, ...)
            raise TemplateRefused(str(e) or type(e).__name__) from None
    return "".join(out)


@contextlib.contextmanager
def _step_budget(limit: int) -> Iterator[None]:
    """A trace that counts the lines the template's own code runs (only frames compiled from
    the template are traced line by line) and stops it past `limit`."""
    steps = 0

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps > limit:
            raise TemplateRefused(f"the template ran over {limit:,} steps (a loop too long)")
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(previous)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


@functools.cache
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_size(operator, left, right)
            return super().call_binop(context, operator, left, right)

    env = Bounded(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(jinja2), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_TemplateDict(),
        namespace=_namespace_class(jinja2),
    )
    return env


def _check_size(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if (
                isinstance(seq, str | list | tuple)
                and isinstance(n, int)
                and len(seq) * n > MAX_CHARS
            ):
                raise TemplateRefused(f"the template built a value over {MAX_CHARS:,} items")
    elif operator == "**" and _huge_power(left, right):
        raise TemplateRefused("the template raised a number to a power over 64")


def _huge_power(base: Any, exponent: Any) -> bool:
    ints = isinstance(base, int) and isinstance(exponent, int)
    return ints and exponent > 64 and abs(base) > 1


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


class _TemplateDict:
    """`dict(...)` in a template: a plain dict, no access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class(jinja2: Any) -> type:
    class TemplateNamespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore names (no route to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")

    return TemplateNamespace


def _generation_extension(jinja2: Any) -> type:
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with
    it (for training masks); rendering a prompt keeps the block's text as it is."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    return Generation


SAMPLE_CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    [{"role": "user", "content": "u"}],
    [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
    ],
]


def check_template(source: str, special_tokens: dict[str, str]) -> None:
    """Compile `source` and render it for a few plain conversations; TemplateRefused (the
    first conversation's reason) when none renders. Templates may refuse some shapes on
    purpose (no system role, strict alternation), so one that renders any is accepted."""
    template = compile_template(source)
    reasons = []
    for messages in SAMPLE_CONVERSATIONS:
        try:
            render(template, messages=messages, add_generation_prompt=True, **special_tokens)
            return
        except TemplateRefused as e:
            reasons.append(str(e))
    raise TemplateRefused(f"renders no plain conversation ({reasons[0]})")
