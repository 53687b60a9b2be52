"""Registry listing and pruning (app.serve.control.lifecycle) on a local registry; no cluster involved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config import Config
from app.errors import ConfigError, UserError
from app.runtime.artifact import LATEST, MANIFEST
from app.serve.control import lifecycle

pytestmark = pytest.mark.unit


def make_version(registry: Path, name: str, version: int, complete: bool = True) -> None:
    folder = registry / name / str(version)
    folder.mkdir(parents=True)
    report = {
        "accuracy": {"onnx_fp32": 0.99, "onnx_int8": 0.985},
        "accuracy_drop_points": 0.5,
        "size_ratio_int8": 0.3,
        "thresholds": {"max_accuracy_drop": 0.5},
    }
    (folder / "report.json").write_text(json.dumps(report))
    if complete:
        manifest = {"name": name, "version": str(version), "files": {}, "created": f"day {version}"}
        (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    root = tmp_path / "registry"
    for v in (1, 2, 3, 4):
        make_version(root, "digits", v)
    make_version(root, "digits", 5, complete=False)  # an export still writing it
    (root / "digits" / LATEST).write_text("3")  # 4 was published but latest is pinned back
    make_version(root, "text", 1)
    (root / "text" / LATEST).write_text("1")
    (root / "stray").mkdir()  # not a model: no latest pointer
    return root


def test_listing_shows_versions_gate_latest_and_unknown_live_without_cluster(registry):
    entry = lifecycle.model_entry(str(registry), "digits", live=None)
    assert entry["latest"] == "3" and entry["live"] == "unknown"
    assert [v["version"] for v in entry["versions"]] == ["1", "2", "3", "4"]  # 5 is incomplete
    third = entry["versions"][2]
    assert third["latest"] is True and third["live"] == "unknown"
    assert third["gate"]["int8_accuracy"] == 0.985 and third["created"] == "day 3"
    assert lifecycle.model_names(str(registry)) == ["digits", "text"]


def test_listing_marks_the_live_version(registry):
    entry = lifecycle.model_entry(str(registry), "digits", live={"digits": "2"})
    assert [v["live"] for v in entry["versions"]] == [False, True, False, False]
    assert lifecycle.model_entry(str(registry), "text", live={})["live"] is None


def test_prune_keeps_newest_latest_and_live_and_incomplete(registry):
    deleted = lifecycle.prune_model(str(registry), "digits", keep=1, in_use={"1"})
    assert deleted == ["2"]  # 4 newest, 3 latest, 1 live, 5 still being written
    assert sorted(p.name for p in (registry / "digits").iterdir()) == ["1", "3", "4", "5", LATEST]
    assert lifecycle.prune_model(str(registry), "digits", keep=1, in_use={"1"}) == []


def test_prune_refuses_bad_keep_unknown_model_and_names_that_leave_the_registry(registry):
    config = Config.model_validate({"export": {"registry": str(registry)}})
    with pytest.raises(ConfigError, match="--keep"):
        lifecycle.prune(config, 0)
    with pytest.raises(UserError, match="no such model"):
        lifecycle.prune(config, 1, model="nope", force=True)
    with pytest.raises(ConfigError, match="not a model name"):
        lifecycle.prune(config, 1, model="../digits", force=True)
    assert lifecycle.prune(config, 2, force=True)["deleted"] == {"digits": ["1", "2"], "text": []}


def test_prune_without_a_cluster_deletes_nothing_unless_forced(registry, monkeypatch):
    """A version a cluster serves must survive: without one to ask, nothing is deleted."""
    import socket

    from app.errors import NoClusterError

    with socket.socket() as s:  # an address nothing answers on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{s.getsockname()[1]}")
    config = Config.model_validate({"export": {"registry": str(registry)}})
    with pytest.raises(NoClusterError, match="--force"):
        lifecycle.prune(config, 1)
    assert len(lifecycle.complete_versions(str(registry / "digits"))) == 4


def test_prune_refuses_when_the_live_version_cannot_be_told(registry):
    with pytest.raises(UserError, match="cannot tell which version is live"):
        lifecycle.prune_model(str(registry), "digits", keep=1, in_use={"3", "HTTP 503: busy"})
    assert len(lifecycle.complete_versions(str(registry / "digits"))) == 4


def test_a_language_models_gate_shows_perplexity_and_agreement():
    report = {
        "perplexity": {"fp32": 10.0, "int8": 10.1},
        "perplexity_increase": 0.01,
        "greedy": {"token_agreement": 0.97},
        "size_ratio_int8": 0.5,
    }
    figures = lifecycle.gate_figures(report)
    assert figures["greedy_agreement"] == 0.97 and figures["perplexity_increase"] == 0.01
    assert "int8_accuracy" not in figures


def make_index(registry: Path, model: str, version: int, encoder: int) -> None:
    folder = registry / model / "index" / str(version)
    folder.mkdir(parents=True)
    schema = {"task": "index", "encoder": {"name": model, "version": str(encoder)}}
    (folder / "schema.json").write_text(json.dumps(schema))
    report = {"vectors": 100 * version, "index_bytes": 4096, "recall_at_10": 0.97, "method": "hnsw"}
    (folder / "report.json").write_text(json.dumps(report))
    manifest = {"name": f"{model}-index", "version": str(version), "files": {}, "created": "now"}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (registry / model / "index" / LATEST).write_text(str(version))


def test_listing_shows_a_models_indexes_with_encoder_size_count_and_recall(registry):
    make_index(registry, "digits", 1, encoder=1)
    make_index(registry, "digits", 2, encoder=3)
    entry = lifecycle.model_entry(str(registry), "digits", live={"digits-index": "1"})
    first, second = entry["indexes"]
    assert first["encoder"] == {"name": "digits", "version": "1"} and first["live"] is True
    assert second["latest"] is True and second["live"] is False
    assert (second["vectors"], second["index_bytes"], second["recall_at_10"]) == (200, 4096, 0.97)
    assert lifecycle.model_entry(str(registry), "text", live=None)["indexes"] == []


def test_a_retrieval_models_gate_shows_recall_both_ways_and_the_cosine():
    report = {
        "recall": {"fp32": {"i2t_r1": 90.0, "t2i_r1": 88.0}, "int8": {"i2t_r1": 89.5}},
        "recall_drop": {"i2t": 0.5, "t2i": 0.0},
        "parity": {"min_cosine": {"image": 0.9999, "text": 0.9998}},
    }
    figures = lifecycle.gate_figures(report)
    assert figures["fp32"]["i2t_r1"] == 90.0 and figures["int8"]["t2i_r1"] is None
    assert figures["recall_drop_points"]["i2t"] == 0.5 and figures["min_cosine"]["text"] == 0.9998


def test_prune_covers_index_versions_and_keeps_the_encoders_the_rest_need(registry):
    """Index versions 1-4 (encoders 1, 1, 2, 4): keep 1 keeps index 4 (newest, latest) and 2
    (served); the model then keeps 4 (newest), 3 (latest) and 2 (index 2's encoder), and
    deletes 1, whose only index went."""
    for version, encoder in ((1, 1), (2, 2), (3, 1), (4, 4)):
        make_index(registry, "digits", version, encoder)
    served = {"digits-index": {"2"}}
    deleted = lifecycle.prune_model(str(registry), "digits", 1, set(), served)
    assert deleted == ["1", "index/1", "index/3"]
    assert lifecycle.complete_versions(str(registry / "digits" / "index")) == ["2", "4"]
    assert lifecycle.complete_versions(str(registry / "digits")) == ["2", "3", "4"]
