"""docs/config.md, written from app/config/ (a module per section): every key, its type, default and the comment above
it. `python -m tools.config_reference > docs/config.md` rewrites it; a unit test checks it is
current, so the reference and the code never disagree."""

from __future__ import annotations

import ast
import json
import re
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

from pydantic import BaseModel

from app.config import Config

SOURCES = sorted((Path(__file__).resolve().parents[1] / "app" / "config").glob("*.py"))


def field_comments() -> dict[tuple[str, str], str]:
    """(class name, field) -> the comment lines just above the field, or on its line."""
    out: dict[tuple[str, str], str] = {}
    for source in SOURCES:
        out |= module_comments(source.read_text())
    return out


def module_comments(text: str) -> dict[tuple[str, str], str]:
    lines = text.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                above: list[str] = []
                row = item.lineno - 2
                while row >= 0 and lines[row].strip().startswith("#"):
                    above.insert(0, lines[row].strip().lstrip("# "))
                    row -= 1
                inline = lines[(item.end_lineno or item.lineno) - 1].partition("  # ")[2]
                if inline.startswith(("type:", "noqa")):
                    inline = ""
                text = " ".join([*above, inline]).strip()
                out[(node.name, item.target.id)] = text
    return out


def rows(model: type[BaseModel], prefix: str, comments) -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        nested = section_of(annotation)
        if nested is not None:
            out += rows(nested, f"{key}.", comments)
            continue
        if field.is_required():
            shown = "(required)"
        else:
            default = field.get_default(call_default_factory=True)
            shown = json.dumps(default.model_dump() if isinstance(default, BaseModel) else default)
        kind = f"`{type_name(annotation)}`".replace("|", "\\|")
        text = comments.get((model.__name__, name), "").replace("|", "\\|")
        out.append(f"| `{key}` | {kind} | `{shown}` | {text} |")
    return out


def type_name(annotation) -> str:
    """`str | None`, `"auto" | "memory"`, `list[str]`: the annotation as a reader writes it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin is not None:
        return re.sub(r"app\.config\.(\w+\.)*", "", str(annotation).replace("typing.", ""))
    return getattr(annotation, "__name__", str(annotation))


def section_of(annotation) -> type[BaseModel] | None:
    """The nested section a key holds (itself, or inside `X | None`), else None."""
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else ()
    for a in (annotation, *options):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def render() -> str:
    header = [
        "# Configuration reference",
        "",
        "Every key of a config file (`section.key: value`, or `section.key=value` on the command",
        "line), its type, its default and what it does. Written from `app/config/` by",
        "`python -m tools.config_reference > docs/config.md`; a unit test keeps it current.",
        "",
        "| key | type | default | what it does |",
        "| --- | --- | --- | --- |",
    ]
    return "\n".join([*header, *rows(Config, "", field_comments())]) + "\n"


def all_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        nested = section_of(field.annotation)
        keys += all_keys(nested, f"{prefix}{name}.") if nested else [f"{prefix}{name}"]
    return keys


if __name__ == "__main__":
    print(render(), end="")
