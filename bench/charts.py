"""Benchmark results as PNG charts: each result's side-by-side comparison, drawn from the per-
variant numbers its JSON already holds (`details`). bench/render.py calls `write_charts` beside
the README table; a result this module has no chart for is skipped, never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Groups = dict[str, dict[str, float]]  # x-axis group -> series -> value
Chart = tuple[str, str, Groups, bool]  # title, y label, bars, log scale


def b1(d: dict[str, Any]) -> Chart:
    groups = {case: dict(c["steady_epoch_s"]) for case, c in d["cases"].items()}
    return "B1 steady epoch time: Ray Train vs plain DDP", "seconds per epoch", groups, True


def b2(d: dict[str, Any]) -> Chart:
    names = {
        "torch_dataloader_1_worker": "DataLoader",
        "ray_data_streamed": "Ray Data streamed",
        "worker_cache_fill_pass": "cache fill pass",
        "worker_cache_steady": "worker cache",
    }
    groups = {label: {"rows/s": d[key]["median_rows_per_s"]} for key, label in names.items()}
    return "B2 ingest throughput (one consumer)", "rows/s", groups, True


def b3(d: dict[str, Any]) -> Chart:
    groups = {
        case: {"fp32": t["fp32_steps_per_s"], "bf16": t["bf16_steps_per_s"]}
        for case, t in d["throughput"].items()
    }
    return "B3 training steps/s: bf16 vs fp32 on CPU", "steps/s", groups, True


def b4(d: dict[str, Any]) -> Chart:
    groups = {
        model: {v: m["latency_ms"][v]["batch_32"]["p50_ms"] for v in m["latency_ms"]}
        for model, m in d["models"].items()
    }
    return "B4 latency at batch 32 (p50)", "ms", groups, True


def by_connections(d: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{"<n> connections": {side: req/s}} from a wrk benchmark's `by_connections`."""
    return {
        f"{n} conn": {side: r["requests_per_s"] for side, r in sides.items()}
        for n, sides in d["by_connections"].items()
    }


def b5a(d: dict[str, Any]) -> Chart:
    return "B5a Serve vs plain uvicorn + ONNX Runtime", "requests/s", by_connections(d), False


def b5c(d: dict[str, Any]) -> Chart:
    return "B5c Serve vs LitServe (Transformer)", "requests/s", by_connections(d), False


def b8(d: dict[str, Any]) -> Chart:
    groups = {
        f"{size} ({s['train_rows']} rows)": {"peak PSS": s["peak_pss_bytes"] / 2**30}
        for size, s in d["sizes"].items()
        if s.get("peak_pss_bytes")
    }
    return "B8 streaming ingest: peak memory", "GiB", groups, False


def b9(d: dict[str, Any]) -> Chart:
    groups = {case: dict(c["to_first_step_s"]) for case, c in d.items() if "to_first_step_s" in c}
    return "B9 launch to first optimizer step", "seconds", groups, False


CHARTS: dict[str, Callable[[dict[str, Any]], Chart]] = {
    "B1": b1,
    "B2": b2,
    "B3": b3,
    "B4": b4,
    "B5a": b5a,
    "B5c": b5c,
    "B8": b8,
    "B9": b9,
}


def chart_for(result: dict[str, Any]) -> Chart | None:
    """The chart of one result, or None when it has none or its details lack the numbers."""
    extract = CHARTS.get(result.get("id", ""))
    if extract is None:
        return None
    try:
        title, ylabel, groups, log = extract(result.get("details") or {})
    except (KeyError, TypeError, AttributeError):
        return None  # a result written by an older bench: no chart rather than a wrong one
    return (title, ylabel, groups, log) if groups else None


def write_charts(results: list[dict[str, Any]], folder: str | Path) -> list[Path]:
    """`<folder>/<id>.png` for every result that has a chart; the paths written."""
    from app.plots import grouped_bars

    written = []
    for result in results:
        chart = chart_for(result)
        if chart is None:
            continue
        title, ylabel, groups, log = chart
        path = Path(folder) / f"{result['id']}.png"
        path.write_bytes(grouped_bars(groups, title, ylabel, log=log))
        written.append(path)
    return written
