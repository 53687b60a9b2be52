"""Every `from app... import name` (and `from bench...`) in bench/ and jobs/ names something that
exists. Benchmarks import inside their functions, so a function renamed in app/ would otherwise
fail only when that benchmark runs, possibly weeks later."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def project_imports() -> Iterator[tuple[str, str, str]]:
    """(file, module, name) for each absolute `from app|bench... import name` in bench/ and jobs/."""
    for folder in ("bench", "jobs"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.level == 0
                    and (node.module or "").split(".")[0] in ("app", "bench")
                ):
                    for alias in node.names:
                        yield str(path.relative_to(ROOT)), str(node.module), alias.name


def missing(module: str, name: str) -> bool:
    if hasattr(importlib.import_module(module), name):
        return False
    try:  # a submodule
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return True
    return False


def test_every_name_bench_and_jobs_import_from_the_project_exists():
    found = list(project_imports())
    assert len(found) > 50  # the walk sees the benchmarks' imports
    absent = [f"{f}: from {m} import {n}" for f, m, n in found if missing(m, n)]
    assert absent == []
