"""jobs.predict end to end on the local Ray: a tabular artifact scores a few thousand rows, bad
rows included, and the output equals running the artifact directly."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.errors import UserError
from app.predict.driver import predict
from app.predict.write import verify_output
from app.runtime.artifact import open_artifact, run_logits
from app.runtime.rows import softmax

pytestmark = pytest.mark.integration

ROWS_PER_FILE = 1500  # two files: 3000 rows


@pytest.fixture(scope="module")
def artifact(exported):
    config, result = exported("tabular")
    return config, result["artifact"]


def scoring_input(folder, columns: list[str]) -> dict[int, str]:
    """Two Parquet files of breast-cancer-like rows, ids 0..2999; returns id -> planted problem."""
    rng = np.random.default_rng(0)
    bad: dict[int, str] = {}
    folder.mkdir()
    for part in range(2):
        ids = np.arange(part * ROWS_PER_FILE, (part + 1) * ROWS_PER_FILE)
        values = rng.normal(1.0, 0.5, (len(ids), len(columns))) * rng.uniform(
            0.1, 100, len(columns)
        )
        table = {"id": pa.array(ids), "extra": pa.array(["ignored"] * len(ids))}
        for j, name in enumerate(columns):
            column = values[:, j].tolist()
            if j == 3:  # a few NaN and null values in one column
                for i in range(part, len(ids), 400):
                    column[i] = None if i % 800 == part else float("nan")
                    bad[int(ids[i])] = "null" if column[i] is None else "not a finite number"
            table[name] = pa.array(column, pa.float64())
        pq.write_table(pa.table(table), folder / f"part-{part}.parquet")
    return bad


def test_predict_matches_the_artifact_and_rejects_bad_rows(artifact, ray_local, tmp_path):
    config, uri = artifact
    loaded = open_artifact(uri)
    columns = loaded.schema["feature_columns"]
    planted = scoring_input(tmp_path / "in", columns)
    # int8, as served: a row's answer does not depend on the rows that share its batch.
    config = config.model_copy(
        update={
            "predict": config.predict.model_copy(
                update={"on_bad_rows": "reject", "variant": "int8", "batch_size": 500}
            )
        }
    )
    out = str(tmp_path / "out")
    summary = predict(config, uri, str(tmp_path / "in"), out)

    assert (summary["rows"], summary["rejected"]) == (3000, len(planted))
    assert summary["model"] == loaded.name and summary["version"] == loaded.version
    assert len(summary["bad_rows"]["examples"]) == config.predict.max_examples
    by_reason = {r["reason"]: r for r in summary["bad_rows"]["reasons"]}  # counted by reason
    nulls = sum(why == "null" for why in planted.values())
    assert by_reason[f"column {columns[3]!r}: null"]["rows"] == nulls
    assert sum(r["rows"] for r in by_reason.values()) == len(planted)
    assert all(r["first"].startswith("id ") for r in by_reason.values())
    manifest = verify_output(out)  # every part's sha256 against the manifest
    assert manifest.rows == {"input": 3000, "output": 3000 - len(planted), "rejected": len(planted)}
    predictions = pa.concat_tables([pq.read_table(f"{out}/{s.file}") for s in manifest.files])
    rejects = pa.concat_tables([pq.read_table(f"{out}/{s.file}") for s in manifest.rejects])

    # Rejects: exactly the planted rows, each with its reason and its values.
    reasons = dict(zip(rejects["id"].to_pylist(), rejects["reason"].to_pylist(), strict=True))
    assert {int(i) for i in reasons} == set(planted)
    for i, reason in reasons.items():
        assert reason.startswith(f"column {columns[3]!r}: {planted[int(i)]}")
    assert json.loads(rejects["row"][0].as_py())["id"] == int(rejects["id"][0].as_py())

    # Predictions: equal to the artifact run directly on the same rows.
    source = pa.concat_tables([pq.read_table(f) for f in sorted((tmp_path / "in").iterdir())])
    keep = np.asarray([i not in planted for i in source["id"].to_pylist()])
    raw = np.stack([source[c].to_numpy() for c in columns], axis=1)[keep]
    expected = softmax(
        run_logits(loaded.session("int8"), loaded.preprocessor.features(raw.astype(np.float32)))
    )
    order = np.argsort(predictions["id"].to_numpy())
    got = np.asarray(predictions["probabilities"].to_pylist(), np.float32)[order]
    assert predictions["id"].to_numpy()[order].tolist() == source["id"].to_numpy()[keep].tolist()
    np.testing.assert_allclose(got, expected, atol=1e-5)
    labels = np.asarray(loaded.preprocessor.labels)[expected.argmax(1)]
    assert np.asarray(predictions["label"].to_pylist())[order].tolist() == labels.tolist()
    assert set(predictions["model_version"].to_pylist()) == {loaded.version}


def test_fail_mode_stops_on_a_bad_json_line_and_publishes_nothing(artifact, ray_local, tmp_path):
    config, uri = artifact
    columns = open_artifact(uri).schema["feature_columns"]
    rows = [{"id": i, **dict.fromkeys(columns, 1.0)} for i in range(50)]
    lines = [json.dumps(r) for r in rows]
    lines[7] = lines[7].replace("1.0", '"n/a"', 1)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(
        UserError, match=rf"malformed rows .*id 7: column '{columns[0]}': not a num"
    ):
        predict(config, uri, str(tmp_path / "in.jsonl"), str(out))
    assert not out.exists()


def test_predict_without_the_cpus_it_needs_says_so_in_one_line_within_seconds(
    artifact, ray_local, tmp_path
):
    """A quarter of a CPU left (an actor holds the rest): the run's inference actor needs 0.5
    and says so, instead of waiting forever."""
    import time

    import ray

    config, uri = artifact
    scoring_input(tmp_path / "in", open_artifact(uri).schema["feature_columns"])
    hold = None
    free = settled_free_cpus()
    if free > 0.25:
        hold = ray.remote(num_cpus=free - 0.25)(Holder).remote()
        ray.get(hold.ready.remote(), timeout=60)
    started = time.monotonic()
    try:
        with pytest.raises(
            UserError, match=r"predict: needs 0\.5 free CPUs for an inference actor"
        ):
            predict(config, uri, str(tmp_path / "in"), str(tmp_path / "out"))
    finally:
        if hold is not None:
            ray.kill(hold)
    assert time.monotonic() - started < 15
    assert not (tmp_path / "out").exists()


def settled_free_cpus() -> float:
    """Free CPUs once Ray's view of them has stopped changing (actors of earlier tests may
    still be going away)."""
    import time

    import ray

    last = -1.0
    for _ in range(40):
        free = ray.available_resources().get("CPU", 0.0)
        if free == last:
            return free
        last = free
        time.sleep(0.5)
    return last


class Holder:
    def ready(self) -> bool:
        return True
