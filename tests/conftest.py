"""Shared fixtures: configs whose every output (data, runs, registry) lands under a temp folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from app.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
DIGITS_YAML = REPO / "configs" / "digits.yaml"


def make_config(
    root: str | os.PathLike[str], *overrides: str, path: str | os.PathLike[str] | None = DIGITS_YAML
) -> Config:
    """`load_config(path, overrides)` with data, runs and registry under `root`."""
    root = Path(root)
    base = [
        f"data.output={root / 'data'}",
        f"train.storage_path={root / 'runs'}",
        f"export.registry={root / 'registry'}",
    ]
    return load_config(path, [*base, *overrides])


@pytest.fixture
def config_factory(tmp_path: Path) -> Callable[..., Config]:
    """`config_factory("data.source=wine", ...)`: a digits.yaml-based config writing under tmp_path."""

    def factory(*overrides: str, path: str | os.PathLike[str] | None = DIGITS_YAML) -> Config:
        return make_config(tmp_path, *overrides, path=path)

    return factory


@pytest.fixture(scope="session")
def config_maker() -> Callable[..., Config]:
    """`make_config` itself, for module- or session-scoped fixtures (root passed explicitly)."""
    return make_config
