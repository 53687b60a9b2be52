"""The data path without Ray: the cache-or-stream decision, the in-memory feed, the epoch loop."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest
import torch

from app.data import kinds
from app.data.feed import MemoryFeed
from app.data.ingest import plan_data_path
from app.data.preprocess import Preprocessor
from app.models.mlp import MLP
from app.tasks.classify.train import classification_loss, validate_classifier
from app.train.loop import TrainState, steady_median, train_epoch
from tests.unit.unit_helpers import manifest_with_rows

pytestmark = pytest.mark.unit


def tabular_pre(features: int = 4) -> Preprocessor:
    return kinds.from_state(
        {
            "kind": "tabular",
            "feature_columns": [f"f{i}" for i in range(features)],
            "label_column": "label",
            "labels": ["a", "b"],
            "mean": [0.0] * features,
            "std": [1.0] * features,
        }
    )


MANIFEST = manifest_with_rows({"train": 1000, "val": 250})  # 1250 rows x (4 x 4 + 8) bytes


@pytest.mark.parametrize(
    ("overrides", "mode", "val_mode", "says"),
    [
        (["data.cache_budget_mb=1"], "memory", "memory", "fits the cache budget"),
        # Train + val (29 KiB) over the budget, val alone (6 KiB) within it: only train streams.
        (["data.cache_budget_mb=0.01"], "stream", "memory", "validation (0.0 MiB) cached"),
        (["data.cache_budget_mb=0.005"], "stream", "stream", "over the cache budget"),
        (["data.cache=stream", "data.cache_budget_mb=1"], "stream", "stream", "data.cache=stream"),
        (
            ["data.cache=memory", "data.cache_budget_mb=0.01"],
            "memory",
            "memory",
            "data.cache=memory",
        ),
    ],
)
def test_the_data_path_is_chosen_by_size_and_can_be_overridden(
    config_factory, overrides, mode, val_mode, says
):
    plan = plan_data_path(config_factory(*overrides), MANIFEST, tabular_pre())
    assert (plan.mode, plan.val_mode) == (mode, val_mode)
    assert says in plan.reason
    assert plan.preprocessed_bytes == 1250 * (4 * 4 + 8)
    assert "0.0 MiB (1250 rows)" in plan.reason  # the log line says the size it judged


def test_bad_cache_setting_is_refused_naming_the_key(config_factory):
    from app.errors import ConfigError

    with pytest.raises(ConfigError, match="data.cache"):
        config_factory("data.cache=disk")


def make_feed(rows: int = 100) -> tuple[MemoryFeed, dict[str, np.ndarray]]:
    arrays = {
        "x": np.arange(rows * 2, dtype=np.float32).reshape(rows, 2),
        "label": np.arange(rows, dtype=np.int64),
    }
    # Two source batches, as Ray Data hands them over.
    halves = [
        {k: v[: rows // 2] for k, v in arrays.items()},
        {k: v[rows // 2 :] for k, v in arrays.items()},
    ]
    return MemoryFeed(lambda: halves), arrays


def labels_of(feed: MemoryFeed, seed: int | None) -> list[int]:
    return [int(v) for b in feed.batches(32, seed=seed) for v in b["label"]]


def test_memory_feed_yields_every_row_once_per_epoch_in_a_seeded_order():
    feed, arrays = make_feed()
    # Epoch 1 reads the source whole, then shuffles across it (as every later epoch does).
    epoch1 = labels_of(feed, seed=1)
    assert sorted(epoch1[:50]) != list(range(50))
    epoch2, epoch3 = labels_of(feed, seed=2), labels_of(feed, seed=3)
    assert sorted(epoch1) == sorted(epoch2) == sorted(epoch3) == list(range(100))
    assert epoch2 != epoch3  # reshuffled every epoch, across the whole shard
    assert labels_of(feed, seed=2) == epoch2  # reproducible for a given seed
    assert labels_of(make_feed()[0], seed=1) == epoch1  # the first pass too
    assert labels_of(feed, seed=None) == list(range(100))  # validation: stored order
    for batch in feed.batches(32, seed=3):  # features travel with their label
        assert torch.equal(batch["x"][:, 0], batch["label"].float() * 2)


def test_memory_feed_reads_its_source_once():
    calls = []
    feed = MemoryFeed(lambda: calls.append(1) or [{"x": np.zeros((4, 2)), "label": np.zeros(4)}])
    for seed in range(3):
        list(feed.batches(2, seed=seed))
    assert len(calls) == 1 and len(feed) == 4


def test_data_wait_is_the_median_of_epochs_after_the_first():
    assert steady_median([0.9, 0.01, 0.03, 0.02]) == pytest.approx(0.02)
    assert steady_median([0.5]) == 0.5  # a one-epoch run has only its first epoch
    assert steady_median([]) is None


def test_the_ray_free_epoch_learns_and_reports_its_wait(config_factory):
    torch.manual_seed(0)
    config = config_factory("train.lr=0.01", "train.warmup_fraction=0")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    feed = MemoryFeed.from_arrays({"x": x, "label": (x[:, 0] > 0).astype(np.int64)})
    model = MLP(4, 2, hidden=[16], dropout=0.0)
    state = TrainState.create(model, config, len(feed), world=1)
    device = torch.device("cpu")
    losses = [
        train_epoch(state, feed.batches(32, seed=e), device, 0, classification_loss)["train_loss"]
        for e in range(10)
    ]
    stats = train_epoch(state, feed.batches(32, seed=10), device, 0, classification_loss)
    assert losses[-1] < 0.5 * losses[0]
    assert 0 <= stats["data_wait_fraction"] < 1 and stats["epoch_seconds"] > 0
    assert validate_classifier(model, feed.batches(128), device, "fp32")["val_accuracy"] > 0.9


class SyncRecorder(MLP):
    """Records, per forward pass, whether DDP would all-reduce its gradients (outside
    `no_sync`), as DistributedDataParallel's `no_sync` decides it."""

    def __init__(self) -> None:
        super().__init__(4, 2, hidden=[8], dropout=0.0)
        self.synced: list[bool] = []
        self.quiet = False

    @contextlib.contextmanager
    def no_sync(self):
        self.quiet = True
        yield
        self.quiet = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.synced.append(not self.quiet)
        return super().forward(x)


