"""Prepare on two machines that share no disk: a table, and pictures with captions named by a
Karpathy JSON, on an S3 server (moto, 127.0.0.1) are read, checked, split and written to S3 by Ray
Data tasks on two worker nodes (each with its own HOME and temp folder; the head has no CPUs),
and the shards are byte-identical to those of the same sources prepared in one process."""

from __future__ import annotations

import io
import json
import uuid

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app import storage
from app.data import image_text_source
from app.data.pieces import InProcess
from app.data.prepare import read_manifest
from app.data.ray_tasks import RayTasks
from app.pipeline.stages import prepare
from tests.conftest import make_config
from tests.integration.conftest import multinode_cluster
from tests.integration.test_elastic import node_env
from tests.s3_server import moto_s3

pytestmark = pytest.mark.integration
OWN_RAY = True  # starts its own Ray (tests/integration/conftest.py: _private_ray_only)


def upload_table(root: str, tmp_path) -> None:
    """Four files (two Parquet, two CSV) under `root`: pieces enough for both nodes."""
    rng = np.random.default_rng(0)
    for i in range(4):
        frame = pd.DataFrame({f"x{j}": rng.normal(size=2000) for j in range(3)})
        frame["label"] = [f"c{k % 4}" for k in range(2000)]
        local = tmp_path / f"part-{i}.{'parquet' if i % 2 else 'csv'}"
        if i % 2:
            pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), local)
        else:
            frame.to_csv(local, index=False)
        storage.upload_file(str(local), f"{root}/{local.name}")


def upload_karpathy(root: str) -> int:
    """40 pictures of 3 captions each, a tenth of them in val, and the JSON naming them."""
    from PIL import Image

    images = []
    for i in range(40):
        buffer = io.BytesIO()
        Image.new("RGB", (12 + i % 5, 10), (6 * i, 255 - 6 * i, 3 * i)).save(buffer, "PNG")
        storage.write_bytes(f"{root}/pictures/{i:03d}.png", buffer.getvalue())
        sentences = [{"raw": f"picture {i} caption {k}"} for k in range(3)]
        split = "val" if i % 10 == 3 else "train"
        images.append(
            {
                "filepath": "pictures",
                "filename": f"{i:03d}.png",
                "split": split,
                "sentences": sentences,
            }
        )
    storage.write_bytes(f"{root}/dataset.json", json.dumps({"images": images}).encode())
    return 120


def shards(output: str) -> dict[str, bytes]:
    manifest = read_manifest(output)
    return {
        s.file.split("/", 1)[1]: storage.read_bytes(storage.join(output, s.file))
        for entry in manifest.splits.values()
        for s in entry.shards
    }


def test_a_table_and_pictures_prepared_to_s3_on_two_nodes_equal_one_process(tmp_path, monkeypatch):
    import ray

    ray.shutdown()  # its own cluster; later tests re-init a local one
    # The JSON's 120 captions in pieces of 30 (planned on the driver): work for both nodes.
    monkeypatch.setattr(image_text_source, "PICTURE_ROWS_PER_PIECE", 30)
    with moto_s3() as bucket:
        root = f"{bucket}/{uuid.uuid4().hex[:8]}"
        upload_table(f"{root}/source", tmp_path)
        captions = upload_karpathy(f"{root}/coco")

        def config(name: str):
            return make_config(
                tmp_path / name,
                "data.source=table",
                f"data.path={root}/source",
                f"data.output={root}/{name}",
                "data.rows_per_shard=900",
            )

        def pictures(name: str):
            return make_config(
                tmp_path / name,
                "data.source=image_text",
                "data.format=karpathy",
                f"data.path={root}/coco/dataset.json",
                f"data.output={root}/{name}",
                "data.rows_per_shard=25",
            )

        one = prepare(config("one"), InProcess())
        one_pictures = prepare(pictures("one-pictures"), InProcess())
        cluster = multinode_cluster()
        nodes = [
            cluster.add_node(num_cpus=1, env_vars=node_env(tmp_path, f"n{i}")) for i in range(2)
        ]
        try:
            ray.init(address=cluster.address, log_to_driver=False)
            cluster.wait_for_nodes()
            tasks = RayTasks(cpus=1)
            two = prepare(config("two"), tasks)
            assert tasks.nodes == {n.node_id for n in nodes}  # both nodes read and wrote
            tasks = RayTasks(cpus=1)
            two_pictures = prepare(pictures("two-pictures"), tasks)
            assert tasks.nodes == {n.node_id for n in nodes}
        finally:
            ray.shutdown()
            cluster.shutdown()
        assert two["rows"] == one["rows"] and sum(two["rows"].values()) == 8000
        assert shards(two["output"]) == shards(one["output"])
        assert two_pictures["rows"] == one_pictures["rows"] == {"train": 108, "val": 12}
        assert sum(two_pictures["rows"].values()) == captions
        assert shards(two_pictures["output"]) == shards(one_pictures["output"])
