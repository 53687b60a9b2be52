"""The package builds as `make install` builds it, and its build backend warns of nothing it will
stop accepting: the license an SPDX expression (PEP 639) with the setuptools floor that reads it.
Built in a copy of the checkout, without network (the installed setuptools, no dependencies)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_the_wheel_builds_with_no_deprecation_and_its_license_expression(tmp_path):
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, tmp_path / name)
    for package in ("app", "jobs"):
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "-v", "--no-build-isolation", "--no-deps"]
        + ["--no-index", "-w", "dist"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = build.stdout + build.stderr
    assert build.returncode == 0, out[-3000:]
    warned = [line for line in out.splitlines() if "deprecat" in line.lower()]
    assert not warned, warned
    (wheel,) = (tmp_path / "dist").glob("raytorch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
        assert any(n.endswith("licenses/LICENSE") for n in z.namelist())
    assert "License-Expression: Apache-2.0" in metadata