def test_an_epoch_that_ends_an_accumulation_early_still_synchronises_its_last_step(
    config_factory,
):
    config = config_factory("train.grad_accum_steps=2")
    feed = MemoryFeed.from_arrays(
        {"x": np.ones((96, 4), np.float32), "label": np.zeros(96, np.int64)}
    )
    state = TrainState.create(SyncRecorder(), config, len(feed), world=1)
    train_epoch(state, feed.batches(32, seed=0), torch.device("cpu"), 0, classification_loss)
    # Three batches, two steps: the second step is the last batch alone, and its gradients are
    # all-reduced like any step's (a rank stepping on its own gradients would drift apart).
    assert state.model.synced == [False, True, True]
    assert state.step == 2


def test_training_refuses_an_altered_shard_before_any_work(config_factory):
    from app.data.prepare import read_manifest
    from app.errors import UserError
    from app.pipeline.stages import prepare
    from app.train.driver import train

    config = config_factory("train.run_name=altered")
    prepare(config)
    shard = read_manifest(config.data_output).splits["train"].shards[0].file
    path = f"{config.data_output}/{shard}"
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(UserError, match=r"part-000000-0000\.parquet: sha256 differs"):
        train(config)


class SlowShard:
    """A stand-in for a Ray Data shard whose passes take `delay` seconds to their first block."""

    def __init__(self, delay: float):
        self.delay, self.opened = delay, 0

    def iter_batches(self, batch_size, batch_format, prefetch_batches):
        assert batch_size is None and batch_format == "numpy"  # whole blocks
        self.opened += 1
        time.sleep(self.delay)  # planning + first read task
        yield {"label": np.arange(0, 5)}
        yield {"label": np.arange(5, 6)}


def test_stream_feed_starts_the_next_pass_ahead():
    from app.data.feed import StreamFeed

    shard = SlowShard(delay=0.3)
    feed = StreamFeed(shard, prefetch_batches=2, shuffle_buffer=10)
    feed.prefetch(4, seed=7)
    time.sleep(0.5)  # validation and reporting happen here
    start = time.perf_counter()
    labels = [int(v) for b in feed.batches(4, seed=7) for v in b["label"]]
    assert time.perf_counter() - start < 0.2  # the set-up was already paid
    assert sorted(labels) == list(range(6)) and shard.opened == 1
    # A pass asked for with other arguments is opened fresh, not taken from the prefetch.
    feed.prefetch(4, seed=8)
    assert sorted(int(v) for b in feed.batches(4, seed=9) for v in b["label"]) == list(range(6))
    assert shard.opened == 3
    # Unshuffled (validation): stored order, batches cut across the blocks.
    assert [b["label"].tolist() for b in feed.batches(4)] == [[0, 1, 2, 3], [4, 5]]


