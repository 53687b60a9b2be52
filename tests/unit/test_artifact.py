"""app/export/exporter.py, app/tasks/classify/export.py + app/runtime/artifact.py without Ray: publish, verify, refuse tampering, the gate."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.config import dump
from app.errors import ArtifactError, GateError
from app.evaluate.held_out import labeled_batches, torch_predict
from app.export.exporter import export, gate
from app.export.publish import next_version, publish
from app.models import build_model
from app.pipeline.stages import prepare
from app.runtime.artifact import (
    LATEST,
    MANIFEST,
    graph_of,
    open_artifact,
    resolve,
    verify,
)
from app.tasks.classify.export import refusal
from app.train import checkpoint
from app.train.preprocessing import fit_preprocessor
from jobs import export as export_job
from tests.unit.unit_helpers import run_main, sha256_of, snapshot, staging_leftovers

pytestmark = pytest.mark.unit

FILES = {
    "manifest.json",
    "model.onnx",
    "model.int8.onnx",
    "preprocessor.json",
    "schema.json",
    "report.json",
    "quantization.png",
}
FAST_EXPORT = [
    "model.channels=[4,8]",
    "export.max_accuracy_drop=100",
    "export.latency_repeats=3",
    "export.parity_rows=32",
    "export.calibration_batches=1",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory, config_maker):
    """Prepared digits, a checkpoint of an untrained small CNN, and one published artifact."""
    root = tmp_path_factory.mktemp("artifact")
    config = config_maker(root, *FAST_EXPORT)
    prepare(config)
    pre = fit_preprocessor(config)
    torch.manual_seed(0)
    model = build_model(config.model, pre)
    meta = checkpoint.CheckpointMeta(
        config=dump(config),
        epoch=1,
        step=10,
        metrics={"val_accuracy": 0.1},
        preprocessor=pre.to_json(),
    )
    ckpt = str(root / "checkpoint")
    checkpoint.save(ckpt, model, {"step": 10, "rng": checkpoint.rng_state()}, meta)
    summary = export(config, ckpt)
    return {
        "root": root,
        "config": config,
        "checkpoint": ckpt,
        "summary": summary,
        "model": model,
        "pre": pre,
    }


@pytest.fixture
def copy(built, tmp_path):
    """A private copy of the published version folder, free to tamper with."""
    target = tmp_path / "artifact"
    shutil.copytree(built["summary"]["artifact"], target)
    return target


def registry_of(built) -> Path:
    return Path(built["config"].registry)


# --- what export publishes ----------------------------------------------------------------------


def test_export_publishes_version_one_with_a_full_manifest(built):
    summary = built["summary"]
    registry = registry_of(built)
    assert summary["stage"] == "export"
    assert summary["artifact"] == str(registry / "digits" / "1")
    folder = Path(summary["artifact"])
    assert {p.name for p in folder.iterdir()} == FILES
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["name"] == "digits" and manifest["version"] == "1"
    assert manifest["source_checkpoint"] == built["checkpoint"]
    assert set(manifest["versions"]) >= {"torch", "ray", "onnx"}
    # Every file but the manifest itself, by relative path, with its real sha256 and size.
    assert set(manifest["files"]) == FILES - {MANIFEST}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_of(folder / name)
        assert entry["size"] == (folder / name).stat().st_size
    report = json.loads((folder / "report.json").read_text())
    assert report == summary["report"]
    with Image.open(folder / "quantization.png") as picture:  # fp32 vs int8, a real PNG
        assert picture.format == "PNG" and picture.size[0] >= 600 and picture.size[1] >= 200
    assert summary["plots"] == {"quantization": str(folder / "quantization.png")}
    assert report["parity"]["max_abs_diff"] <= built["config"].export.parity_tolerance
    assert report["quantization"]["method"] == "static"  # as configs/digits.yaml asks
    assert (registry / "digits" / LATEST).read_text().strip() == "1"
    assert staging_leftovers(registry) == []


def test_open_artifact_gives_working_sessions(built):
    art = open_artifact(built["summary"]["artifact"])
    assert (art.name, art.version) == ("digits", "1")
    assert art.preprocessor.to_json() == built["pre"].to_json()
    assert art.schema["labels"] == [str(d) for d in range(10)]
    assert art.schema["inputs"][0]["shape"] == [-1, 64]
    inputs, _ = next(labeled_batches(built["config"], art.preprocessor, "val", batch_rows=16))
    expected = torch_predict(built["model"])(inputs)
    fp32 = art.session("fp32").run(["logits"], inputs)[0]
    int8 = art.session("int8").run(["logits"], inputs)[0]
    assert fp32.shape == int8.shape == (16, 10)
    np.testing.assert_allclose(fp32, expected, atol=1e-3)
    assert np.isfinite(int8).all()


def test_latest_pointer_resolves_and_advances(built, tmp_path):
    registry = tmp_path / "registry"
    shutil.copytree(registry_of(built), registry)
    latest = str(registry / "digits" / LATEST)
    assert resolve(latest) == str(registry / "digits" / "1")
    assert open_artifact(latest).uri == str(registry / "digits" / "1")
    # A second export into this registry becomes version 2 and moves the pointer.
    config = built["config"].model_copy(deep=True)
    config.export.registry = str(registry)
    assert next_version(str(registry), "digits") == 2
    summary = export(config, built["checkpoint"])
    assert summary["artifact"] == str(registry / "digits" / "2")
    assert (registry / "digits" / LATEST).read_text().strip() == "2"
    assert open_artifact(latest).version == "2"
    assert open_artifact(str(registry / "digits" / "1")).version == "1"  # old one still whole


# --- refusing damaged artifacts -----------------------------------------------------------------


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("damage", "name"),
    [
        (flip_byte, "model.onnx"),
        (truncate, "model.int8.onnx"),
        (remove, "schema.json"),
        (flip_byte, "preprocessor.json"),
        (truncate, "report.json"),
    ],
)
def test_damaged_file_is_refused_by_name(copy, damage, name):
    damage(copy / name)
    with pytest.raises(ArtifactError) as info:
        open_artifact(str(copy))
    message = str(info.value)
    assert message.startswith(f"{name}:"), message
    assert "\n" not in message


def test_file_dropped_from_manifest_and_folder_is_refused_by_name(copy):
    manifest = json.loads((copy / MANIFEST).read_text())
    del manifest["files"]["schema.json"]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    (copy / "schema.json").unlink()
    with pytest.raises(ArtifactError, match="schema.json"):
        open_artifact(str(copy))


def test_missing_or_broken_manifest_is_refused(copy):
    (copy / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match=MANIFEST):
        open_artifact(str(copy))
    (copy / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match=MANIFEST):
        open_artifact(str(copy))


def size_as_text(manifest: dict) -> None:
    manifest["files"]["schema.json"]["size"] = "big"


def without_name(manifest: dict) -> None:
    del manifest["name"]


def files_as_a_list(manifest: dict) -> None:
    manifest["files"] = sorted(manifest["files"])


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (size_as_text, "files.schema.json.size"),
        (without_name, "name"),
        (files_as_a_list, "files"),
    ],
)
def test_manifest_of_the_wrong_shape_is_refused_naming_the_field(copy, damage, field):
    manifest = json.loads((copy / MANIFEST).read_text())
    damage(manifest)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as info:  # never a KeyError or TypeError
        open_artifact(str(copy))
    message = str(info.value)
    assert message.startswith(f"{copy / MANIFEST}: {field}: "), message
    assert "\n" not in message


def test_manifest_keys_on_disk_and_unknown_keys_survive_publishing(built, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(built["summary"]["artifact"], work)
    manifest = json.loads((work / MANIFEST).read_text())
    assert set(manifest) == {
        "name",
        "version",
        "base_model",
        "created",
        "source_checkpoint",
        "run_name",
        "train_metrics",
        "workload",
        "quantization",
        "opset",
        "versions",
        "programs",
        "files",
    }
    manifest["added_by_a_newer_tool"] = {"kept": True}
    (work / MANIFEST).write_text(json.dumps(manifest))
    uri = publish(str(work), str(tmp_path / "registry"), "digits")
    again = open_artifact(uri)
    assert again.version == "1"
    assert again.manifest["added_by_a_newer_tool"] == {"kept": True}


def test_manifest_path_escaping_the_folder_is_refused(copy):
    (copy.parent / "outside.txt").write_text("hi")
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"]["../outside.txt"] = {
        "sha256": sha256_of(copy.parent / "outside.txt"),
        "size": 2,
    }
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="leaves the artifact folder"):
        open_artifact(str(copy))


def test_no_such_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="no such artifact"):
        open_artifact(str(tmp_path / "nothing"))


def test_verify_reports_every_file(built):
    result = verify(built["summary"]["artifact"])
    assert result["ok"] is True
    assert result["files"] == sorted(FILES - {MANIFEST})


# --- python -m jobs.export --verify -------------------------------------------------------------


def test_verify_cli_exit_0_when_intact(copy, capsys):
    code, out, err = run_main(capsys, export_job.main, ["--verify", str(copy)])
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["artifact"] == str(copy)


def test_verify_cli_exit_1_naming_the_tampered_file(copy, capsys):
    flip_byte(copy / "model.onnx")
    code, out, err = run_main(capsys, export_job.main, ["--verify", str(copy)])
    assert code == 1
    assert "model.onnx" in err
    assert "Traceback" not in err
    assert out.strip() == ""


# --- the accuracy gate --------------------------------------------------------------------------


def test_gate_firing_publishes_nothing(built):
    registry = registry_of(built)
    before = snapshot(registry)
    config = built["config"].model_copy(deep=True)
    config.export.max_accuracy_drop = -1  # int8 must beat fp32 by a point: it does not
    with pytest.raises(GateError) as info:
        export(config, built["checkpoint"])
    assert info.value.exit_code == 3
    assert "export.max_accuracy_drop" in str(info.value)
    assert snapshot(registry) == before
    assert sorted(os.listdir(registry / "digits")) == ["1", LATEST]
    assert staging_leftovers(registry) == []


def report(parity: float, fp32: float, int8: float, rows: int = 1000, ratio: float = 0.25) -> dict:
    return {
        "parity": {"max_abs_diff": parity},
        "accuracy": {"onnx_fp32": fp32, "onnx_int8": int8},
        "accuracy_rows": rows,
        "accuracy_drop_points": 100 * (fp32 - int8),
        "size_ratio_int8": ratio,
    }


def gate_with(rep: dict, max_drop: float = 1.0, max_size_ratio: float | None = None) -> None:
    from app.config import Config

    config = Config()
    config.export.parity_tolerance = 1e-3
    config.export.max_accuracy_drop = max_drop
    config.export.max_size_ratio = max_size_ratio
    gate(rep, config, refusal)


def test_gate_rules():
    gate_with(report(1e-5, 0.90, 0.895))  # 0.5 points: fine
    with pytest.raises(GateError, match="max_accuracy_drop"):
        gate_with(report(1e-5, 0.90, 0.88))  # 2 points
    with pytest.raises(GateError, match="parity_tolerance"):
        gate_with(report(5e-3, 0.90, 0.90))
    # A negative allowance demands that int8 beat fp32 by that much.
    with pytest.raises(GateError):
        gate_with(report(0.0, 0.90, 0.90), max_drop=-1.0)
    gate_with(report(0.0, 0.90, 0.92), max_drop=-1.0)
    # One validation sample is never a refusal: 1 of 142 rows is 0.70 points > 0.5.
    gate_with(report(0.0, 0.972, 0.972 - 1 / 142, rows=142), max_drop=0.5)
    with pytest.raises(GateError, match="max_accuracy_drop"):
        gate_with(report(0.0, 0.972, 0.972 - 2 / 142, rows=142), max_drop=0.5)
    # The size bound (tabular and text: 0.3x).
    with pytest.raises(GateError, match="max_size_ratio=0.3"):
        gate_with(report(0.0, 0.9, 0.9, ratio=0.31), max_size_ratio=0.3)


def test_export_cli_gate_exits_3_with_one_line(built, capsys):
    registry = registry_of(built)
    before = snapshot(registry)
    overrides = [
        f"data.output={built['config'].data_output}",
        f"export.registry={registry}",
        *(o for o in FAST_EXPORT if not o.startswith("export.max_accuracy_drop=")),
        "export.max_accuracy_drop=-1",
    ]
    argv = ["--config", "configs/digits.yaml", "--checkpoint", built["checkpoint"], *overrides]
    code, out, err = run_main(capsys, export_job.main, argv)
    assert code == 3, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: export refused"), err[-2000:]
    assert out.strip() == ""
    assert snapshot(registry) == before


# --- ONNX external data, wherever the tensor sits -----------------------------------------------


def external(name: str):
    """A float tensor whose data lives in a file outside the artifact (what artifacts refuse)."""
    from onnx import TensorProto, helper

    tensor = helper.make_tensor(name, TensorProto.FLOAT, [1], [1.0])
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../../etc/passwd")
    return tensor


def model_with(where: str) -> bytes:
    """x -> y through an If whose branches add a constant; `where` puts external data in one spot."""
    from onnx import TensorProto, helper

    def branch(label: str):
        const = helper.make_tensor(f"{label}_c", TensorProto.FLOAT, [1], [1.0])
        if where == f"{label}_initializer":
            const = external(f"{label}_c")
        add = helper.make_node("Add", ["x", f"{label}_c"], [f"{label}_y"])
        graph = helper.make_graph(
            [add], label, [], [helper.make_tensor_value_info(f"{label}_y", TensorProto.FLOAT, [1])]
        )
        graph.initializer.append(const)
        return graph

    then_branch, else_branch = branch("then"), branch("else")
    if where == "nested_constant":  # a Constant node inside the subgraph of a subgraph
        inner = helper.make_graph(
            [helper.make_node("Constant", [], ["k"], value=external("k"))],
            "inner",
            [],
            [helper.make_tensor_value_info("k", TensorProto.FLOAT, [1])],
        )
        else_branch.node.append(
            helper.make_node("If", ["cond"], ["unused"], then_branch=inner, else_branch=inner)
        )
    nodes = [
        helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)
    ]
    graph = helper.make_graph(
        nodes,
        "main",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    if where == "top_initializer":
        graph.initializer.append(external("w"))
    return helper.make_model(graph).SerializeToString()


def test_self_contained_model_with_subgraphs_passes():
    assert graph_of("model.onnx", {"model.onnx": model_with("nowhere")}).external == {}


@pytest.mark.parametrize(
    "where", ["top_initializer", "then_initializer", "else_initializer", "nested_constant"]
)
def test_external_data_outside_the_artifact_is_refused_in_every_graph(where):
    with pytest.raises(ArtifactError) as info:
        graph_of("model.onnx", {"model.onnx": model_with(where)})
    message = str(info.value)
    assert message.startswith("model.onnx:") and "external data" in message
    assert "'../../etc/passwd'" in message and "\n" not in message


def test_a_graph_beyond_the_size_threshold_keeps_its_weights_beside_it_and_runs_from_memory(
    tmp_path,
):
    """export.external_data_bytes: the weights go to one `.data` file; the runtime hands them
    to ONNX Runtime from the verified bytes (a copy of the artifact elsewhere still runs), and
    a tensor pointing past the data file's end is refused."""
    import numpy as np

    from app.export.onnx_graph import graph_files, write_onnx
    from app.runtime.artifact import create_session

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(5, 16)
    path = str(tmp_path / "model.onnx")
    write_onnx(model, [x], path, ["x"], ["logits"], {"x": {0: "b"}}, 17, external_bytes=1000)
    assert graph_files(str(tmp_path), "model.onnx") == ["model.onnx", "model.onnx.data"]
    files = {n: (tmp_path / n).read_bytes() for n in ("model.onnx", "model.onnx.data")}
    graph = graph_of("model.onnx", files)
    assert set(graph.external) == {"0.weight", "2.weight"}  # tensors of 1 KiB and more
    (tmp_path / "model.onnx.data").unlink()  # nothing is read from disk
    out = create_session(graph).run(["logits"], {"x": x.numpy()})[0]
    assert np.abs(out - model(x).detach().numpy()).max() < 1e-5
    with pytest.raises(ArtifactError, match="lies outside model.onnx.data"):
        graph_of("model.onnx", {**files, "model.onnx.data": files["model.onnx.data"][:100]})


def test_serve_variant_auto_takes_the_fastest_measured_and_aoti_needs_a_program(built):
    artifact = open_artifact(built["summary"]["artifact"])
    assert artifact.servable() == ["fp32", "int8"]  # exported with ONNX only
    artifact.report.pop("serving", None)
    assert artifact.choose_variant("auto") == "int8"  # nothing measured: the default
    artifact.report["serving"] = {"rows_per_s": {"fp32": 900.0, "int8": 500.0, "aoti": 10**9}}
    assert artifact.choose_variant("auto") == "fp32"  # aoti measured, but not in this artifact
    assert artifact.choose_variant("int8") == "int8"
    with pytest.raises(ArtifactError, match=r"variant 'aoti' \(serve\.variant / predict") as info:
        artifact.session("aoti")
    assert "\n" not in str(info.value)
