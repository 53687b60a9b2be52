"""Prepare in Ray Data tasks on a real local Ray: a table of several files and Parquet row
groups is read, checked, split and written by tasks, the driver holding only their records; the
shards are byte-identical to the same functions run in one process; the first bad row in source order is refused by file and row, or skipped and
counted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data import table_source
from app.data.pieces import InProcess
from app.data.prepare import MANIFEST
from app.data.ray_tasks import RayTasks
from app.errors import UserError
from app.pipeline.stages import prepare
from tests.conftest import make_config

pytestmark = pytest.mark.integration


def frame(n: int, offset: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(offset)
    out = pd.DataFrame({f"x{i}": rng.normal(size=n) for i in range(4)})
    out["label"] = [f"c{(offset + i) % 3}" for i in range(n)]
    return out


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    """Three files: a Parquet file of 7 row groups, a CSV and a JSON Lines file."""
    root = tmp_path_factory.mktemp("table") / "rows"
    root.mkdir()
    pq.write_table(
        pa.Table.from_pandas(frame(7000), preserve_index=False),
        root / "a.parquet",
        row_group_size=1000,
    )
    frame(1500, 7000).to_csv(root / "b.csv", index=False)
    frame(500, 8500).to_json(root / "c.jsonl", orient="records", lines=True)
    return root


def prepared(tmp_path: Path, name: str, source: Path, tasks, *overrides: str) -> dict:
    config = make_config(
        tmp_path / name,
        "data.source=table",
        f"data.path={source}",
        "data.rows_per_shard=800",
        *overrides,
    )
    return prepare(config, tasks)


def shard_bytes(output: str) -> dict[str, bytes]:
    manifest = json.loads((Path(output) / MANIFEST).read_text())
    return {
        s["file"].split("/", 1)[1]: (Path(output) / s["file"]).read_bytes()
        for entry in manifest["splits"].values()
        for s in entry["shards"]
    }


def test_tasks_write_the_same_shards_as_one_process_in_any_order(
    table, tmp_path, ray_local, monkeypatch
):
    """The pieces (a fixed rule over the source) decide the shards; which task or process ran
    a piece, and when it finished, do not."""
    monkeypatch.setattr(table_source, "ROWS_PER_PIECE", 2000)  # the Parquet file in 4 pieces
    local = prepared(tmp_path, "local", table, InProcess())
    ray = prepared(tmp_path, "ray", table, RayTasks(cpus=0.5))
    assert ray["rows"] == local["rows"] and sum(ray["rows"].values()) == 9000
    assert shard_bytes(ray["output"]) == shard_bytes(local["output"])
    assert ray["throughput"]["rows_per_s"] > 0 and ray["throughput"]["bytes"] > 0
    # A Ray worker that imported pyarrow and wrote Parquet: well above an empty interpreter.
    assert ray["throughput"]["task_peak_rss_mib"] > 50
    val = ray["rows"]["val"] / 9000
    assert abs(val - 0.2) <= 4 * np.sqrt(0.2 * 0.8 / 9000)


def test_the_first_bad_row_in_source_order_is_refused_or_skipped(table, tmp_path, ray_local):
    source = tmp_path / "bad"
    source.mkdir()
    for name in ("a.parquet", "b.csv", "c.jsonl"):
        (source / name).write_bytes((table / name).read_bytes())
    rows = frame(1500, 7000)
    rows.loc[10, "x2"] = np.inf
    rows.loc[900, "label"] = None
    rows.to_csv(source / "b.csv", index=False)
    later = frame(500, 8500).astype({"x0": object})
    later.loc[3, "x0"] = "not a number"
    later.to_json(source / "c.jsonl", orient="records", lines=True)
    with pytest.raises(UserError, match=r"b\.csv row 10: column 'x2': expected a finite number"):
        prepared(tmp_path, "refused", source, RayTasks(cpus=0.5))
    assert not (tmp_path / "refused" / "data" / MANIFEST).exists()
    summary = prepared(tmp_path, "skipped", source, RayTasks(cpus=0.5), "data.skip_bad_rows=true")
    assert summary["skipped"] == 3 and sum(summary["rows"].values()) == 8997
    assert [e.split(": ", 1)[0].rsplit("/", 1)[-1] for e in summary["skipped_examples"]] == [
        "b.csv row 10",
        "b.csv row 900",
        "c.jsonl row 3",
    ]


def image_folder(root: Path, per_class: int = 30) -> Path:
    """Three classes of JPEG and PNG pictures of varied sizes; one JPEG truncated."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (20 + i % 7, 24, 3), dtype=np.uint8)
            pixels[..., c] = 250
            suffix = "jpg" if i % 2 else "png"
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i:03d}.{suffix}")
    broken = root / "class1" / "007.jpg"
    broken.write_bytes(broken.read_bytes()[:200])
    return root