def test_rebatch_cuts_full_batches_across_blocks_and_shuffles_through_a_seeded_buffer():
    from app.data.feed import rebatch

    blocks = [{"x": torch.arange(a, b)} for a, b in [(0, 5), (5, 6), (6, 23), (23, 30)]]
    # An empty block (a read piece with no rows) is skipped: it neither cuts a batch short nor
    # promotes the pool to its dtype.
    blocks.insert(2, {"x": torch.zeros(0, dtype=torch.float64)})
    plain = [b["x"].tolist() for b in rebatch(iter(blocks), 4)]
    assert {b["x"].dtype for b in rebatch(iter(blocks), 4, 10, torch.Generator())} == {torch.int64}
    assert plain == [list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)]

    def shuffled(seed: int, buffer: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [b["x"].tolist() for b in rebatch(iter(blocks), 4, buffer, generator)]

    for buffer in (0, 10, 100):  # a buffer smaller than, or larger than, the whole stream
        batches = shuffled(0, buffer)
        assert [len(b) for b in batches] == [4] * 7 + [2]  # every batch full but the last
        assert sorted(v for b in batches for v in b) == list(range(30))  # each row once
    assert shuffled(0, 10) == shuffled(0, 10) != shuffled(1, 10)  # seeded
    assert shuffled(0, 10) != plain


def test_each_rank_reads_an_equal_disjoint_range_straight_from_the_shards(tmp_path):
    import pandas as pd

    from app.data.ingest import read_rank_share

    pre = tabular_pre(features=1)
    shards, start = [], 0
    for i, rows in enumerate([5, 3, 4]):  # 12 rows in 3 files of uneven size
        path = tmp_path / f"part-{i}.parquet"
        values = np.arange(start, start + rows, dtype=np.float32)
        pd.DataFrame({"f0": values, "label": ["a"] * rows}).to_parquet(path)
        shards.append((str(path), rows))
        start += rows

    def rows_of(rank: int, world: int) -> list[int]:
        blocks = list(read_rank_share(shards, rank, world, pre))
        return [int(v) for b in blocks for v in b["x"][:, 0]]

    assert rows_of(0, 1) == list(range(12))
    # The ranges the streamed path cuts into read tasks are the same shares.
    from app.data.ingest import rank_ranges

    names = [p for p, _ in shards]
    assert rank_ranges(shards, 1, 2) == [(names[1], 1, 3), (names[2], 0, 4)]
    # 12 rows over 5 ranks: 2 each, the last 2 rows left out (every rank takes as many steps).
    shares = [rows_of(r, 5) for r in range(5)]
    assert shares == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    # Validation shares: every row, the ranks' counts differing by at most one.
    val = [
        [int(v) for b in read_rank_share(shards, r, 5, pre, True) for v in b["x"][:, 0]]
        for r in range(5)
    ]
    assert val == [[0, 1], [2, 3], [4, 5, 6], [7, 8], [9, 10, 11]]
    # A rank whose range lies in one file never opens the others.
    (tmp_path / "part-2.parquet").unlink()
    assert rows_of(0, 3) == [0, 1, 2, 3]


def test_streamed_pieces_cover_every_shard_row_once_and_read_only_their_row_groups(tmp_path):
    import pandas as pd
    import pyarrow.fs as pafs

    from app.data.ingest import shard_pieces, transform_rows

    # 10 ranges and 8 tasks wanted: one piece a range. 2 ranges and 8 tasks: 4 pieces each.
    many = [(f"s{i}", 0, 100) for i in range(10)]
    assert shard_pieces(many, 8) == many
    pieces = shard_pieces([("a", 0, 10), ("b", 5, 8)], 8)
    assert [p for p in pieces if p[0] == "a"] == [
        ("a", 0, 2),
        ("a", 2, 5),
        ("a", 5, 7),
        ("a", 7, 10),
    ]
    assert [p for p in pieces if p[0] == "b"] == [("b", 5, 6), ("b", 6, 7), ("b", 7, 8)]
    assert shard_pieces([("empty", 0, 0)], 4) == []

    path = tmp_path / "part-0.parquet"  # 10 rows in row groups of 3
    frame = pd.DataFrame({"f0": np.arange(10, dtype=np.float32), "label": ["a"] * 10})
    frame.to_parquet(path, row_group_size=3)
    fs, pre = pafs.LocalFileSystem(), tabular_pre(features=1)
    got = [
        transform_rows(pre, fs, str(path), a, b)["x"][:, 0]
        for _, a, b in shard_pieces([("p", 0, 10)], 3)
    ]
    assert [list(map(int, g)) for g in got] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert list(transform_rows(pre, fs, str(path), 4, 8)["x"][:, 0]) == [4, 5, 6, 7]


def test_first_pass_batches_are_full_across_uneven_blocks():
    # Two ranks with 213 rows each, read as blocks of different sizes, must take as many steps.
    def feed_of(sizes):
        blocks = [{"label": np.arange(n, dtype=np.int64)} for n in sizes]
        return MemoryFeed(lambda: blocks)

    for seed in (None, 3):
        a = [len(b["label"]) for b in feed_of([10, 203]).batches(64, seed=seed)]
        b = [len(b["label"]) for b in feed_of([213]).batches(64, seed=seed)]
        assert a == b == [64, 64, 64, 21]


def test_a_seeded_order_is_the_same_in_a_fresh_process_as_after_earlier_epochs():
    # A resumed run's first epoch must train on the batches the uninterrupted run did.
    blocks = [{"label": np.arange(0, 300)}, {"label": np.arange(300, 513)}]

    def order(feed: MemoryFeed, seed: int) -> list[int]:
        return [int(v) for b in feed.batches(64, seed=seed) for v in b["label"]]

    uninterrupted = MemoryFeed(lambda: blocks)
    order(uninterrupted, seed=1)  # epoch 1 fills the cache
    restarted = MemoryFeed(lambda: blocks)  # a new process, starting at epoch 2
    assert order(restarted, seed=2) == order(uninterrupted, seed=2)
    assert sorted(order(restarted, seed=2)) == list(range(513))


def test_controller_settings_default_but_an_exported_value_wins(config_factory, monkeypatch):
    from app.train.driver import set_controller_env

    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")  # so teardown restores it
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "1.5")
    set_controller_env(config_factory())
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1.5"


