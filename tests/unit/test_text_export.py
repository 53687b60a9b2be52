"""A text model's ONNX graph takes any sequence length up to max_length, and a batch cut to its
own longest row answers exactly as the same rows padded to max_length (what lets serving trim)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app.models.transformer import TransformerClassifier
from app.runtime.artifact import create_session
from app.tasks.classify.export import export_onnx

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


def test_static_linear_quantizes_the_linear_layers_alone_and_keeps_rows_independent(tmp_path):
    """`static_linear`: each MatMul with a weight reads int8 (a DequantizeLinear), attention's
    activation x activation MatMuls read none, the token table is int8 rows, and a row's logits
    alone equal its logits among other rows (the scales are constants)."""
    import onnx

    from app.export import quantize as q

    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=2000, num_classes=3, dim=32, heads=2, ff_dim=64)
    text = SimpleNamespace(
        kind="text", variable_length=True, input_names=lambda: ["input_ids", "attention_mask"]
    )
    rng = np.random.default_rng(0)

    def rows(n: int) -> dict[str, np.ndarray]:
        ids = rng.integers(1, 2000, (n, 12)).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    fp32, prepared, int8 = (str(tmp_path / f) for f in ("m.onnx", "p.onnx", "q.onnx"))
    export_onnx(model.eval(), text, rows(2), fp32, opset=17)  # type: ignore[arg-type]
    q.prepare_for_quantization(fp32, prepared)
    q.quantize(prepared, int8, "static_linear", [rows(8), rows(8)], [], per_channel=False)
    graph = onnx.load(int8).graph
    made = {out: node.op_type for node in graph.node for out in node.output}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    attention = set(q.activation_matmuls(prepared))
    assert attention and len(matmuls) > len(attention)
    for node in matmuls:
        reads_int8 = any(made.get(i) == "DequantizeLinear" for i in node.input)
        assert reads_int8 == (node.name not in attention), node.name
    tables = [i for i in graph.initializer if list(i.dims) == [2000, 32]]
    assert [t.data_type for t in tables] == [onnx.TensorProto.INT8]
    session = create_session(int8, 1)
    batch = rows(16)
    together = session.run(["logits"], batch)[0]
    alone = session.run(["logits"], {k: v[:1] for k, v in batch.items()})[0]
    assert np.abs(together[:1] - alone).max() <= 1e-6