def test_an_image_folder_is_decoded_in_tasks_into_the_same_uint8_shards(
    tmp_path, ray_local, monkeypatch
):
    from app.data import image_folder as folder_source

    monkeypatch.setattr(folder_source, "PICTURES_PER_PIECE", 8)  # 12 pieces, planned here
    root = image_folder(tmp_path / "pictures")

    def run(name: str, tasks, *overrides: str) -> dict:
        config = make_config(
            tmp_path / name,
            "data.source=imagefolder",
            f"data.path={root}",
            "data.image_size=8",
            "data.rows_per_shard=10",
            *overrides,
        )
        return prepare(config, tasks)

    with pytest.raises(UserError, match=r"class1/007\.jpg: unreadable image \(OSError"):
        run("refused", RayTasks(cpus=0.5))
    assert not (tmp_path / "refused" / "data").exists()
    local = run("local", InProcess(), "data.skip_bad_rows=true")
    ray = run("ray", RayTasks(cpus=0.5), "data.skip_bad_rows=true")
    assert ray["skipped"] == 1 and sum(ray["rows"].values()) == 89
    assert shard_bytes(ray["output"]) == shard_bytes(local["output"])
    manifest = json.loads((Path(ray["output"]) / MANIFEST).read_text())
    assert manifest["label_names"] == ["class0", "class1", "class2"]
    shards = [Path(ray["output"]) / s["file"] for s in manifest["splits"]["train"]["shards"]]
    rows = pq.read_table(shards[0]).to_pandas()
    assert {len(v) for v in rows["image"]} == {3 * 8 * 8}  # uint8 pixels, a row's bytes
    pixels = np.frombuffer(b"".join(rows["image"]), np.uint8).reshape(-1, 3, 8, 8)
    for image, label in zip(pixels, rows["label"], strict=True):
        means = image.reshape(3, -1).mean(axis=1)  # its class's channel high, as drawn
        assert means.argmax() == int(label[-1]) and means.max() > 230, means


def test_a_text_corpus_is_tokenized_and_packed_in_tasks_like_one_process(
    tmp_path, ray_local, monkeypatch
):
    from app.data import text_files as corpus

    # This Python's email package (about 0.36 MB): several pieces, planned here.
    monkeypatch.setattr(corpus, "DOCUMENT_BYTES_PER_PIECE", 60_000)

    def run(name: str, tasks) -> dict:
        config = make_config(
            tmp_path / name,
            "data.source=text_files",
            "data.path={stdlib}/email/*.py",
            "data.val_fraction=0.3",
            "model.name=gpt",
            "model.vocab_size=400",
            "model.max_length=32",
            "data.rows_per_shard=100",
        )
        return prepare(config, tasks)

    local, ray = run("local", InProcess()), run("ray", RayTasks(cpus=0.5))
    assert shard_bytes(ray["output"]) == shard_bytes(local["output"])
    ours, theirs = (json.loads((Path(s["output"]) / MANIFEST).read_text()) for s in (ray, local))
    assert ours["kind"] == "tokens" and ours["source"]["vocab_size"] == 400
    assert ours["files"]["tokenizer.json"]["sha256"] == theirs["files"]["tokenizer.json"]["sha256"]
    assert len({s["file"].split("-")[-2] for s in ours["splits"]["train"]["shards"]}) > 1  # pieces


def stall_until(release: str) -> str:
    """A task with no sign of life: it sleeps (no CPU) until `release` exists."""
    import time

    while not Path(release).exists():
        time.sleep(0.05)
    return "released"


def busy_for(seconds: float) -> float:
    """A long task that works throughout: CPU, no result until the end."""
    import time

    end, spins = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        spins += 1
    return seconds


def test_a_task_with_no_sign_of_life_fails_its_stage_naming_it(tmp_path, ray_local):
    release = tmp_path / "release"
    tasks = RayTasks(cpus=0.5, stall_s=3, beat_s=0.5)
    try:
        with pytest.raises(UserError) as stalled:
            tasks.map(stall_until, [str(release)], "prepare: stall test")
    finally:
        release.touch()  # the task returns; its CPU is free for the next test
    message = str(stalled.value)
    assert "\n" not in message
    assert message.startswith("prepare: stall test: no sign of life from its tasks in 3 s")
    assert "data.stall_timeout_s" in message and "0 of 1 task(s) returned, 1 running" in message
    assert re.search(r"task 0 on node [0-9a-f]{12} \(pid \d+\): no CPU used for \d+ s", message)


def test_a_long_task_that_works_is_alive_however_long_it_takes(ray_local):
    """Liveness is CPU, not completed tasks: a 6 s task outlives a 2 s stall limit."""
    assert RayTasks(cpus=0.5, stall_s=2, beat_s=0.5).map(busy_for, [6.0], "busy") == [6.0]
