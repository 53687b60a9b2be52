"""The model replica's request handling without Ray: rows counted after flattening, and a bad
request failing alone, never its batch mates (Serve's @serve.batch is stood in for)."""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from app.data import kinds
from app.data.preprocess import FitOptions, Preprocessor
from app.runtime.types import InferRequest, InferResult, RequestError, Tensor
from app.serve.replicas.batching import (
    measure_batch_calls,
    padding_groups,
    spread,
    takes_any_length,
)
from app.tasks.classify.replica import ClassifierServer

pytestmark = pytest.mark.unit

LABELS = ["cat", "dog"]


class FakeSession:
    """ONNX Runtime stand-in: logits favour "dog" when the first token id is odd; a batch with a
    `poison` row of token ids fails as a whole (a fault no validation could foresee)."""

    def __init__(self, poison: np.ndarray | None = None, any_length: bool = False):
        self.poison = poison
        self.any_length = any_length
        self.runs: list[int] = []
        self.widths: list[int] = []

    def get_inputs(self):
        return [SimpleNamespace(shape=["batch", "sequence" if self.any_length else 8])]

    def run(self, names, inputs):
        ids = inputs["input_ids"]
        self.runs.append(len(ids))
        self.widths.append(ids.shape[1])
        if self.poison is not None:
            ids = np.pad(ids, ((0, 0), (0, len(self.poison) - ids.shape[1])))
        if self.poison is not None and (ids == self.poison).all(axis=1).any():
            raise RuntimeError("ONNX Runtime failed")
        odd = (ids[:, 0] % 2).astype(np.float32)
        return [np.stack([1 - odd, odd], axis=1)]


@pytest.fixture(scope="module")
def text_pre() -> Preprocessor:
    frame = pd.DataFrame(
        {"text": ["a cat sat", "a dog ran", "cats and dogs"], "label": LABELS + LABELS[:1]}
    )
    manifest = {"kind": "text", "feature_columns": ["text"], "label_column": "label"}
    return kinds.fit(iter([frame]), manifest, FitOptions(max_length=8, vocab_size=60))


def text_server(
    pre: Preprocessor,
    session=None,
    max_request_rows: int = 1024,
    max_padding_waste: float = 10.0,
    workers: int = 1,
    share_calls: bool = True,
) -> ClassifierServer:
    """A ClassifierServer on a fake text artifact; its batch method runs every concurrent call as one
    batch, as @serve.batch would, and ONNX Runtime on a worker thread, as the replica does."""
    from concurrent.futures import ThreadPoolExecutor

    server = ClassifierServer.__new__(ClassifierServer)
    server.artifact = SimpleNamespace(  # type: ignore[assignment]
        name="topics",
        version="3",
        preprocessor=pre,
        schema={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}]},
    )
    server.session = session or FakeSession()
    server.trim = takes_any_length(server.session)
    server.pool = ThreadPoolExecutor(workers)
    server.workers = workers
    server.share_calls = share_calls
    server.max_request_rows = max_request_rows
    server.max_padding_waste = max_padding_waste
    server.in_flight = 0
    server.version, server.labels, server.pid = "3", pre.labels, 1
    server.batch_rows = collections.deque()  # type: ignore[assignment]
    server.infer_batch = Batcher(server)  # type: ignore[method-assign]
    return server


class Batcher:
    """Collects the calls made in one event-loop turn into a single batch."""

    def __init__(self, server: ClassifierServer):
        self.server, self.pending, self.sizes = server, [], []

    async def __call__(self, inputs):
        future = asyncio.get_running_loop().create_future()
        self.pending.append((inputs, future))
        if len(self.pending) == 1:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush()))
        return await future

    async def _flush(self):
        batch, self.pending = self.pending, []
        self.sizes.append(len(batch))
        results = await self.server._run_batch([inputs for inputs, _ in batch])
        for (_, future), result in zip(batch, results, strict=True):
            future.set_result(result)


def v2(data, shape=None) -> InferRequest:
    shape = shape if shape is not None else [len(data)]
    return InferRequest(tensor=Tensor("text", "BYTES", shape, data))


def run(
    server: ClassifierServer, *requests: InferRequest, busy: bool = True
) -> list[InferResult | dict]:
    """Each request's result, or its error as {"status", "error"}. With `busy`, another client's
    request is in flight meanwhile, so these go through the batcher (a request alone in the
    replica is called at once)."""

    async def main():
        server.in_flight += busy
        try:
            gathered = (server.infer(r) for r in requests)
            return await asyncio.gather(*gathered, return_exceptions=True)
        finally:
            server.in_flight -= busy

    outcomes = asyncio.run(main())
    for o in outcomes:
        if isinstance(o, BaseException) and not isinstance(o, RequestError):
            raise o
    return [
        {"status": o.status, "error": o.message} if isinstance(o, RequestError) else o
        for o in outcomes
    ]


