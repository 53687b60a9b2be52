"""Programs beside ONNX: the session's tabular artifact is exported with every format
(`export.formats=[onnx,aoti,executorch]`, tests/integration/conftest.py). Each program passed
the gate and is listed with what built it; ExecuTorch's runtime answers the val split as ONNX
fp32 does; a replica serving `aoti` or `auto` answers over HTTP as the fp32 replica does; and a
`.pt2` built for another machine is refused in one line (`auto` then serves ONNX); jobs.predict
runs the `.pt2` (`predict.variant=aoti`) to the endpoint's answers. The C++
client (examples/cpp), built as the README shows, labels the val rows as the endpoint does."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest

from app.config import ServeConfig
from app.errors import ArtifactError
from app.evaluate.held_out import labeled_batches, predictions
from app.runtime import programs as prg
from app.runtime.artifact import open_artifact, run_logits
from tests.conftest import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def every_format(exported):
    config, result = exported("tabular")
    return config, result["artifact"], result["report"]


def test_every_program_passed_the_gate_and_is_listed_with_what_built_it(every_format):
    import torch

    config, uri, report = every_format
    programs = report["programs"]
    assert set(programs) == {"aoti", "executorch", "executorch_int8"}
    for variant, entry in programs.items():
        assert entry["published"], (variant, entry.get("reason"))
        assert entry["batch_drift"] <= config.export.parity_tolerance
        assert entry["latency_ms"]["batch_1"] > 0 and entry["latency_ms"]["batch_32"] > 0
        if entry["precision"] == "fp32":
            assert entry["max_abs_diff"] <= config.export.parity_tolerance
    manifest = open_artifact(uri).manifest
    assert set(manifest.programs) == {"model.pt2", "model.pte", "model.int8.pte"}
    assert set(manifest.programs) <= set(manifest.files)  # hashed like every file
    pt2 = manifest.programs["model.pt2"]
    assert pt2.torch == torch.__version__
    assert pt2.cpu_capability == torch.backends.cpu.get_cpu_capability()
    speeds = report["serving"]["rows_per_s"]
    assert set(speeds) == {"fp32", "int8", "aoti"} and min(speeds.values()) > 0


def test_executorch_programs_label_the_val_split_as_onnx_fp32(every_format):
    config, uri, _ = every_format
    check_executorch_labels(config, uri)


@pytest.mark.slow
def test_digits_programs_pass_and_label_the_val_split_as_onnx_fp32(trained):
    from app.export.exporter import export

    config, summary = trained("digits")
    config = with_every_format(config, "digits-programs")
    report = export(config, summary["checkpoint"])["report"]
    assert all(p["published"] for p in report["programs"].values()), report["programs"]
    check_executorch_labels(config, storage_uri(config))


def with_every_format(config, name: str):
    """`config` exporting every program format under another artifact name."""
    formats = ["onnx", "aoti", "executorch"]
    export_cfg = config.export.model_copy(update={"formats": formats, "name": name})
    return config.model_copy(update={"export": export_cfg})


def storage_uri(config) -> str:
    return f"{config.registry}/{config.artifact_name}/latest"


def check_executorch_labels(config, uri: str) -> None:
    """ExecuTorch's runtime on the artifact's `.pte` files: fp32 labels every val row as ONNX
    fp32 does, int8 loses no more than the gate allows (each file the artifact has)."""
    artifact = open_artifact(uri)
    pre = artifact.preprocessor
    inputs = [prg.InputInfo(n, ["batch", -1]) for n in pre.input_names()]

    def labels(session):
        return predictions(lambda x: run_logits(session, x), labeled_batches(config, pre, "val"))

    truth, onnx_labels = labels(artifact.session("fp32"))
    assert {"model.pte", "model.int8.pte"} & set(artifact.programs)
    if "model.pte" in artifact.programs:
        fp32 = prg.executorch_session(artifact.programs["model.pte"], inputs)
        assert np.array_equal(labels(fp32)[1], onnx_labels)
    if "model.int8.pte" in artifact.programs:
        int8 = prg.executorch_session(artifact.programs["model.int8.pte"], inputs)
        drop = 100 * ((onnx_labels == truth).mean() - (labels(int8)[1] == truth).mean())
        assert drop <= max(config.export.max_accuracy_drop, 100 / len(truth)) + 1e-9


def served(uri: str, variant: str, body: dict) -> tuple[str, dict]:
    """(the variant a replica serves, its /v2 answer to `body`), through the in-process app."""
    from app.serve.http.api import create_api
    from app.serve.http.clients import LocalModel, Models
    from app.serve.http.gate import IngressMetrics
    from app.tasks.classify.replica import ClassifierServer

    cfg = ServeConfig(variant=variant)
    server = ClassifierServer(uri, cfg)
    name = server.artifact.name
    api = create_api(cfg, Models.configured({name: LocalModel(server)}, cfg), IngressMetrics())

    async def ask() -> dict:
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            answer = await http.post(f"/v2/models/{name}/infer", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()

    return server.variant, asyncio.run(ask())


def val_body(config, artifact) -> dict:
    from app.data.prepare import read_manifest, split_files

    files = split_files(config.data_output, read_manifest(config.data_output), "val")
    frame = pd.concat([pd.read_parquet(f) for f in files])
    rows = frame[artifact.schema["feature_columns"]].to_numpy(np.float32)
    spec = artifact.schema["inputs"][0]
    return {
        "inputs": [
            {
                "name": spec["name"],
                "datatype": "FP32",
                "shape": list(rows.shape),
                "data": rows.ravel().tolist(),
            }
        ]
    }


def outputs(answer: dict) -> tuple[list, np.ndarray]:
    by_name = {o["name"]: o for o in answer["outputs"]}
    return by_name["label"]["data"], np.asarray(by_name["probabilities"]["data"])


def test_aoti_and_auto_replicas_answer_as_the_fp32_replica(every_format):
    config, uri, report = every_format
    body = val_body(config, open_artifact(uri))
    _, fp32 = served(uri, "fp32", body)
    variant, aoti = served(uri, "aoti", body)
    assert variant == "aoti"
    assert outputs(aoti)[0] == outputs(fp32)[0]
    assert np.abs(outputs(aoti)[1] - outputs(fp32)[1]).max() <= 1e-4
    variant, _ = served(uri, "auto", body)
    assert variant == report["serving"]["auto"]


def test_a_pt2_built_for_another_machine_is_refused_in_one_line(every_format, tmp_path):
    _, uri, _ = every_format
    copy = tmp_path / "artifact"
    shutil.copytree(open_artifact(uri).uri, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["programs"]["model.pt2"]["cpu_capability"] = "ZVECTOR"  # an s390x build
    (copy / "manifest.json").write_text(json.dumps(manifest))
    artifact = open_artifact(str(copy))
    with pytest.raises(ArtifactError, match=r"model\.pt2: compiled for CPU capability ZVECTOR"):
        artifact.choose_variant("aoti")
    speeds = artifact.report["serving"]["rows_per_s"]
    speeds["aoti"] = 10 * max(speeds.values())  # the fastest, but this CPU cannot run it
    assert artifact.choose_variant("auto") == max(("fp32", "int8"), key=speeds.__getitem__)
    manifest["programs"]["model.pt2"].update(cpu_capability=None, torch="2.0.1")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"built by torch 2\.0\.1, this process has torch"):
        open_artifact(str(copy)).session("aoti")


CPP = REPO / "examples" / "cpp"


def cpp_client() -> Path:
    """The client built as the README shows, into build/cpp-client/<key>: rebuilt when its
    sources or the torch version change, reused otherwise."""
    import hashlib

    import torch

    if not (shutil.which("cmake") and shutil.which("c++")):
        pytest.skip("cmake and a C++ compiler are needed to build examples/cpp")
    sources = sorted(p for p in CPP.rglob("*") if p.is_file())
    key = hashlib.sha256(torch.__version__.encode())
    for path in sources:
        key.update(path.read_bytes())
    build = REPO / "build" / "cpp-client" / key.hexdigest()[:16]
    binary = build / "raytorch_client"
    if not binary.exists():
        prefix = torch.utils.cmake_prefix_path
        for cmd in (
            ["cmake", "-S", str(CPP), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}"],
            ["cmake", "--build", str(build), "-j2"],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return binary


def test_the_cpp_client_answers_as_the_served_endpoint(every_format, tmp_path):
    config, uri, _ = every_format
    artifact = open_artifact(uri)
    body = val_body(config, artifact)
    rows = np.asarray(body["inputs"][0]["data"], np.float32).reshape(body["inputs"][0]["shape"])
    columns = artifact.schema["feature_columns"]
    csv = tmp_path / "rows.csv"
    # Columns in another order than the model's, a column it does not read (quoted, holding a
    # comma and a quote), and the byte-order mark spreadsheets write.
    frame = pd.DataFrame(rows, columns=columns)[columns[::-1]].assign(note='a, "b"')
    frame.to_csv(csv, index=False, encoding="utf-8-sig")
    client = cpp_client()
    done = subprocess.run([str(client), artifact.uri, str(csv)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    labels, probabilities = outputs(served(uri, "fp32", body)[1])
    assert [a["label"] for a in answers] == labels
    got = np.asarray([a["probabilities"] for a in answers])
    assert np.abs(got - probabilities.reshape(got.shape)).max() <= 1e-4

    altered = tmp_path / "altered"
    shutil.copytree(artifact.uri, altered)
    with open(altered / "preprocessor.json", "a") as f:
        f.write(" ")
    done = subprocess.run([str(client), str(altered), str(csv)], capture_output=True, text=True)
    assert done.returncode == 3
    assert done.stderr.startswith("refused: preprocessor.json: size"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_jobs_predict_runs_the_pt2_and_labels_rows_as_the_endpoint(
    every_format, ray_local, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.predict.driver import predict
    from app.predict.write import verify_output

    config, uri, _ = every_format
    body = val_body(config, open_artifact(uri))
    rows = np.asarray(body["inputs"][0]["data"], np.float32).reshape(body["inputs"][0]["shape"])
    frame = pd.DataFrame(rows, columns=open_artifact(uri).schema["feature_columns"])
    (tmp_path / "in").mkdir()
    pq.write_table(
        pa.Table.from_pandas(frame.assign(id=np.arange(len(frame)))),
        tmp_path / "in" / "rows.parquet",
    )
    config = config.model_copy(
        update={"predict": config.predict.model_copy(update={"variant": "aoti"})}
    )
    summary = predict(config, uri, str(tmp_path / "in"), str(tmp_path / "out"))
    assert summary["variant"] == "aoti" and summary["rows"] == len(frame)
    manifest = verify_output(str(tmp_path / "out"))
    table = pa.concat_tables([pq.read_table(tmp_path / "out" / s.file) for s in manifest.files])
    answers = table.to_pandas().sort_values("id")
    labels, probabilities = outputs(served(uri, "fp32", body)[1])
    assert answers["label"].tolist() == labels
    got = np.stack(answers["probabilities"].to_numpy())
    assert np.abs(got - probabilities.reshape(got.shape)).max() <= 1e-4


def test_a_replica_switches_to_and_from_the_pt2_without_a_redeploy(every_format):
    from app.tasks.classify.replica import ClassifierServer

    _, uri, _ = every_format
    server = ClassifierServer(uri, ServeConfig(variant="int8"))
    for variant in ("aoti", "int8", "aoti"):
        server.reconfigure({"variant": variant})
        assert server.variant == variant
        asyncio.run(server.check_health())  # a call through the session it now holds
    with pytest.raises(ArtifactError, match="variant 'bogus'"):
        server.reconfigure({"variant": "bogus"})
    assert server.variant == "aoti"  # a refused switch keeps what it served


def test_the_cpp_client_refuses_deeply_nested_json_in_one_line(every_format, tmp_path):
    """A rows file of a million '[' once overflowed the client's stack (one parser frame a
    level); nesting is bounded, and the refusal is one line."""
    _, uri, _ = every_format
    rows = tmp_path / "rows.json"
    rows.write_text("[" * 1_000_000)
    done = subprocess.run(
        [str(cpp_client()), uri, str(rows)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr  # a refused input, as a bad rows file is
    assert done.stderr.startswith(f"refused: {rows}: JSON: nested deeper than 64 levels")
    assert len(done.stderr.strip().splitlines()) == 1
