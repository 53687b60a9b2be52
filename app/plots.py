"""PNG pictures of what the jobs measured: confusion matrix, training curves, fp32 vs int8, and
benchmark charts. Each function returns PNG bytes, which the caller writes with app/storage.py
(so a picture goes to an object store like any other output).

matplotlib is imported inside the functions (nothing at import time, and serving never pays for
it), and figures are built with `matplotlib.figure.Figure` rather than pyplot: no global figure
state, no GUI backend; `savefig` renders with Agg.
"""

from __future__ import annotations

import io
from typing import Any

DPI = 100
COLORS = {"fp32": "#4c72b0", "int8": "#dd8452", "train": "#4c72b0", "val": "#dd8452"}


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def confusion_matrix(matrix: list[list[int]], labels: list[str], title: str = "") -> bytes:
    """Rows: true label, columns: predicted; each cell shows its count, shaded by its share of
    the row (recall), so a weak class stands out whatever its support."""
    import numpy as np

    counts = np.asarray(matrix, dtype=float)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    n = len(labels)
    size = min(3 + 0.45 * n, 12)
    fig = _figure(size + 1, size)
    ax = fig.add_subplot()
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, label="share of the true class", shrink=0.8)
    tilt = n > 6 and max(len(str(label)) for label in labels) > 2  # long names would overlap
    ax.set_xticks(range(n), labels, rotation=45 if tilt else 0, ha="right" if tilt else "center")
    ax.set_yticks(range(n), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title or "confusion matrix")
    if n <= 30:  # counts stay readable up to about 30 classes
        for i in range(n):
            for j in range(n):
                if counts[i, j]:
                    color = "white" if shares[i, j] > 0.5 else "black"
                    ax.text(j, i, f"{int(counts[i, j])}", ha="center", va="center", color=color)
    return _png(fig)


def training_curves(
    history: list[dict[str, Any]], marked_epoch: int | None = None, title: str = ""
) -> bytes:
    """Loss (train and val), val accuracy, learning rate and throughput per epoch; a dashed line
    marks `marked_epoch` (the evaluated checkpoint)."""
    from matplotlib.ticker import MaxNLocator

    epochs = [int(m["epoch"]) for m in history]
    fig = _figure(10, 6.5)
    axes = fig.subplots(2, 2, sharex=True).flatten()
    panels = [
        ("loss", [("train_loss", "train"), ("val_loss", "val")]),
        ("val accuracy", [("val_accuracy", "val")]),
        ("learning rate", [("learning_rate", "train")]),
        ("samples/s", [("samples_per_second", "train")]),
    ]
    for ax, (name, series) in zip(axes, panels, strict=True):
        for key, color in series:
            values = [m.get(key) for m in history]
            if any(v is not None for v in values):
                ax.plot(epochs, values, marker="o", ms=3, color=COLORS[color], label=key)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        if marked_epoch is not None:
            ax.axvline(marked_epoch, color="grey", ls="--", lw=1)
        if len(series) > 1:
            ax.legend()
    for ax in axes[2:]:
        ax.set_xlabel("epoch")
    fig.suptitle(title or "training")
    return _png(fig)


def quantization(quality: Any, sizes: dict[str, int], title: str = "") -> bytes:
    """fp32 vs int8 from export's report, whatever the task: its quality metric for each
    variant (`quality`, an app/export/exporter.py `Quality`), model size, latency by setting."""
    fig = _figure(11, 3.8)
    quality_ax, size_ax, lat_ax = fig.subplots(1, 3)
    names = list(quality.values)
    shown = [quality.shown * quality.values[n] for n in names]
    bars = quality_ax.bar(
        names, shown, color=[COLORS["int8" if n.endswith("int8") else "fp32"] for n in names]
    )
    quality_ax.bar_label(bars, fmt="%.2f" if max(shown, default=0) >= 10 else "%.4g")
    if quality.higher_is_better and quality.shown == 100.0:  # a percentage: its top is 100
        quality_ax.set_ylim(max(0.0, min(shown, default=0) - 5), 100.5)
    better = "higher" if quality.higher_is_better else "lower"
    quality_ax.set_title(f"{quality.metric} ({better} is better)", fontsize=9)
    bars = size_ax.bar(
        ["fp32", "int8"],
        [sizes["fp32"] / 1024, sizes["int8"] / 1024],
        color=[COLORS["fp32"], COLORS["int8"]],
    )
    size_ax.bar_label(bars, fmt="%.0f")
    size_ax.set_title(f"size (KiB), int8 = {sizes['int8'] / sizes['fp32']:.2f}x fp32")
    latency = quality.latency_ms
    settings = list(latency.get("fp32", {}))
    width = 0.38
    for k, variant in enumerate(("fp32", "int8")):
        xs = [i + (k - 0.5) * width for i in range(len(settings))]
        values = [latency.get(variant, {}).get(s, 0.0) for s in settings]
        bars = lat_ax.bar(xs, values, width, label=variant, color=COLORS[variant])
        lat_ax.bar_label(bars, fmt="%.3f", fontsize=8)
    lat_ax.set_xticks(range(len(settings)), [s.replace("_", " ") for s in settings], fontsize=8)
    lat_ax.set_title("ONNX Runtime latency (ms, median)")
    lat_ax.legend()
    for ax in (quality_ax, size_ax, lat_ax):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or "fp32 vs int8")
    return _png(fig)


def grouped_bars(
    groups: dict[str, dict[str, float]], title: str, ylabel: str, log: bool = False
) -> bytes:
    """One cluster of bars per group (x axis), one bar per series (legend): the benchmark charts."""
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    fig = _figure(max(5.0, 1.2 + 1.1 * len(groups) * max(1, len(series)) / 2), 3.8)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    for k, name in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        values = [groups[g].get(name, 0.0) for g in groups]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _png(fig)


def recall_curve(recall_at: dict[str, list[float]], title: str = "") -> bytes:
    """Recall@K (in %) for K = 1.. in each direction of a retrieval model."""
    fig = _figure(6, 4)
    ax = fig.subplots()
    for name, values in recall_at.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", ms=3, label=name)
    ax.set_xlabel("K")
    ax.set_ylabel("recall@K (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title or "retrieval")
    return _png(fig)