def test_text_rows_are_counted_after_flattening(text_pre):
    server = text_server(text_pre, max_request_rows=10)
    wide = v2([["a cat"] * 11], shape=[1, 11])
    one_instance = InferRequest(instances=[["a dog"] * 11])
    for answer in run(server, wide, one_instance):
        assert answer["status"] == 413
        assert answer["error"] == "11 rows exceed serve.max_request_rows=10"
    ok = run(server, v2([["a cat"] * 10], shape=[1, 10]))[0]
    assert len(ok.labels) == 10


@pytest.mark.parametrize(
    "data,fragment",
    [
        ("a cat", "inputs[0].data: expected a list of strings, got string"),
        (5, "inputs[0].data: expected a list of strings, got number"),
        (None, "inputs[0].data: expected a list of strings, got null"),
    ],
)
def test_text_data_that_is_not_a_list_is_a_400(text_pre, data, fragment):
    answer = run(text_server(text_pre), v2(data, shape=[1]))[0]
    assert answer["status"] == 400 and fragment in answer["error"]


def test_a_lone_surrogate_fails_alone_and_its_batch_mates_are_answered(text_pre):
    server = text_server(text_pre)
    good = [v2(["a cat sat"]), v2(["a dog ran", "cats"])]
    bad = v2(["fine", "broken \ud800 text"])
    answers = run(server, good[0], bad, good[1])
    assert answers[1] == {
        "status": 400,
        "error": "inputs[0].data[1]: not valid Unicode text (lone surrogate at character 7)",
    }
    assert [len(a.labels) for a in (answers[0], answers[2])] == [1, 2]
    assert server.infer_batch.sizes == [2]  # the bad one never joined the batch


def test_a_request_that_breaks_the_batch_fails_alone(text_pre):
    poison = text_pre.features(["zzz"])["input_ids"][0]
    session = FakeSession(poison=poison)
    server = text_server(text_pre, session)
    answers = run(server, v2(["a cat sat"]), v2(["zzz"]), v2(["a dog ran"]))
    assert answers[1]["status"] == 400 and "RuntimeError" in answers[1]["error"]
    assert all(len(a.labels) == 1 for a in (answers[0], answers[2]))
    assert session.runs == [3, 1, 1, 1]  # the batch, then each request alone
    broken = text_server(text_pre, FakeSession(poison=poison))
    assert run(broken, v2(["zzz"]))[0]["status"] == 500  # nobody passes: the model is at fault


def test_shape_mismatch_and_good_answers(text_pre):
    server = text_server(text_pre)
    mismatch, ok = run(server, v2(["a", "b"], shape=[3]), v2(["a cat", "a dog"]))
    assert mismatch["status"] == 400 and "inputs[0].shape" in mismatch["error"]
    assert ok.version == "3" and ok.label_names == LABELS
    assert math.isclose(float(np.asarray(ok.probabilities).sum()), 2.0, rel_tol=1e-5)


def test_padding_groups_bound_the_waste():
    lengths = [np.array([n]) for n in (20, 118, 24, 120, 21, 60)]
    groups = padding_groups(lengths, max_waste=0.5)
    assert sorted(i for g in groups for i in g) == list(range(6))  # every request, once
    for group in groups:
        rows = np.concatenate([lengths[i] for i in group])
        assert rows.max() * len(rows) - rows.sum() <= 0.5 * rows.sum()
    assert [sorted(g) for g in groups] == [[0, 2, 4], [1, 3, 5]]
    assert padding_groups([np.array([5, 9])], max_waste=0.0) == [[0]]  # alone is always valid
    assert len(padding_groups([np.array([7])] * 16, max_waste=0.0)) == 1  # equal lengths share


def test_text_is_cut_to_each_groups_longest_row_when_the_model_takes_any_length(text_pre):
    short, long = v2(["a cat"]), v2(["a cat sat and a dog ran"])
    fixed = text_server(text_pre, FakeSession())
    run(fixed, short, long)
    assert fixed.session.widths == [8]  # a fixed-length model gets the full padding
    free = text_server(text_pre, FakeSession(any_length=True), max_padding_waste=0.0)
    answers = run(free, short, long)
    assert sorted(free.session.widths) == [2, 7] and free.session.runs == [1, 1]
    assert [len(a.labels) for a in answers] == [1, 1]


def test_a_request_alone_does_not_wait_for_batch_mates(text_pre):
    """Alone in the replica, a request is called at once; those that arrive while it runs go
    through the batcher, together. The batcher itself is never reconfigured per request."""
    server = text_server(text_pre)
    run(server, v2(["a cat"]), busy=False)  # alone: nothing else can join its batch
    assert server.infer_batch.sizes == [] and server.session.runs == [1]
    run(server, v2(["a cat"]), v2(["a dog"]), v2(["cats"]), busy=False)  # two came meanwhile
    assert server.infer_batch.sizes == [2] and server.in_flight == 0


