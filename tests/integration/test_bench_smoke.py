"""The benchmarks at smoke sizes: `python -m bench.run_all --smoke` writes every result file, and
bench.render puts them in the README block between the markers and nowhere else.

`make test` runs the render check on the committed results; the smoke runs (B3 and B4 take
seconds each, the ones that start clusters, train and load servers minutes even at smoke size)
run under the `slow` marker (`make test-all`). It starts its own private Ray (address="local") and Serve
on free ports, never the default ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import REPO

pytestmark = pytest.mark.integration
QUICK = ["B3", "B4"]
ALL = ["B1", "B2", "B3", "B4", "B5a", "B5b", "B5c", "B6", "B8", "B9"]
KEYS = {"id", "metric", "value", "goal", "met", "machine", "details"}


def smoke(root: Path, ids: list[str], timeout: float) -> tuple[Path, subprocess.CompletedProcess]:
    out = root / "results"
    only = ",".join(i for i in ids if i != "B9")  # B9 is written by B1's module
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--smoke", "--only", only, "--out", str(out)]
        + ["--work", str(root / "work")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out, proc


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out, proc = smoke(tmp_path_factory.mktemp("bench"), QUICK, timeout=300)
    return out, proc, time.monotonic() - start


def check_results(out: Path, proc: subprocess.CompletedProcess, ids: list[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for bid in ids:
        record = json.loads((out / f"{bid}.json").read_text())
        assert record.keys() >= KEYS, bid
        assert record["id"] == bid and record["mode"] == "smoke"
        assert "error" not in record["details"], record["details"]
        assert isinstance(record["value"], int | float), (bid, record["value"])
        assert record["met"] in (True, False, None)
        assert record["machine"]["usable_cores"] >= 1 and record["machine"]["versions"]["torch"]
        if bid != "B9":
            assert f"{bid}: " in proc.stdout  # each benchmark prints its ratios last


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_quick_benchmarks_write_their_results(smoke_results):
    out, proc, elapsed = smoke_results
    check_results(out, proc, QUICK)
    print(f"quick smoke benchmarks took {elapsed:.0f}s")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_benchmark_writes_its_result(tmp_path):
    out, proc = smoke(tmp_path, ALL, timeout=1400)
    check_results(out, proc, ALL)


@pytest.mark.timeout(360)
def test_render_replaces_only_the_marked_block(tmp_path):
    import shutil

    from bench.render import END, START, render

    out = tmp_path / "results"  # a copy of the committed results: render redraws the charts
    shutil.copytree(REPO / "bench" / "results", out, ignore=shutil.ignore_patterns("smoke"))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nintro\n\n{START}\nold table\n{END}\n\n## After\ntext\n")
    block = render(out, readme)
    text = readme.read_text()
    assert text.startswith("# Title\n\nintro\n\n" + START) and text.endswith(
        f"{END}\n\n## After\ntext\n"
    )
    assert "old table" not in text
    for bid in QUICK:
        assert f"| {bid} |" in block
        # Its chart: a PNG beside the result, linked under the table.
        chart = Path(out) / f"{bid}.png"
        assert f"[{bid}](" in block
        with Image.open(chart) as image:
            assert image.format == "PNG" and image.size[0] >= 400 and image.size[1] >= 200
    assert "| id | what | goal | measured | met |" in block and "Machine:" in block

    bare = tmp_path / "NO_MARKERS.md"
    bare.write_text("# nothing to replace\n")
    render(out, bare)
    assert bare.read_text() == "# nothing to replace\n"
