"""Task `retrieval` from scratch on the local Ray: generated scenes -> a dual encoder trained
with every worker's negatives -> Recall@K -> two gated ONNX encoders -> jobs.predict embeds the
val pictures -> a vector index that a caption searches. Small and short: the full run's bar is
configs/retrieval.yaml's (tests/e2e/test_retrieval_recall.py, slow)."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pyarrow.parquet as pq
import pytest

from app.config import ServeConfig
from app.runtime.types import RequestError, SearchQuery, SearchRequest
from tests.integration.conftest import ensure_local_ray, workload_config

pytestmark = pytest.mark.integration

SHORT = [
    "data.num_rows=500",
    "data.image_size=24",
    "train.epochs=6",
    "train.batch_size=64",
    "train.log_every_steps=1000",
    "export.parity_rows=32",
    "export.latency_repeats=3",
    "train.run_name=retrieval-short",
]


@pytest.fixture(scope="module")
def run(workspace):
    """Prepared, trained, evaluated and exported once for the module."""
    from app.evaluate.held_out import evaluate
    from app.export.exporter import export
    from app.pipeline.stages import prepare
    from app.train.driver import train

    config = workload_config(workspace, "retrieval", *SHORT)
    prepared = prepare(config)
    ensure_local_ray()
    trained = train(config)
    evaluated = evaluate(config, trained["checkpoint"])
    exported = export(config, trained["checkpoint"])
    return {
        "config": config,
        "prepare": prepared,
        "train": trained,
        "evaluate": evaluated,
        "export": exported,
    }


def test_training_learns_to_match_captions_and_pictures_well_above_chance(run):
    metrics = run["evaluate"]["metrics"]
    chance_r5 = 5 * metrics["chance_r1"]
    for direction in ("i2t", "t2i"):
        assert metrics[f"{direction}_r5"] >= 3 * chance_r5, metrics
    assert metrics["rsum"] == pytest.approx(
        sum(metrics[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    )
    # The run ranks checkpoints by the task's default (val_rsum, higher is better).
    assert run["config"].train.checkpoint_metric == "val_rsum"
    assert run["train"]["metrics"]["val_rsum"] == pytest.approx(
        max(h["val_rsum"] for h in run["train"]["history"] if "val_rsum" in h)
    )
    assert run["evaluate"]["plots"]["recall"].endswith(".png")


def test_export_publishes_two_encoders_that_agree_with_torch(run):
    from app.runtime.artifact import open_artifact

    report = run["export"]["report"]
    artifact = open_artifact(run["export"]["artifact"])
    assert set(artifact.graphs) == {"image", "text"}
    assert set(artifact.graphs["image"]) == {"fp32", "int8"}
    assert min(report["parity"]["min_cosine"].values()) >= 0.999
    for variant in ("fp32", "int8"):
        assert {"i2t_r1", "t2i_r1"} <= set(report["recall"][variant])


@pytest.fixture(scope="module")
def embedded(run, workspace):
    """The val pictures as a corpus (one row each), embedded by jobs.predict once for the
    module: (the corpus table, the embeddings folder, predict's summary)."""
    from app.predict.driver import predict
    from app.tasks.retrieval.val_pictures import val_pictures

    corpus = val_pictures(run["config"], str(workspace / "retrieval-corpus"))
    out = str(workspace / "retrieval-embeddings")
    summary = predict(run["config"], run["export"]["artifact"], corpus, out)
    return pq.read_table(corpus), out, summary


def test_predict_embeds_a_corpus_and_the_index_finds_a_captions_picture(run, embedded):
    from app.tasks.index.build import build_index
    from app.tasks.index.replica import SearchServer

    config = run["config"]
    table, out, summary = embedded
    assert summary["rows"] == table.num_rows and summary["rejected"] == 0
    index = build_index(config, out)
    assert index["report"]["vectors"] == table.num_rows

    server = SearchServer(index["artifact"], ServeConfig(variant="fp32"))
    captions = table["caption"].to_pylist()
    ids = table["id"].to_pylist()
    asyncio.run(searches(server, captions, ids))


class CountedIndex:
    """The faiss index, its `search` calls counted (everything else as it is)."""

    def __init__(self, index):
        self.index, self.searches = index, 0

    def search(self, *args):
        self.searches += 1
        return self.index.search(*args)

    def __getattr__(self, name):
        return getattr(self.index, name)


async def searches(server, captions: list[str], ids: list[str]) -> None:
    """One event loop for all (the replica's batcher belongs to the loop it started in)."""
    queries = tuple(SearchQuery(text=c) for c in captions)
    result = await server.search(SearchRequest(queries, 10))
    hits = [ids[i] in [h["id"] for h in hits] for i, hits in enumerate(result.hits)]
    assert np.mean(hits) >= 3 * 10 / len(ids)  # well above chance at 10
    # A stored item's own id finds it first; a filter keeps only matching items.
    first = (await server.search(SearchRequest((SearchQuery(id=ids[0]),), 1))).hits[0]
    assert first[0]["id"] == ids[0] and first[0]["metadata"]["caption"] == captions[0]
    only_request = SearchRequest((SearchQuery(text=captions[0]),), 5, (("caption", captions[1]),))
    only = (await server.search(only_request)).hits[0]
    assert only and all(h["metadata"]["caption"] == captions[1] for h in only)
    # Requests that arrive together share one faiss call, each answered as if alone, a bad
    # one refused on its own.
    together = [
        SearchRequest((SearchQuery(text=captions[0]),), 3),
        SearchRequest((SearchQuery(id=ids[1]), SearchQuery(text=captions[2])), 7),
        SearchRequest((SearchQuery(embedding=np.ones(server.vectors.dim)),), 1),
        only_request,
    ]
    alone = [(await server.search(r)).hits for r in together]
    server.vectors.index = counted = CountedIndex(server.vectors.index)
    wrong = SearchRequest((SearchQuery(embedding=np.ones(3)),), 2)
    answers = await asyncio.gather(
        *(server.search(r) for r in [*together, wrong]), return_exceptions=True
    )
    assert [a.hits for a in answers[:-1]] == alone
    assert isinstance(answers[-1], RequestError) and "3 values" in answers[-1].message
    # The first, alone in the replica, ran at once; the others that came meanwhile were one
    # batch, whose unfiltered requests shared one call.
    assert counted.searches == 2


def test_an_approximate_index_reports_its_recall_against_exact(run, embedded):
    from app.config import Config
    from app.tasks.index.build import build_index

    _, embeddings, _ = embedded
    config: Config = run["config"].model_copy(
        update={
            "index": run["config"].index.model_copy(update={"method": "hnsw", "recall_queries": 20})
        }
    )
    report = build_index(config, embeddings)["report"]
    assert 0.5 <= report["recall_at_10"] <= 1.0
    assert report["peak_rss_mib"] > 0 and report["build_seconds"] >= 0


def test_a_corpus_row_whose_picture_does_not_decode_is_rejected_and_named(run, embedded, workspace):
    import pyarrow as pa

    from app.predict.driver import predict

    config = run["config"]
    good = embedded[0].slice(0, 3)
    broken = good["image"].to_pylist()
    broken[1] = broken[1][:40]  # a truncated PNG: its header reads, its pixels do not
    table = good.set_column(good.schema.get_field_index("image"), "image", pa.array(broken))
    path = workspace / "broken-corpus.parquet"
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    path.write_bytes(buffer.getvalue())
    config = config.model_copy(
        update={"predict": config.predict.model_copy(update={"on_bad_rows": "reject"})}
    )
    summary = predict(config, run["export"]["artifact"], str(path), str(workspace / "broken-out"))
    assert summary["rows"] == 3 and summary["rejected"] == 1
    [example] = summary["bad_rows"]["examples"]
    assert example["id"] == good["id"][1].as_py() and "column 'image'" in example["reason"]


@pytest.mark.slow
def test_both_encoders_export_every_program_and_a_replica_serves_the_pt2(run):
    from PIL import Image

    from app.data.kinds.image_text import PictureLimits
    from app.export.exporter import export
    from app.runtime.artifact import open_artifact
    from app.tasks.retrieval.replica import Encoders
    from tests.integration.test_programs import with_every_format

    config = with_every_format(run["config"], "retrieval-programs")
    result = export(config, run["train"]["checkpoint"])
    programs = result["report"]["programs"]
    # Every program builds, and each passes the gate (cosine, recall, batch drift) here.
    assert {v: p.get("reason") for v, p in programs.items()} == dict.fromkeys(
        ("aoti", "executorch", "executorch_int8")
    ), programs
    artifact = open_artifact(result["artifact"])
    files = {f"{g}{s}" for g in ("image", "text") for s in (".pt2", ".pte", ".int8.pte")}
    assert set(artifact.manifest.programs) == files
    assert "aoti" in artifact.servable()
    rng = np.random.default_rng(0)
    pictures = []
    for _ in range(3):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(buffer, "PNG")
        pictures.append(buffer.getvalue())
    items = ("a red circle", "two blue squares", *pictures)
    fp32, _ = Encoders(artifact, "fp32", 1).embed(items, "input", PictureLimits(max_pixels=10**7))
    aoti, _ = Encoders(artifact, "aoti", 1).embed(items, "input", PictureLimits(max_pixels=10**7))
    cosine = (fp32 * aoti).sum(1) / (np.linalg.norm(fp32, axis=1) * np.linalg.norm(aoti, axis=1))
    assert cosine.min() >= config.export.min_cosine


def embeddings_by_id(output: str) -> dict[str, np.ndarray]:
    from app import storage
    from app.predict.write import verify_output

    manifest = verify_output(output)
    tables = [pq.read_table(storage.join(output, s.file)) for s in manifest.files]
    return {
        row_id: np.asarray(vector, np.float32)
        for t in tables
        for row_id, vector in zip(t["id"].to_pylist(), t["embedding"].to_pylist(), strict=True)
    }


def test_predict_embeds_a_folder_of_pictures_and_a_table_naming_them(run, embedded, workspace):
    """Pictures under a folder (subfolders too) are embedded with their relative path as id, and
    a CSV whose image column names pictures by path reads them under its own folder; both give
    the embeddings of the same pictures given as bytes. A path outside the folder is a
    rejected row, named."""
    from app.predict.driver import predict

    config = run["config"].model_copy(
        update={"predict": run["config"].predict.model_copy(update={"on_bad_rows": "reject"})}
    )
    table, bytes_out, _ = embedded
    root = workspace / "picture-table"
    names = []
    pictures, ids = table["image"].to_pylist()[:12], table["id"].to_pylist()[:12]
    for i, (data, pid) in enumerate(zip(pictures, ids, strict=True)):
        name = f"{'a' if i % 2 else 'b/c'}/{i:02d}.png"
        (root / "pics" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "pics" / name).write_bytes(data)
        names.append((name, pid))
    (root / "pics" / ".hidden.png").write_bytes(b"left out")
    (workspace / "elsewhere.png").write_bytes(table["image"][0].as_py())
    expected = embeddings_by_id(bytes_out)

    folder = predict(config, run["export"]["artifact"], str(root / "pics"), str(root / "out-a"))
    assert folder["rows"] == 12 and folder["rejected"] == 0
    got = embeddings_by_id(str(root / "out-a"))
    assert sorted(got) == sorted(n for n, _ in names)
    for name, pid in names:
        np.testing.assert_allclose(got[name], expected[pid], atol=1e-5)

    paths = [f"pics/{n}" for n, _ in names] + ["../elsewhere.png"]
    with open(root / "pairs.csv", "w") as f:
        f.write("id,image,note\n")
        f.writelines(f"row{i},{p},n{i}\n" for i, p in enumerate(paths))
    summary = predict(config, run["export"]["artifact"], str(root / "pairs.csv"), str(root / "b"))
    assert summary["rows"] == 13 and summary["rejected"] == 1
    [bad] = summary["bad_rows"]["examples"]
    assert bad["id"] == "row12" and "cannot read" in bad["reason"], bad
    got = embeddings_by_id(str(root / "b"))
    for i, (_, pid) in enumerate(names):
        np.testing.assert_allclose(got[f"row{i}"], expected[pid], atol=1e-5)


@pytest.mark.parametrize("side", ["image", "text"])
def test_one_pretrained_tower_trains_beside_one_from_scratch(workspace, side):
    """LiT's recipe (a pretrained ViT image tower, locked; a text tower from scratch) and its
    mirror (a pretrained BERT-family text tower, locked; an image tower from scratch): the loss
    falls, and the locked tower is the folder's encoder exactly (its weights as saved)."""
    import torch

    from app.pipeline.stages import prepare
    from app.train.checkpoint import load_checkpoint
    from app.train.driver import train
    from tools.make_tiny_pretrained import make_bert, make_vit

    make = make_vit if side == "image" else make_bert
    folder = make(str(workspace / f"tower-{side}"))
    config = workload_config(
        workspace,
        "retrieval",
        *SHORT,
        "data.num_rows=200",
        "train.epochs=3",
        "train.num_workers=1",  # what is asserted does not depend on the rank count
        f"model.pretrained_{side}={folder}",
        f"train.freeze={side}",
        f"data.output={workspace}/data/one-tower-{side}",
        f"train.run_name=one-tower-{side}",
    )
    prepare(config)
    ensure_local_ray()
    trained = train(config)
    losses = [h["train_loss"] for h in trained["history"] if "train_loss" in h]
    assert losses[-1] < losses[0], losses
    from app.models.families import family_of
    from app.pretrained import open_pretrained

    model = load_checkpoint(trained["checkpoint"]).model
    own = getattr(model, side).encoder.state_dict()
    base = open_pretrained(folder)
    saved = family_of(base).rename(base.weights())
    assert saved and all(torch.equal(own[k], v) for k, v in saved.items()), sorted(saved)[:3]
    other = model.text if side == "image" else model.image
    assert not hasattr(other, "encoder")  # the other tower is the project's own
