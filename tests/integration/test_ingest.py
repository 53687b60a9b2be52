"""The streamed ingest path on a real local Ray: each rank's shard row ranges -> its own read +
preprocess tasks -> its batches."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from app.data.ingest import iter_shards, split_shards, stream_split
from app.data.prepare import read_manifest, split_files
from app.train.preprocessing import fit_preprocessor

pytestmark = pytest.mark.integration


def row_keys(x: np.ndarray, y: np.ndarray) -> list[bytes]:
    return [x[i].tobytes() + y[i].tobytes() for i in range(len(y))]


def test_two_ranks_streams_see_every_row_exactly_once(prepared, ray_local):
    config = prepared("digits")
    pre = fit_preprocessor(config)
    manifest = read_manifest(config.data_output)
    expected: Counter = Counter()
    for frame in iter_shards(split_files(config.data_output, manifest, "train")):
        batch = pre.transform_batch({c: frame[c].to_numpy() for c in frame.columns})
        expected.update(row_keys(batch["x"], batch["label"]))

    shards = split_shards(config, manifest, "train")
    streams = [stream_split(config, shards, pre, rank, 2) for rank in range(2)]
    seen: list[Counter] = [Counter(), Counter()]

    def consume(i: int) -> None:  # the two ranks stream at once, as in training
        for batch in streams[i].iter_batches(batch_size=64, batch_format="numpy"):
            seen[i].update(row_keys(batch["x"], batch["label"]))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # Ranks take equal shares: an odd row count leaves its last row to no rank.
    rows = manifest["rows"]["train"]
    assert sum(seen[0].values()) == sum(seen[1].values()) == rows // 2
    together = seen[0] + seen[1]
    assert all(together[k] <= expected[k] for k in together)  # no row twice
    assert sum((expected - together).values()) == rows % 2
    assert sum(expected.values()) == manifest["rows"]["train"]
