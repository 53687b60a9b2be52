"""The pipeline on real object storage: an S3 API server (moto) on 127.0.0.1, no cloud account.

Every location is an `s3://` URI; the endpoint and credentials reach pyarrow the standard way
(`AWS_ENDPOINT_URL_S3`, `AWS_ACCESS_KEY_ID`, ...) in this process and, because they are set
before Ray starts, in every Ray worker (Ray Data read tasks, Ray Train workers).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pyarrow.parquet as pq
import pytest

from app import storage
from app.config import Config, load_config
from app.data.prepare import GENERATION_MARK, MANIFEST, read_manifest, verify_shards
from app.pipeline.stages import prepare
from app.runtime.artifact import LATEST, open_artifact
from tests.conftest import REPO
from tests.integration.conftest import ensure_local_ray
from tests.s3_server import moto_s3

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    with moto_s3() as bucket:
        yield bucket


@pytest.fixture
def s3_root(s3_bucket) -> str:
    return f"{s3_bucket}/{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def ray_with_s3_env(s3_bucket):
    """A local Ray started after the AWS_* variables are set, so that its workers inherit them;
    shut down at the end so that later tests get a Ray without them."""
    import ray

    ray.shutdown()
    ensure_local_ray()
    yield
    ray.shutdown()


def s3_config(root: str, *overrides: str) -> Config:
    """configs/tabular.yaml with data, runs and registry under the `s3://` URI `root`."""
    base = [f"data.output={root}/data", f"train.storage_path={root}/runs"]
    return load_config(
        REPO / "configs" / "tabular.yaml", [*base, f"export.registry={root}/registry", *overrides]
    )


def generations(output: str) -> list[str]:
    return [n for n in storage.list_dir(output) if n.startswith(GENERATION_MARK)]


# --- prepare on an object store: re-runs are safe -------------------------------------------------


def test_prepare_on_s3_publishes_through_the_manifest(s3_root, ray_with_s3_env):
    config = s3_config(s3_root)
    summary = prepare(config)
    output = config.data_output
    manifest = read_manifest(output)
    assert summary["rows"] == manifest["rows"] == {"train": 412, "val": 157}
    [generation] = generations(output)
    files = verify_shards(output, manifest, "train")
    assert all(f.startswith(f"{output}/{generation}/train/part-") for f in files)
    fs, path = storage.filesystem(files[0])
    assert pq.read_table(path, filesystem=fs).num_rows == 200
    assert sorted(storage.list_dir(output)) == sorted([generation, MANIFEST])


def test_prepare_rerun_on_s3_keeps_the_old_dataset_until_the_new_one_is_whole(
    s3_root, monkeypatch, ray_with_s3_env
):
    from app.data import pieces

    config = s3_config(s3_root)
    output = config.data_output
    prepare(config)
    first = read_manifest(output)

    # A re-run that dies after its first shard (in this process, where the failure can be
    # planted): the previous dataset stays whole and usable.
    real, written = pieces.sha256_and_size, []

    def flaky(path):
        if written:
            raise OSError("disk full")
        written.append(path)
        return real(path)

    monkeypatch.setattr(pieces, "sha256_and_size", flaky)
    with pytest.raises(OSError, match="disk full"):
        prepare(s3_config(s3_root, "data.seed=7"), pieces.InProcess())
    monkeypatch.setattr(pieces, "sha256_and_size", real)
    assert written  # the failure came after a shard was written
    assert read_manifest(output) == first
    for split in first["splits"]:
        verify_shards(output, first, split)
    assert len(generations(output)) == 1  # the failed run's shards were removed

    # Two successful re-runs: each keeps the generation it replaced (a job may still read it),
    # and the one before that is deleted.
    prepare(s3_config(s3_root, "data.seed=7"))
    second = read_manifest(output)
    assert second != first and len(generations(output)) == 2
    for split in first["splits"]:
        verify_shards(output, first, split)  # the replaced dataset is still readable
    prepare(s3_config(s3_root, "data.seed=8"))
    third = read_manifest(output)
    assert len(generations(output)) == 2
    for manifest in (second, third):
        for split in manifest["splits"]:
            verify_shards(output, manifest, split)


# --- the whole pipeline on s3 -----------------------------------------------------------------


def test_pipeline_on_s3(s3_root, ray_with_s3_env):
    from app.evaluate.held_out import evaluate
    from app.export.exporter import export
    from app.train.driver import train

    config = s3_config(
        s3_root,
        "train.epochs=2",
        "train.log_every_steps=1000",
        "train.run_name=tabular-s3",
        # This test is about storage, not the gate: a 2-epoch model need not pass it.
        "export.max_accuracy_drop=100",
        "export.max_size_ratio=",
        "export.latency_repeats=3",
        "export.parity_rows=32",
    )
    assert config.storage_path.startswith("s3://") and config.registry.startswith("s3://")
    prepare(config)

    trained = train(config)
    checkpoint = trained["checkpoint"]
    assert checkpoint.startswith(f"{s3_root}/runs/tabular-s3/")
    assert storage.exists(storage.join(checkpoint, "model.safetensors"))
    # TensorBoard events written locally by rank 0 and uploaded beside the checkpoints.
    assert trained["tensorboard"] == f"{s3_root}/runs/tabular-s3/tensorboard"
    events = storage.list_dir(trained["tensorboard"])
    assert any(name.startswith("events.out.tfevents") for name in events)

    evaluated = evaluate(config, checkpoint)
    metrics = evaluated["metrics"]
    assert metrics["rows"] == 157
    assert storage.exists(storage.join(checkpoint, "evaluation.json"))
    for uri in evaluated["plots"].values():  # the PNGs go to the object store too
        assert storage.read_bytes(uri).startswith(b"\x89PNG")

    exported = export(config, checkpoint)
    assert exported["artifact"] == f"{s3_root}/registry/tabular/1"
    assert storage.read_bytes(exported["plots"]["quantization"]).startswith(b"\x89PNG")
    latest = f"{s3_root}/registry/tabular/{LATEST}"
    assert storage.read_int(latest) == 1

    artifact = open_artifact(latest)  # resolves the pointer, hashes every file, then parses
    assert (artifact.name, artifact.version) == ("tabular", "1")
    manifest = read_manifest(config.data_output)
    frame = pq.read_table(
        storage.filesystem(verify_shards(config.data_output, manifest, "val")[0])[1],
        filesystem=storage.filesystem(config.data_output)[0],
    ).to_pandas()
    inputs = artifact.preprocessor.transform_batch(
        {c: frame[c].to_numpy()[:8] for c in frame.columns}
    )
    inputs.pop("label")
    logits = artifact.session("int8").run(["logits"], inputs)[0]
    assert logits.shape == (8, 2) and np.isfinite(logits).all()

    # A Ray worker process opens it the way a Serve replica does (ClassifierServer -> open_artifact),
    # with the endpoint and credentials it inherited, and gets the same answer.
    import ray

    @ray.remote(num_cpus=0.5)
    def infer_in_worker(uri: str, batch: dict) -> tuple[str, np.ndarray]:
        remote = open_artifact(uri)
        return remote.version, remote.session("int8").run(["logits"], batch)[0]

    version, remote_logits = ray.get(infer_in_worker.remote(latest, inputs), timeout=120)
    assert version == "1"
    np.testing.assert_allclose(remote_logits, logits, rtol=1e-6)
