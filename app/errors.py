"""The project's domain errors: what a user sees when something is wrong, as one line.

Each carries the exit code its job ends with (README, "The jobs"): 1 bad input or a failed run,
2 bad config or no cluster, 3 the export gate. No heavy imports: serving and tools import this.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class ConfigError(ValueError):
    """A bad config key or value; the message is one line naming the key (exit 2)."""


class UserError(Exception):
    """Bad input the user can fix (missing file, bad column, ...): a one-line message, exit 1."""

    exit_code = 1


class NoClusterError(UserError):
    """A job that leaves something running (deploy) found no Ray cluster to join."""

    exit_code = 2


class CheckpointError(UserError):
    """A checkpoint file that is missing or unreadable; the one-line message names the file."""


class ArtifactError(UserError):
    """An artifact that must not be loaded; the message names the file."""


class GateError(UserError):
    """Export refused: int8 lost too much accuracy, is too big, or ONNX disagrees with torch
    (exit 3). Carries the report, per-layer sensitivity included, for tools and benchmarks."""

    exit_code = 3

    def __init__(self, message: str, report: dict[str, Any]):
        super().__init__(message)
        self.report = report


def validation_line(error: ValidationError, data: Any) -> str:
    """pydantic's (multi-line) error as one line: the first bad field's path and what is wrong.

    The path follows `data`, the input itself, so pydantic's internal steps (union members,
    validators) that are not keys of the file are left out: `splits.train.shards[0].rows`.
    """
    first = error.errors(include_url=False)[0]
    error_type, value = first["type"], first.get("input")
    path = _input_path(first["loc"], data, missing=error_type == "missing")
    if error_type in ("model_type", "dict_type"):
        what = f"expected a JSON object, got {type(value).__name__}"
    elif error_type == "value_error":  # a validator's own message, which says what is wrong
        what = first["msg"].removeprefix("Value error, ")
    else:
        what = first["msg"] if error_type == "missing" else f"{first['msg']} (got {_short(value)})"
    return f"{path}: {what}" if path else what


def _input_path(loc: tuple[int | str, ...], data: Any, missing: bool) -> str:
    path, node = "", data
    for i, part in enumerate(loc):
        found, child = _child(node, part)
        if found:
            node = child
        elif not (missing and i == len(loc) - 1):
            continue  # a pydantic step, not a key of the input
        path += f"[{part}]" if isinstance(part, int) else f"{'.' if path else ''}{part}"
    return path


def _child(node: Any, part: int | str) -> tuple[bool, Any]:
    """(True, node[part]) when `part` is a key or index of `node`, else (False, None)."""
    if isinstance(node, dict) and part in node:
        return True, node[part]
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return True, node[part]
    return False, None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
