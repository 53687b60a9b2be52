"""The benchmarks at smoke sizes: `python -m bench.run_all --smoke` writes every result file, and
bench.render puts them in the README block between the markers and nowhere else.

It starts its own private Ray (address="local") and Serve on free ports, never the default ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]
IDS = ["B1", "B2", "B3", "B4", "B5", "B6"]
KEYS = {"id", "metric", "value", "goal", "met", "machine", "details"}


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, float]:
    root = tmp_path_factory.mktemp("bench")
    out = root / "results"
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run_all",
            "--smoke",
            "--out",
            str(out),
            "--work",
            str(root / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )
    return out, proc, time.monotonic() - start


@pytest.mark.timeout(480)
def test_smoke_run_writes_every_result(smoke_results):
    out, proc, elapsed = smoke_results
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for bid in IDS:
        record = json.loads((out / f"{bid}.json").read_text())
        assert record.keys() >= KEYS, bid
        assert record["id"] == bid and record["mode"] == "smoke"
        assert "error" not in record["details"], record["details"]
        assert isinstance(record["value"], int | float), (bid, record["value"])
        assert record["met"] in (True, False, None)
        assert record["machine"]["usable_cores"] >= 1 and record["machine"]["versions"]["torch"]
        # Each benchmark prints its ratios last.
        assert f"{bid}: " in proc.stdout
    print(f"smoke benchmarks took {elapsed:.0f}s")


@pytest.mark.timeout(480)
def test_render_replaces_only_the_marked_block(smoke_results, tmp_path):
    from bench.render import END, START, render

    out, proc, _ = smoke_results
    assert proc.returncode == 0
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nintro\n\n{START}\nold table\n{END}\n\n## After\ntext\n")
    block = render(out, readme)
    text = readme.read_text()
    assert text.startswith("# Title\n\nintro\n\n" + START) and text.endswith(
        f"{END}\n\n## After\ntext\n"
    )
    assert "old table" not in text
    for bid in IDS:
        assert f"| {bid} |" in block
    assert "| id | what | goal | measured | met |" in block and "Machine:" in block

    bare = tmp_path / "NO_MARKERS.md"
    bare.write_text("# nothing to replace\n")
    render(out, bare)
    assert bare.read_text() == "# nothing to replace\n"
