"""The kinds of data, one processor class each, chosen from this one table by a dataset's or an
artifact's `kind`: the only place that looks a kind up (tests/unit/test_structure.py checks).
A new built-in kind of data is a class and an entry here; one from outside app/ is named by its
path (`data.kind: "pkg.module:Class"`, a subclass of its source's kind)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import pandas as pd

from app.data.kinds.image import Image
from app.data.kinds.image_text import ImageText
from app.data.kinds.tabular import Tabular
from app.data.kinds.text import Text
from app.data.kinds.tokens import Tokens
from app.data.preprocess import FitOptions, Preprocessor
from app.errors import ConfigError, UserError

KINDS: dict[str, type[Preprocessor]] = {
    cls.kind: cls for cls in (Tabular, Image, Text, Tokens, ImageText)
}


def processor(kind: str) -> type[Preprocessor]:
    """The processor class of data of this kind: a built-in one, or the class at
    "pkg.module:Class" (`data.kind`: a kind of data from outside app/, found again by its path in
    every process that reads a manifest, a fitted state or an artifact naming it)."""
    cls = KINDS.get(kind)
    if cls is None and ":" in kind:
        cls = KINDS.setdefault(kind, _import_kind(kind))
    if cls is None:
        raise UserError(f"unknown kind of data {kind!r} (known: {', '.join(sorted(KINDS))})")
    return cls


def known(kind: str) -> bool:
    """A built-in kind, or one from outside app/ by its path (imported when first used)."""
    return kind in KINDS or ":" in kind


def prepared_as(source_kind: str, wanted: str | None) -> str:
    """The kind a source's rows are prepared as: `data.kind` when set, which must be a kind of
    the source's own (it reads the same columns and may preprocess them its own way)."""
    if wanted is None or wanted == source_kind:
        return source_kind
    cls = processor(wanted)
    if not issubclass(cls, processor(source_kind)):
        raise ConfigError(
            f"config error: data.kind: {wanted!r} is not a kind of {source_kind} data, which "
            "data.source gives"
        )
    return cls.kind


def _import_kind(path: str) -> type[Preprocessor]:
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"config error: data.kind: cannot load {path!r} ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Preprocessor)):
        raise ConfigError(f"config error: data.kind: {path!r} is not a Preprocessor class")
    if cls in KINDS.values():  # a built-in class by its path keeps its own name
        return cls
    # Named by its path wherever a kind is recorded, so every reader imports the same class.
    cls.kind = path
    return cls


def from_state(state: dict[str, Any]) -> Preprocessor:
    return processor(state["kind"])(state)


def from_json(text: str) -> Preprocessor:
    import json

    return from_state(json.loads(text))


def fit(
    chunks: Iterable[pd.DataFrame], manifest: dict[str, Any], options: FitOptions
) -> Preprocessor:
    """A preprocessor fitted on the train split's chunks, of the manifest's kind."""
    return processor(manifest["kind"]).fit(chunks, manifest, options)
