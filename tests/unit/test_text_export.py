"""A text model's ONNX graph takes any sequence length up to max_length, and a batch cut to its
own longest row answers exactly as the same rows padded to max_length (what lets serving trim)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app.export.exporter import export_onnx
from app.models.transformer import TransformerClassifier
from app.runtime.artifact import create_session

pytestmark = pytest.mark.unit


def test_text_graph_has_a_free_sequence_axis_and_trimming_changes_nothing(tmp_path):
    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=50, num_classes=3, dim=16, heads=2, ff_dim=32).eval()
    text = SimpleNamespace(
        kind="text", variable_length=True, input_names=lambda: ["input_ids", "attention_mask"]
    )
    lengths = [5, 9, 3]
    ids = np.zeros((3, 32), np.int64)
    mask = np.zeros((3, 32), np.int64)
    rng = np.random.default_rng(0)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, 50, n)
        mask[row, :n] = 1
    path = str(tmp_path / "model.onnx")
    export_onnx(model, text, {"input_ids": ids, "attention_mask": mask}, path, opset=17)  # type: ignore[arg-type]
    with open(path, "rb") as f:
        session = create_session(f.read())
    [ids_input, _] = session.get_inputs()
    assert ids_input.shape == ["batch", "sequence"]
    full = session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
    longest = max(lengths)
    cut = session.run(
        ["logits"], {"input_ids": ids[:, :longest], "attention_mask": mask[:, :longest]}
    )[0]
    np.testing.assert_allclose(cut, full, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(full, expected, rtol=1e-4, atol=1e-4)
