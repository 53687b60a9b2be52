"""Every stage on a pretrained folder as on a from-scratch model, on the local Ray: GPT-2 under
FSDP (blocks sharded one by one) in bf16 with a rank killed and resumed from its shards, then
the LM export; a BERT folder with LoRA adapters exported merged and scored by jobs.predict; a
Tune search over a BERT folder's learning rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from app.export.exporter import export
from app.pipeline.stages import prepare
from app.predict.write import verify_output
from app.runtime.artifact import open_artifact, run_logits
from app.runtime.rows import softmax
from app.train.driver import train
from tests.fault_hooks import fail_at
from tests.integration.conftest import ensure_local_ray, workload_config
from tools.make_tiny_pretrained import make_bert, make_gpt2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    return {"gpt2": make_gpt2(str(root / "gpt2")), "bert": make_bert(str(root / "bert"))}


@pytest.mark.slow
def test_gpt2_fsdp_bf16_run_resumes_from_its_shards_and_exports(folders, workspace):
    config = workload_config(
        workspace,
        "gpt2-finetune",
        f"model.pretrained={folders['gpt2']}",
        "data.path={stdlib}/email/*.py",
        "data.val_fraction=0.2",
        "model.max_length=64",
        "train.strategy=fsdp",
        "train.precision=bf16",
        "train.epochs=2",
        "train.max_steps_per_epoch=3",
        "train.max_steps=5",
        "train.max_failures=3",
        "train.run_name=gpt2-fsdp",
    )
    fail_at(f"{config.storage_path}/gpt2-fsdp", rank=1, epoch=2)  # tests/fault_hooks.py
    prepare(config)
    ensure_local_ray()
    summary = train(config)
    assert summary["strategy"] == "fsdp" and summary["resume_history"]
    assert summary["history"][-1]["step"] == 5  # the step budget, across the restart
    sharded = {p.name for p in (Path(summary["checkpoint"]) / "sharded").iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= sharded
    # Each rank held half the model: GPT-2's blocks were sharded one by one.
    whole = sum(t.numel() * 4 for t in load_file(f"{folders['gpt2']}/model.safetensors").values())
    assert summary["memory_per_rank"]["params"] <= 0.6 * whole
    exported = export(config, summary["checkpoint"])
    assert exported["report"]["perplexity"]["int8"] > 1


@pytest.mark.slow
def test_bert_lora_run_exports_merged_adapters_and_jobs_predict_scores_text(
    folders, workspace, tmp_path
):
    from app.predict.driver import predict

    config = workload_config(
        workspace,
        "bert-text",
        f"model.pretrained={folders['bert']}",
        "data.num_rows=400",
        "train.lora_rank=4",
        "train.lr=0.005",
        "train.max_steps=8",
        "train.run_name=bert-lora",
    )
    prepare(config)
    ensure_local_ray()
    summary = train(config)
    state = load_file(f"{summary['checkpoint']}/model.safetensors")
    assert any(".lora_a" in name for name in state)
    uri = export(config, summary["checkpoint"])["artifact"]
    graph = onnx.load(f"{uri}/model.onnx")
    assert not any("lora" in i.name for i in graph.graph.initializer)  # merged at export

    texts = ["w12 topic0_3 w80", "topic1_4 w5 without topic2_2", "w7 w8 topic3_1"] * 10
    (tmp_path / "in").mkdir()
    table = pa.table({"id": np.arange(len(texts)), "text": texts})
    pq.write_table(table, tmp_path / "in" / "part-0.parquet")
    out = str(tmp_path / "out")
    result = predict(config, uri, str(tmp_path / "in"), out)
    assert result["rows"] == len(texts) and result["rejected"] == 0
    manifest = verify_output(out)
    predictions = pa.concat_tables([pq.read_table(f"{out}/{s.file}") for s in manifest.files])
    order = np.argsort(predictions["id"].to_numpy())
    artifact = open_artifact(uri)
    variant = config.predict.variant or config.serve.variant
    expected = softmax(run_logits(artifact.session(variant), artifact.preprocessor.features(texts)))
    got = np.asarray(predictions["probabilities"].to_pylist(), np.float32)[order]
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.slow
def test_tune_searches_a_pretrained_folders_learning_rate(folders, workspace):
    from app.train.tuning import tune
    from tests.integration.test_tune import start_ray_with_dashboard

    config = workload_config(
        workspace,
        "bert-text",
        f"model.pretrained={folders['bert']}",
        "data.num_rows=400",
        "train.max_steps=6",
        "train.run_name=bert-search",
        "tune.num_trials=2",
    )
    prepare(config)
    start_ray_with_dashboard(num_cpus=2)
    try:
        summary = tune(config)
    finally:
        import ray

        ray.shutdown()
    assert len(summary["trials"]) == 2
    assert all(2e-5 <= t["overrides"]["train.lr"] <= 5e-5 for t in summary["trials"])
    assert Path(summary["best"]["checkpoint"], "model.safetensors").exists()


@pytest.mark.slow
def test_a_vit_folder_exports_every_program_that_executorch_runs_as_onnx(workspace, tmp_path):
    from tests.integration.test_programs import check_executorch_labels, with_every_format
    from tools.make_tiny_pretrained import make_vit

    config = workload_config(
        workspace,
        "vit-images",
        f"model.pretrained={make_vit(str(tmp_path / 'vit'))}",
        "data.num_rows=200",
        "train.freeze=backbone",
        "train.lr=0.01",
        "train.max_steps=4",
        "train.run_name=vit-programs",
    )
    config = with_every_format(config, "vit-programs")
    prepare(config)
    ensure_local_ray()
    summary = train(config)
    result = export(config, summary["checkpoint"])
    programs = result["report"]["programs"]
    # All three build from a ViT folder with torch 2.13 and executorch 1.5.1 (a program that
    # would not would be left out, naming the operator: `reason`).
    assert {v: p.get("reason") for v, p in programs.items()} == dict.fromkeys(programs), programs
    assert set(programs) == {"aoti", "executorch", "executorch_int8"}
    check_executorch_labels(config, result["artifact"])
