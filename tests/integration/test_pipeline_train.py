"""`train.strategy: pipeline` on a real local Ray (gloo): a tiny GPT's 4 blocks in 2 stages on 2
workers learns, its checkpoint holds each stage's shard and the consolidated weights evaluate
reads, a stage killed mid-run resumes from its shards to the uninterrupted run's loss, and the
run goes on at another stage count (4 stages on 4 workers); in `make test-all`, a text
classifier (its padding mask crossing the stages) does too, and two rows of stages train as one
data-parallel run. Loss and gradients against the unsplit model, family by family and schedule by
schedule: tests/integration/test_pipelining.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.evaluate.held_out import evaluate
from app.train.driver import train
from tests.fault_hooks import fail_at
from tests.integration.conftest import ensure_local_ray, workload_config
from tests.integration.test_lm import TINY

pytestmark = pytest.mark.integration
PIPELINE = [
    *(o for o in TINY if not o.startswith(("model.layers", "train.run_name", "train.epochs"))),
    "model.layers=4",
    "train.epochs=3",
    "train.strategy=pipeline",
    "train.pipeline.stages=2",
    "train.pipeline.microbatches=4",
    "train.pipeline.schedule=1f1b",
]


@pytest.fixture(scope="module")
def lm_prepared(workspace):
    from app.pipeline.stages import prepare
    from tests.conftest import REPO, make_config

    def config(*overrides: str):
        return make_config(
            workspace / "lm-pipeline", *PIPELINE, *overrides, path=REPO / "configs" / "lm.yaml"
        )

    prepare(config())
    ensure_local_ray()
    return config


@pytest.fixture(scope="module")
def pipeline_run(lm_prepared):
    config = lm_prepared("train.run_name=lm-pipeline")
    return config, train(config)


def test_a_pipelined_run_learns_and_writes_weights_evaluate_reads(pipeline_run):
    config, summary = pipeline_run
    assert summary["strategy"] == "pipeline"
    history = summary["history"]
    assert [m["step"] for m in history] == [6, 12, 18]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    folder = Path(summary["checkpoint"])
    sharded = {p.name for p in (folder / "sharded").iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng-rank0.pt", "rng-rank1.pt"} <= sharded
    # model.safetensors holds both stages: evaluate (a plain model, no Ray) scores the val
    # split as the pipeline's own validation (the last stage counting) did.
    evaluated = evaluate(config, summary["checkpoint"])["metrics"]
    assert evaluated["loss"] == pytest.approx(summary["metrics"]["val_loss"], rel=1e-4)


def test_each_stage_holds_a_part_of_the_model(pipeline_run):
    from app.data.prepare import read_manifest
    from app.models import build_model
    from app.train.preprocessing import fit_preprocessor

    config, summary = pipeline_run
    model = build_model(config.model, fit_preprocessor(config, read_manifest(config.data_output)))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = summary["memory_per_rank"]
    # The larger stage: two of four blocks plus its end of the tied embedding (each end holds
    # a copy), well short of the whole model a DDP rank holds.
    assert memory["params"] < 0.75 * whole
    assert memory["grads"] == memory["params"]
    assert memory["optimizer"] >= 2 * memory["params"]  # AdamW's two moments


@pytest.fixture(scope="module")
def fault_run(lm_prepared):
    """The fixture's run with its second rank (the last stage) killed at the start of epoch 3."""
    config = lm_prepared("train.max_failures=3", "train.run_name=lm-pipeline-fault")
    fail_at(f"{config.storage_path}/lm-pipeline-fault", rank=1, epoch=3)
    return train(config)


def test_a_killed_stage_resumes_from_its_shards_to_the_same_loss(fault_run, pipeline_run):
    _, uninterrupted = pipeline_run
    assert fault_run["resume_history"] and fault_run["resume_history"][-1] in (2, 3)
    assert fault_run["final_epoch"] == 3
    # Data order from (seed, epoch, row), and model, optimizer, schedule and RNG from the
    # shards: the resumed epoch 3 is the uninterrupted one.
    last, reference = fault_run["history"][-1], uninterrupted["history"][-1]
    assert last["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-3)


def test_a_run_resumes_at_another_stage_count(lm_prepared, fault_run):
    """A 4th epoch on 4 workers in 4 stages, from the shards 2 stages wrote."""
    resumed = train(
        lm_prepared(
            "train.epochs=4",
            "train.num_workers=4",
            "train.pipeline.stages=4",
            "train.pipeline.schedule=gpipe",
            "train.run_name=lm-pipeline-fault",
        )
    )
    assert resumed["final_epoch"] == 4 and resumed["resume_history"][-1] == 4
    assert [h["workers"] for h in resumed["num_workers_history"]] == [2, 4]
    # Epoch 4 goes on from epoch 3's weights and optimizer state (a fresh model would start
    # near the vocabulary's uniform loss, ln 512 = 6.2).
    before, after = resumed["history"][-2], resumed["history"][-1]
    assert after["train_loss"] < before["train_loss"] + 0.05
    assert after["val_loss"] < before["val_loss"] + 0.05


# Slow (make test-all): two more Ray Train runs.
@pytest.mark.slow
def test_a_text_classifier_resumes_at_another_stage_count(prepared, workspace):
    """The padding mask crosses the stages beside the hidden states; 4 stages on 4 workers go
    on from the shards 2 stages wrote."""
    prepared("text")
    ensure_local_ray()
    common = [
        "model.layers=4",
        "train.strategy=pipeline",
        "train.pipeline.microbatches=4",
        "train.run_name=text-pipeline-restage",
        "train.max_steps_per_epoch=20",
    ]
    first = train(workload_config(workspace, "text", *common, "train.epochs=2"))
    resumed = train(
        workload_config(
            workspace,
            "text",
            *common,
            "train.epochs=3",
            "train.num_workers=4",
            "train.pipeline.stages=4",
            "train.pipeline.schedule=gpipe",
        )
    )
    assert resumed["resume_history"] == [3] and resumed["final_epoch"] == 3
    assert [h["workers"] for h in resumed["num_workers_history"]] == [2, 4]
    # Epoch 3 goes on from epoch 2's weights and optimizer state (a fresh model would start
    # at chance, 0.25 on 4 topics).
    assert first["metrics"]["val_accuracy"] >= 0.9
    assert resumed["metrics"]["val_accuracy"] >= first["metrics"]["val_accuracy"] - 0.02
    assert resumed["history"][-1]["train_loss"] < first["history"][0]["train_loss"]


# Slow (make test-all): 4 workers, two rows of stages averaging their gradients.
@pytest.mark.slow
def test_two_rows_of_stages_train_as_ddp_on_two_workers_does(lm_prepared):
    """Row r reads the share, in the order, DDP's rank r reads: the same steps, the same
    losses (measured equal to 4 decimals, the epoch-3 spike of this learning rate included)."""
    mesh = train(lm_prepared("train.num_workers=4", "train.run_name=lm-pipeline-mesh"))
    ddp = train(lm_prepared("train.strategy=ddp", "train.run_name=lm-pipeline-ddp"))
    assert mesh["num_workers"] == 4
    for ours, theirs in zip(mesh["history"], ddp["history"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-3)
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-3)