def test_ray_data_scheduling_loop_pauses_only_when_it_would_spin(monkeypatch):
    from app.data.ingest import PacedScheduling

    slept: list[float] = []
    now = [100.0]
    monkeypatch.setattr("app.data.ingest.time.sleep", slept.append)
    monkeypatch.setattr("app.data.ingest.time.monotonic", lambda: now[0])

    class Op:
        def __init__(self, active: int):
            self.active = active

        def num_active_tasks(self) -> int:
            return self.active

    class Executor:
        def __init__(self, active: int):
            self._topology = {Op(active): None}

    idle, busy, paced = Executor(0), Executor(1), PacedScheduling()
    paced.on_execution_step(idle)  # the first step: nothing to compare with
    now[0] += 0.1  # a step that waited for tasks in ray.wait
    paced.on_execution_step(idle)
    now[0] += 0.0001  # quick, but a task runs: ray.wait will block, no pause
    paced.on_execution_step(busy)
    assert slept == []
    for _ in range(8):  # quick with nothing running: spinning; the pause doubles, capped
        now[0] += 0.0001
        paced.on_execution_step(idle)
    assert slept == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05]
    now[0] += 0.1  # a real wait resets it
    paced.on_execution_step(idle)
    now[0] += 0.0001
    paced.on_execution_step(idle)
    assert slept[-1] == PacedScheduling.FIRST_PAUSE_S


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_validation_shares_cover_every_row_in_as_many_forward_passes(world):
    from app.data.feed import MemoryFeed, padded, unpadded
    from app.data.ingest import padding_batches, rank_range

    for rows in range(world, 40):
        for batch_size in (1, 3, 4, 7):
            seen, passes = [], set()
            for rank in range(world):
                lo, hi = rank_range(rows, rank, world, every_row=True)
                share = MemoryFeed.from_arrays({"x": np.arange(lo, hi)})
                extra = padding_batches(rows, rank, world, batch_size)
                batches = list(padded(share.batches(batch_size), extra))
                passes.add(len(batches))
                seen += [int(v) for b in batches if not unpadded(b)[1] for v in b["x"]]
            assert seen == list(range(rows)), (rows, batch_size)
            assert len(passes) == 1, (rows, batch_size, passes)


def test_a_val_split_smaller_than_the_workers_is_refused_in_one_line():
    from app.errors import UserError
    from app.train.driver import check_val_rows

    check_val_rows(2, 2)
    with pytest.raises(UserError, match=r"val split has 1 rows, fewer than the 2 workers") as e:
        check_val_rows(1, 2)
    assert "\n" not in str(e.value)
