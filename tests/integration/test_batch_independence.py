"""Same input, same answer: the int8 variant that is served gives a row the same probabilities
(to 1e-6) and label alone and inside a batch of 255 other rows of a wider range, for every
reference classifier, in ONNX Runtime as the replica calls it and through jobs.predict."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.evaluate.held_out import labeled_batches
from app.runtime import artifact as art
from app.runtime.rows import softmax

pytestmark = pytest.mark.integration
ROWS, MATES = 200, 255


@pytest.fixture(scope="module")
def artifacts(exported):
    def get(workload: str):
        config, result = exported(workload)
        return config, result["artifact"]

    return get


def val_inputs(config, pre) -> dict[str, np.ndarray]:
    batches = [inputs for inputs, _ in labeled_batches(config, pre, "val", batch_rows=512)]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def wider(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Batch mates outside the rows' own range: numbers scaled up to 4x (ids kept valid)."""
    if values.dtype.kind != "f":
        return values
    return (values * rng.uniform(1.0, 4.0, size=(len(values),) + (1,) * (values.ndim - 1))).astype(
        values.dtype
    )


@pytest.mark.parametrize("workload", ["digits", "tabular", "text"])
def test_a_rows_int8_answer_does_not_depend_on_its_batch_mates(artifacts, workload):
    config, uri = artifacts(workload)
    artifact = art.open_artifact(uri)
    assert artifact.report["quantization"]["batch_independent"] is True
    session = artifact.session("int8", 1)  # the variant serve.variant=int8 serves
    inputs = val_inputs(config, artifact.preprocessor)
    n = len(next(iter(inputs.values())))
    rng = np.random.default_rng(0)
    rows = rng.choice(n, size=min(ROWS, n), replace=False)
    alone = np.concatenate(
        [
            softmax(art.run_logits(session, {k: v[i : i + 1] for k, v in inputs.items()}))
            for i in rows
        ]
    )
    # Eight of the rows at a time, each among 255 others: the seven and 248 wider-ranged mates.
    for start in range(0, len(rows), 8):
        picked = rows[start : start + 8]
        mates = rng.integers(0, n, MATES + 1 - len(picked))
        batch = {k: np.concatenate([v[picked], wider(v[mates], rng)]) for k, v in inputs.items()}
        together = softmax(art.run_logits(session, batch))[: len(picked)]
        expected = alone[start : start + len(picked)]
        assert np.abs(together - expected).max() <= 1e-6, (workload, picked.tolist())
        assert (together.argmax(1) == expected.argmax(1)).all()


def test_jobs_predict_gives_each_row_its_answer_alone(artifacts, ray_local, tmp_path):
    """jobs.predict batches rows as Ray Data hands them over; each row's probabilities equal
    what the row gets alone (tabular: its rows are the raw columns the input file holds)."""
    from app.predict.driver import predict
    from app.predict.write import verify_output

    config, uri = artifacts("tabular")
    artifact = art.open_artifact(uri)
    columns = artifact.schema["feature_columns"]
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(ROWS, len(columns))).astype(np.float32) * rng.uniform(1, 4, (ROWS, 1))
    table = {"id": list(range(ROWS)), **{c: rows[:, j] for j, c in enumerate(columns)}}
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table(table), tmp_path / "in" / "part-0.parquet")
    out = str(tmp_path / "out")
    predict(config, uri, str(tmp_path / "in"), out)
    manifest = verify_output(out)
    got = pa.concat_tables([pq.read_table(f"{out}/{s.file}") for s in manifest.files])
    session = artifact.session("int8", 1)
    pre = artifact.preprocessor
    for row_id, probs in zip(got["id"].to_pylist(), got["probabilities"].to_pylist(), strict=True):
        alone = softmax(art.run_logits(session, pre.features(rows[row_id : row_id + 1])))[0]
        assert np.abs(np.asarray(probs) - alone).max() <= 1e-6, row_id
