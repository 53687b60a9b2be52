"""Export of each reference workload from a short training run, and the gate on a real model."""

from __future__ import annotations

import os

import pytest

from app.errors import GateError
from app.export.exporter import export
from app.runtime.artifact import open_artifact

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "workload,method,max_size",
    [("digits", "static", None), ("tabular", "static", 0.35), ("text", "static_linear", 0.3)],
)
def test_export_meets_parity_accuracy_and_size(exported, workload, method, max_size):
    config, result = exported(workload)
    report = result["report"]
    assert report["parity"]["max_abs_diff"] <= config.export.parity_tolerance
    assert report["parity"]["label_agreement"] == 1.0
    acc = report["accuracy"]
    assert abs(acc["onnx_fp32"] - acc["torch_fp32"]) < 1e-9
    assert report["accuracy_drop_points"] <= 1.0  # int8 within 1 point of fp32
    # Static activation scales everywhere cost the text Transformer's attention accuracy: its
    # Linear layers alone are quantized.
    assert report["quantization"]["method"] == method
    assert report["quantization"]["batch_independent"] is True
    if max_size is not None:
        assert report["size_ratio_int8"] <= max_size
    for variant in ("fp32", "int8"):
        assert report["latency_ms"][variant]["batch_32"] > 0
    artifact = open_artifact(result["artifact"])
    assert artifact.report == report and artifact.name == workload


def test_gate_refuses_and_publishes_nothing(trained):
    config, summary = trained("tabular")
    strict = config.model_copy(
        update={"export": config.export.model_copy(update={"max_accuracy_drop": -1.0})}
    )
    registry = os.path.join(strict.registry, strict.artifact_name)
    before = sorted(os.listdir(registry)) if os.path.isdir(registry) else []
    with pytest.raises(GateError, match=r"int8 accuracy .* below fp32") as info:
        export(strict, summary["checkpoint"])
    assert info.value.exit_code == 3
    after = sorted(os.listdir(registry)) if os.path.isdir(registry) else []
    assert after == before
