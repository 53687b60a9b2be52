"""One model's replica state: a verified artifact in ONNX Runtime behind dynamic batching.

`infer` validates one request against the artifact's schema and turns it into model inputs with
the artifact's fitted preprocessor (the code training used), all before it joins a batch: bad input
comes back as an error value for that request alone, never as an exception, so neither the replica
nor the requests batched with it fail because of it.

Batching (serve.max_batch_size, serve.batch_wait_timeout_s, serve.max_concurrent_batches) is
Serve's `serve.batch`, built per instance from config. A batch is split into groups of similar
length (padding_groups: padded tokens at most serve.max_padding_waste of the real ones), text is
cut to each group's own longest row when the ONNX model takes any sequence length, and the groups
are dealt to the worker threads (serve.max_concurrent_batches of them) and run in ONNX Runtime side
by side: the event loop keeps parsing the next requests meanwhile. Whether requests share a call
at all (serve.batch_calls) is measured at start (measure_batch_calls): on 2 CPU cores one call on
16 rows of a width-256 Transformer costs more per row than 16 calls of one, so there every
request goes straight to a worker thread, its own call, without the batcher.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from app.config import ServeConfig
from app.export.artifact import Artifact, open_artifact, run_logits, softmax
from app.serve.metric_buffer import process_buffer
from app.serve.protocol import RequestError, numeric_rows, text_rows, v1_rows

log = logging.getLogger("ray.serve")
MASK = "attention_mask"
SHARE_MARGIN = 0.9


def row_lengths(inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Real (unpadded) length of each row: the attention mask's sum for text, 1 otherwise."""
    mask = inputs.get(MASK)
    if mask is None:
        return np.ones(len(next(iter(inputs.values()))), dtype=np.int64)
    return np.maximum(mask.sum(axis=1), 1)


def padding_groups(lengths: list[np.ndarray], max_waste: float) -> list[list[int]]:
    """Requests (by index) grouped so that each group, padded to its longest row, pads at most
    `max_waste` x its real tokens. Requests are taken shortest first, so a group only grows while
    the longer newcomer keeps the padding bounded; a request alone is always a valid group."""
    order = sorted(range(len(lengths)), key=lambda i: int(lengths[i].max()))
    groups: list[list[int]] = []
    longest = rows = real = 0
    for i in order:
        n, total, top = len(lengths[i]), int(lengths[i].sum()), int(lengths[i].max())
        new_longest = max(longest, top)
        padded = new_longest * (rows + n) - (real + total)
        if groups and padded <= max_waste * (real + total):
            groups[-1].append(i)
            longest, rows, real = new_longest, rows + n, real + total
        else:
            groups.append([i])
            longest, rows, real = top, n, total
    return groups


def spread(
    groups: list[list[int]], lengths: list[np.ndarray], workers: int
) -> list[list[list[int]]]:
    """Groups dealt to at most `workers` shares of about equal work (padded tokens), the largest
    first to the least loaded: each share is one worker thread's part of a batch."""

    def cost(group: list[int]) -> int:
        rows = sum(len(lengths[i]) for i in group)
        return rows * max(int(lengths[i].max()) for i in group)

    shares: list[list[list[int]]] = [[] for _ in range(min(workers, len(groups)))]
    load = [0] * len(shares)
    for group in sorted(groups, key=cost, reverse=True):
        k = load.index(min(load))
        shares[k].append(group)
        load[k] += cost(group)
    return shares


def measure_batch_calls(session: Any, batch: dict[str, np.ndarray], trim: bool) -> dict[str, Any]:
    """Whether one ONNX Runtime call on the rows of `batch` (text: cut to its longest row) costs
    clearly less than a call per row (text: each cut to its own length) plus the thread
    hand-offs the extra calls take; medians of a few timed rounds. The replica's choice for
    serve.batch_calls=auto."""

    def median_s(fn: Any, repeats: int = 7) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    lengths = row_lengths(batch)
    cut = trim and MASK in batch
    singles = [
        {k: v[i : i + 1, : lengths[i]] if cut else v[i : i + 1] for k, v in batch.items()}
        for i in range(len(lengths))
    ]
    many = {k: v[:, : lengths.max()] if cut else v for k, v in batch.items()}
    one_by_one_s = median_s(lambda: [run_logits(session, r) for r in singles])
    shared_s = median_s(lambda: run_logits(session, many))
    with ThreadPoolExecutor(1) as pool:  # an idle thread of its own: the hand-off alone
        handoff_s = median_s(lambda: pool.submit(int).result(), repeats=21)
    separate_s = one_by_one_s + (len(singles) - 1) * handoff_s
    return {
        # Shared calls must save a clear 10%: a batch that shares calls keeps fewer threads
        # busy, and the timings are taken while the replica starts (noisy).
        "share_calls": shared_s <= SHARE_MARGIN * separate_s,
        "rows": len(singles),
        "ms_one_call": round(1000 * shared_s, 4),
        "ms_a_call_per_row": round(1000 * one_by_one_s, 4),
        "ms_thread_handoff": round(1000 * handoff_s, 4),
    }


