"""bench/gpu_check.py runs on CPU (fp32, bf16) and reports what it promises; on a CUDA box it
also runs fp16 + GradScaler (marked gpu)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import gpu_check

pytestmark = pytest.mark.unit


def test_gpu_check_smoke_on_this_machine(tmp_path):
    report = gpu_check.main(
        ["--steps", "6", "--batch", "8", "--scale", "1", "--out", str(tmp_path)]
        + ["--serving-smoke"]
    )
    expected = {"fp32", "bf16", "fp16"} if torch.cuda.is_available() else {"fp32", "bf16"}
    assert set(report["results"]) == {"cnn", "mlp", "transformer"}
    for family in report["results"].values():
        assert set(family) == expected
        assert family["fp32"]["speedup_vs_fp32"] == 1.0
        # Same weights, same batches: bf16 ends close to fp32 after a few steps.
        assert family["bf16"]["loss_rel_diff_vs_fp32"] < 0.05
    serving = report["serving_batching_ceiling"]
    assert set(serving["models"]) == {"digits_cnn", "tabular_mlp", "text_transformer"}
    for row in serving["models"].values():  # batch 1 vs 16 per row, both measured
        assert row["ms_per_row_batch_1"] > 0 and row["ms_per_row_batch_16"] > 0
        assert row["ceiling"] > 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert json.loads((tmp_path / f"gpu_check_{device}.json").read_text())["results"]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: fp16 + GradScaler runs only there"
)
def test_fp16_grad_scaler_step_on_cuda(tmp_path):
    report = gpu_check.main(
        ["--steps", "10", "--batch", "32", "--out", str(tmp_path), "--no-serving"]
    )
    for family in report["results"].values():
        assert family["fp16"]["loss_rel_diff_vs_fp32"] < 0.05