def test_spread_deals_groups_to_the_workers_by_padded_tokens():
    lengths = [np.array([100]), np.array([90]), np.array([10]), np.array([10])]
    shares = spread([[0], [1], [2], [3]], lengths, workers=2)
    assert len(shares) == 2
    assert sorted(i for s in shares for g in s for i in g) == [0, 1, 2, 3]
    tokens = sorted(sum(int(lengths[i][0]) for g in s for i in g) for s in shares)
    assert tokens == [100, 110]  # the two long ones apart, a short one with each
    assert spread([[0, 1]], lengths, workers=4) == [[[0, 1]]]  # never more shares than groups


class BarrierSession(FakeSession):
    """Every call waits until a second call is inside ONNX Runtime at the same time: calls run
    one after another break the barrier (after 5 s) and fail."""

    def __init__(self):
        super().__init__(any_length=True)
        self.barrier = threading.Barrier(2, timeout=5)
        self.threads: set[str] = set()

    def run(self, names, inputs):
        self.threads.add(threading.current_thread().name)
        self.barrier.wait()
        return super().run(names, inputs)


def test_the_groups_of_a_batch_run_side_by_side_on_the_worker_threads(text_pre):
    session = BarrierSession()
    server = text_server(text_pre, session, max_padding_waste=0.0, workers=2)
    answers = run(server, v2(["a cat"]), v2(["a cat sat and a dog ran"]))
    assert [len(a.labels) for a in answers] == [1, 1]  # both groups answered
    assert len(session.threads) == 2 and sorted(session.runs) == [1, 1]


def test_one_call_per_request_when_calls_are_not_shared(text_pre):
    session = FakeSession(any_length=True)
    server = text_server(text_pre, session, workers=2, share_calls=False)
    answers = run(server, *(v2(["a cat"]) for _ in range(4)))
    assert all(len(a.labels) == 1 for a in answers)
    assert session.runs == [1, 1, 1, 1] and server.infer_batch.sizes == []  # no batch wait


class TimedSession:
    """A model whose call takes `cost(rows)` seconds."""

    def __init__(self, cost):
        self.cost = cost

    def run(self, names, inputs):
        rows = len(inputs["x"])
        time.sleep(self.cost(rows))
        return [np.zeros((rows, 2), np.float32)]


@pytest.mark.parametrize(
    "cost,shares",
    [
        (lambda rows: 0.004, True),  # fixed cost per call (small MLP, CNN): one call pays
        (lambda rows: 0.002 * rows * (1.5 if rows > 1 else 1), False),  # batching costs per row
    ],
)
def test_the_replica_measures_whether_requests_should_share_calls(cost, shares):
    batch = {"x": np.zeros((8, 4), np.float32)}
    measured = measure_batch_calls(TimedSession(cost), batch, trim=False)
    assert measured["share_calls"] is shares and measured["rows"] == 8
    assert measured["ms_one_call"] > 0 and measured["ms_thread_handoff"] >= 0


def test_text_calibration_pads_the_shared_call_and_cuts_each_row_alone(text_pre):
    session = FakeSession(any_length=True)
    server = text_server(text_pre, session)
    batch = server._calibration_batch()
    lengths = batch["attention_mask"].sum(axis=1)
    assert len(lengths) == 8 and lengths.max() == 4 and lengths.min() >= 2  # window 8: 0.6-1 x 4
    measure_batch_calls(session, batch, trim=True)
    assert set(session.widths) == {int(n) for n in lengths}  # each single at its own length
    assert 8 in session.runs  # and the shared call on all rows, cut to the longest


def test_without_shared_calls_a_failing_request_is_a_400_and_runs_once(text_pre):
    poison = text_pre.features(["zzz"])["input_ids"][0]
    session = FakeSession(poison=poison, any_length=True)
    server = text_server(text_pre, session, workers=2, share_calls=False)
    answers = run(server, v2(["a cat sat"]), v2(["zzz"]))
    assert len(answers[0].labels) == 1
    assert answers[1] == {
        "status": 400,
        "error": "inputs: the model could not run this request (RuntimeError)",
    }
    assert session.runs == [1, 1]  # each request once, the failing one not run again


class BrokenSession(FakeSession):
    def run(self, names, inputs):
        raise RuntimeError("no kernel for this shape")


def test_a_replica_starts_when_the_calibration_fails(text_pre):
    server = text_server(text_pre, BrokenSession(any_length=True))
    server.batch_setting = "auto"
    server._choose_batch_calls()
    assert server.batch_calls["share_calls"] is True and server.share_calls is True
    assert "RuntimeError" in server.batch_calls["error"]