def takes_any_length(session: Any) -> bool:
    """Whether the ONNX model's text inputs have a free sequence axis (then a batch is cut to its
    longest row); models exported with a fixed length get the preprocessor's full padding."""
    try:
        shape = session.get_inputs()[0].shape
    except Exception:  # noqa: BLE001 - a session without shape info: keep the full padding
        return False
    return len(shape) > 1 and not isinstance(shape[1], int)


class ModelServer:
    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        self.artifact: Artifact = open_artifact(artifact_uri)
        self.threads = max(1, math.floor(cfg.replica_cpus))
        self.max_request_rows = cfg.max_request_rows
        self.max_padding_waste = cfg.max_padding_waste
        self.variant = cfg.variant
        self.session = self.artifact.session(self.variant, self.threads)
        self.trim = takes_any_length(self.session)
        # ONNX Runtime releases the GIL: its calls run on these threads, side by side.
        self.workers = cfg.max_concurrent_batches
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="onnx")
        self.batch_setting = cfg.batch_calls
        self._choose_batch_calls()
        self.infer_batch = _batcher(self._run_batch, cfg)
        self.batch_wait_timeout_s = cfg.batch_wait_timeout_s
        self.in_flight = 0  # validated requests queued for, or inside, a batch
        self._metrics = _ReplicaMetrics(self.artifact.name)
        log.info(
            "model %s version %s loaded from %s; batched requests %s (%s)",
            self.artifact.name,
            self.artifact.version,
            self.artifact.uri,
            "share ONNX Runtime calls" if self.share_calls else "get a call each",
            self.batch_calls,
        )

    def _choose_batch_calls(self) -> None:
        """Sets batch_calls (what was chosen, and measured) and share_calls (whether batched
        requests share ONNX Runtime calls, or each goes alone). Once, at start: a variant switch
        keeps the choice (measuring then would stall the event loop mid-traffic)."""
        self.batch_calls: dict[str, Any]
        if self.batch_setting != "auto":
            on = self.batch_setting == "on"
            self.batch_calls = {"setting": self.batch_setting, "share_calls": on}
        else:
            try:
                measured = measure_batch_calls(self.session, self._calibration_batch(), self.trim)
            except Exception as e:  # noqa: BLE001 - a replica must start; requests fail alone
                log.warning("could not measure batched calls (%s); they share calls", e)
                measured = {"share_calls": True, "error": f"{type(e).__name__}: {e}"}
            self.batch_calls = {"setting": "auto", **measured}
        self.share_calls = bool(self.batch_calls["share_calls"])

    def _calibration_batch(self, rows: int = 8) -> dict[str, np.ndarray]:
        """Rows like a real batch's: for text (a model that takes any length), lengths spread
        from 0.6x to 1x half the window, which pads a shared call by a quarter of its real
        tokens, half what serve.max_padding_waste allows by default; every position a token."""
        row = self.artifact.preprocessor.features(self._sample())
        if MASK not in row:
            return {k: np.repeat(v, rows, axis=0) for k, v in row.items()}
        width = row[MASK].shape[1]
        top = max(1, width // 2) if self.trim else width
        lengths = (
            np.linspace(0.6 * top, top, rows).round().astype(int) if self.trim else [top] * rows
        )
        mask = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(row[MASK].dtype)
        ids = np.where(mask > 0, row["input_ids"][0, 0], 0).astype(row["input_ids"].dtype)
        return {k: (mask if k == MASK else ids) for k in row}

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """`user_config: {variant: fp32|int8}` switches the ONNX model without a redeploy."""
        variant = user_config.get("variant", "int8")
        if variant not in self.artifact.models:
            raise ValueError(f"variant: {variant!r} is not one of {sorted(self.artifact.models)}")
        if variant != self.variant or self.session is None:
            self.session = self.artifact.session(variant, self.threads)
            self.trim = takes_any_length(self.session)
            self.variant = variant
            log.info("model %s now serves the %s variant", self.artifact.name, variant)

    async def check_health(self) -> None:
        # Fails when the session can no longer run: Serve then replaces this replica.
        inputs = self.artifact.preprocessor.features(self._sample())
        await asyncio.get_running_loop().run_in_executor(
            self.pool, run_logits, self.session, inputs
        )

    async def metadata(self) -> dict[str, Any]:
        return artifact_metadata(self.artifact, self.variant, self.batch_calls)

    async def infer(self, request: dict[str, Any]) -> dict[str, Any]:
        """request: {"protocol": "v2", "tensor": {...}} or {"protocol": "v1", "instances": [...]}."""
        try:
            inputs = self._inputs(request)
        except RequestError as e:
            return {"error": e.message, "status": e.status}
        except Exception as e:  # noqa: BLE001 - whatever this input breaks stays its own 400
            log.warning("request refused: %s: %s", type(e).__name__, e)
            return {"error": f"inputs: could not be read ({type(e).__name__})", "status": 400}
        result = await self._batched(inputs)
        if isinstance(result, RequestError):
            return {"error": result.message, "status": result.status}
        labels, probabilities = result
        return {
            "labels": labels,
            "probabilities": probabilities,
            "version": self.artifact.version,
            "label_names": self.artifact.preprocessor.labels,
            "replica_pid": os.getpid(),
        }

    async def _batched(self, inputs: dict[str, np.ndarray]) -> Any:
        """Through the batcher; a request alone in the replica does not wait for batch mates
        that cannot come (a closed-loop client at low concurrency would pay the whole wait on
        every request); with others in flight, the batch waits up to batch_wait_timeout_s.
        When requests do not share calls there is nothing to wait for: straight to a thread."""
        if not self.share_calls:
            # A batch would only make each request wait for the window and for its slowest
            # batch mate, and leave a thread idle while the next batch forms.
            return await self._alone(inputs)
        wait = self.batch_wait_timeout_s if self.in_flight else 0.0
        set_wait = getattr(self.infer_batch, "set_batch_wait_timeout_s", None)
        if set_wait is not None:
            set_wait(wait)
        self.in_flight += 1
        try:
            return await self.infer_batch(inputs)
        finally:
            self.in_flight -= 1

    async def _alone(self, inputs: dict[str, np.ndarray]) -> Any:
        """One request, one call on a worker thread. A failure is this request's (400): with
        no batch mates to compare with, a model that fails everything is left to check_health,
        which fails too and has Serve replace the replica."""
        self._metrics.observe_call(_rows_of(inputs))
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self.pool, self._predict_alone, inputs)
        return model_error(400, answer) if isinstance(answer, Exception) else answer

    async def _run_batch(self, requests: list[dict[str, np.ndarray]]) -> list[Any]:
        """Per request: (labels, probabilities), or a RequestError that is that request's alone."""
        lengths = [row_lengths(r) for r in requests]
        groups = padding_groups(lengths, self.max_padding_waste)
        for group in groups:
            self._metrics.observe_call(sum(len(lengths[i]) for i in group))
        loop = asyncio.get_running_loop()
        shares = await asyncio.gather(
            *(
                loop.run_in_executor(self.pool, self._answer, requests, share)
                for share in spread(groups, lengths, self.workers)
            )
        )
        answers: dict[int, Any] = {}
        alone: dict[int, Any] = {}
        for share_answers, share_alone in shares:
            answers.update(share_answers)
            alone.update(share_alone)
        # A request that fails alone while others pass is the odd one out: its input (400).
        # When all fail, the model itself is broken (500; check_health replaces the replica).
        everything_failed = len(alone) == len(requests) and all(
            isinstance(a, Exception) for a in alone.values()
        )
        status = 500 if everything_failed else 400
        for i, a in alone.items():
            answers[i] = model_error(status, a) if isinstance(a, Exception) else a
        return [answers[i] for i in range(len(requests))]

    def _answer(
        self, requests: list[dict[str, np.ndarray]], groups: list[list[int]]
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        """On a worker thread: these groups of the batch, then the requests of any group that
        failed one by one. Returns (answers, what each of those requests gave alone)."""
        answers: dict[int, Any] = {}
        failed: list[int] = []
        for group in groups:
            try:
                for i, answer in zip(
                    group, self._predict([requests[i] for i in group]), strict=True
                ):
                    answers[i] = answer
            except Exception:  # noqa: BLE001 - one request must not fail its batch mates
                log.exception("group of %d requests failed; running them one by one", len(group))
                failed += group
        return answers, {i: self._predict_alone(requests[i]) for i in failed}

    def _predict(self, requests: list[dict[str, np.ndarray]]) -> list[Any]:
        names = list(requests[0])
        batch = {k: np.concatenate([r[k] for r in requests]) for k in names}
        if self.trim and MASK in batch:
            longest = int(row_lengths(batch).max())
            batch = {k: v[:, :longest] for k, v in batch.items()}
        probabilities = softmax(run_logits(self.session, batch))
        labels = self.artifact.preprocessor.labels
        predicted = np.asarray(labels, dtype=object)[probabilities.argmax(1)].tolist()
        out, start = [], 0
        for r in requests:
            n = _rows_of(r)
            out.append((predicted[start : start + n], probabilities[start : start + n]))
            start += n
        return out

    def _predict_alone(self, request: dict[str, np.ndarray]) -> Any:
        try:
            return self._predict([request])[0]
        except Exception as e:  # noqa: BLE001 - answered as this request's error
            log.warning("request failed on its own: %s: %s", type(e).__name__, e)
            return e

    # --- helpers ----------------------------------------------------------------------------

    def _inputs(self, request: dict[str, Any]) -> dict[str, np.ndarray]:
        """Validated rows -> model inputs, for this request alone (before it joins a batch)."""
        rows = self._rows(request)
        if len(rows) > self.max_request_rows:
            # Counted after flattening: a text tensor of shape [1, N] is N rows.
            raise RequestError(
                413, f"{len(rows)} rows exceed serve.max_request_rows={self.max_request_rows}"
            )
        return self.artifact.preprocessor.features(rows)

    def _rows(self, request: dict[str, Any]) -> Any:
        schema = self.artifact.schema
        pre = self.artifact.preprocessor
        spec = schema["inputs"][0]
        if request["protocol"] == "v1":
            return v1_rows(request["instances"], pre.kind, pre.feature_columns, pre.num_features)
        tensor = request["tensor"]
        if tensor["name"] != spec["name"]:
            raise RequestError(
                400, f"inputs[0].name: expected {spec['name']!r}, got {tensor['name']!r}"
            )
        if spec["datatype"] == "BYTES":
            if tensor["datatype"] != "BYTES":
                raise RequestError(
                    400, f"inputs[0].datatype: expected BYTES (text), got {tensor['datatype']!r}"
                )
            rows = text_rows(tensor["data"], "inputs[0].data")
            if len(rows) != math.prod(tensor["shape"]):
                raise RequestError(
                    400, f"inputs[0].shape: {tensor['shape']} does not match {len(rows)} strings"
                )
            return rows
        return numeric_rows(
            tensor["data"], "inputs[0]", pre.num_features, tensor["datatype"], tensor["shape"]
        )

    def _sample(self) -> Any:
        pre = self.artifact.preprocessor
        return (
            ["health check"] if pre.kind == "text" else np.zeros((1, pre.num_features), np.float32)
        )


def _batcher(handler: Any, cfg: ServeConfig) -> Any:
    """Serve's dynamic batching around `handler`, its limits from config. Outside a Serve
    replica (the bench's plain server) it is the same asyncio batcher."""
    from ray import serve

    return serve.batch(
        max_batch_size=cfg.max_batch_size,
        batch_wait_timeout_s=cfg.batch_wait_timeout_s,
        max_concurrent_batches=cfg.max_concurrent_batches,
    )(handler)


def model_error(status: int, e: Exception) -> RequestError:
    return RequestError(
        status, f"inputs: the model could not run this request ({type(e).__name__})"
    )


def _rows_of(inputs: dict[str, np.ndarray]) -> int:
    return len(next(iter(inputs.values())))


class _ReplicaMetrics:
    def __init__(self, model: str):
        from ray.util.metrics import Gauge, Histogram

        self.tags = {"model": model}
        self.batch_rows = Histogram(
            "raytorch_batch_size",
            description="rows per ONNX Runtime call",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
            tag_keys=("model",),
        )
        # Each live replica reports 1 under its own tag; the sum over replicas is the count.
        self.replicas = Gauge(
            "raytorch_replicas", description="live model replicas", tag_keys=("model", "replica")
        )
        self.replicas.set(1, tags={"model": model, "replica": str(os.getpid())})

    def observe_call(self, rows: int) -> None:
        process_buffer().observe(self.batch_rows, rows, self.tags)


def artifact_metadata(
    a: Artifact, variant: str, batching: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What a replica says about itself at `GET /v2/models/{name}` (and `/v1/models`)."""
    return {
        "name": a.name,
        "version": a.version,
        "variant": variant,
        "artifact": a.uri,
        "schema": a.schema,
        "manifest": a.manifest.model_dump(mode="json", exclude={"files"}),
        "replica_pid": os.getpid(),
        **({"batching": batching} if batching is not None else {}),
    }
