"""Task `classify`'s gate rule: how much accuracy int8 (or a compiled program) may lose against
fp32, for the ONNX variants (app/tasks/classify/export.py) and the programs
(app/tasks/classify/compiled.py) alike."""

from __future__ import annotations

from typing import Any


def allowed_drop_points(report: dict[str, Any], max_drop: float) -> float:
    """`export.max_accuracy_drop`, but never below one validation sample: on a few hundred rows
    a single flipped prediction is noise, not a quantization loss. A negative setting (tests
    make the gate fire with it) is taken as is."""
    if max_drop < 0:
        return max_drop
    return max(max_drop, 100.0 / max(report["accuracy_rows"], 1))


def accuracy_drop_allowed(report: dict[str, Any], max_drop: float) -> bool:
    return report["accuracy_drop_points"] <= allowed_drop_points(report, max_drop) + 1e-9
