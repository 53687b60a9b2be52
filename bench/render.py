"""Render bench/results/*.json as a Markdown table in bench/README.md, and as PNG charts.

    python -m bench.render [--results bench/results] [--readme bench/README.md]

Replaces what lies between `<!-- bench:start -->` and `<!-- bench:end -->` in the README and
nothing else; without those markers it prints the table and says so. Each result with a chart
(bench/charts.py) is drawn as `<results>/<id>.png`, linked under the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from bench.charts import write_charts
from bench.common import REPO, RESULTS_DIR

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def load_results(results_dir: str | Path) -> list[dict[str, Any]]:
    results = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(record, dict) and {"id", "metric", "value", "goal", "met"} <= record.keys():
            results.append(record)
    return sorted(results, key=lambda r: (len(r["id"]), r["id"]))


def _cell(text: Any) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ").strip()


def describe_machine(results: list[dict[str, Any]]) -> str:
    machine = next((r.get("machine") for r in results if r.get("machine")), None)
    if not machine:
        return ""
    flags = machine.get("cpu_flags", {})
    versions = machine.get("versions", {})
    yes = {True: "yes", False: "no"}
    loads = [r["machine"].get("load_average_1m") for r in results if r.get("machine")]
    loads = [x for x in loads if x is not None]
    parts = [
        f"{machine.get('cpu')} ({machine.get('usable_cores')} cores",
        f"avx512_bf16 {yes.get(flags.get('avx512_bf16'), '?')}",
        f"AMX {yes.get(bool(flags.get('amx_bf16') or flags.get('amx_tile')), '?')})",
    ]
    text = ", ".join(parts)
    if machine.get("memory_gib"):
        text += f", {machine['memory_gib']} GiB RAM"
    text += ", GPU " + (machine.get("gpu") or "none")
    text += "; " + ", ".join(
        f"{k} {v}" for k, v in versions.items() if k in ("python", "torch", "ray", "onnxruntime")
    )
    if loads:
        text += f"; 1-min load average while writing results {min(loads):.1f}-{max(loads):.1f}"
    return text


def measured_on(result: dict[str, Any]) -> str:
    """The commit (`+` when the tree differed from it) and day a result was measured; results
    from before commits were recorded say so."""
    commit = result.get("commit") or {}
    day = str(result.get("created", ""))[:10] or "?"
    if not commit.get("sha"):
        return f"not recorded, {day}"
    return f"`{commit['sha'][:7]}{'+' if commit.get('dirty') else ''}`, {day}"


def table(results: list[dict[str, Any]]) -> str:
    met = {True: "yes", False: "**no**", None: "n/a"}
    lines = [
        "| id | what | goal | measured | met | commit, date |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {_cell(r['id'])} | {_cell(r.get('what'))} | {_cell(r['goal'])} | "
            f"{_cell(r.get('summary') or r['value'])} | {met.get(r['met'], _cell(r['met']))} | "
            f"{measured_on(r)} |"
        )
    dates = sorted(r.get("created", "") for r in results if r.get("created"))
    modes = sorted({r.get("mode", "?") for r in results})
    header = []
    machine = describe_machine(results)
    if machine:
        header.append(f"Machine: {machine}.")
    if dates:
        header.append(
            f"Run: {dates[0]} to {dates[-1]} ({', '.join(modes)} mode); `make bench` reproduces it, "
            "details (per-variant numbers, method) are in `bench/results/<id>.json`."
        )
    return "\n\n".join([*header, "\n".join(lines)]) + "\n"


def chart_links(charts: list[Path], base: Path) -> str:
    """One line linking every chart, relative to the README's folder."""
    if not charts:
        return ""
    links = []
    for path in charts:
        try:
            rel = path.resolve().relative_to(base)
        except ValueError:
            rel = path.resolve()
        links.append(f"[{path.stem}]({rel.as_posix()})")
    return "\nCharts: " + " · ".join(links) + "\n"


def replace_block(text: str, block: str) -> str | None:
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        return None
    return pattern.sub(lambda _: f"{START}\n{block}{END}", text, count=1)


def render(
    results_dir: str | Path = RESULTS_DIR, readme: str | Path = REPO / "bench" / "README.md"
) -> str:
    results = load_results(results_dir)
    if not results:
        print(f"render: no results in {results_dir}", file=sys.stderr)
        return ""
    readme = Path(readme)
    charts = write_charts(results, results_dir)
    block = table(results) + chart_links(charts, readme.resolve().parent)
    updated = replace_block(readme.read_text(), block) if readme.exists() else None
    if updated is None:
        print(block)
        print(
            f"render: {readme} has no {START} ... {END} markers; table printed above, README not changed."
        )
    else:
        if updated != readme.read_text():
            readme.write_text(updated)
        print(f"render: updated the benchmark table in {readme} ({len(results)} results)")
    return block


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS_DIR))
    p.add_argument("--readme", default=str(REPO / "bench" / "README.md"))
    args = p.parse_args(argv)
    render(args.results, args.readme)


if __name__ == "__main__":
    main()
