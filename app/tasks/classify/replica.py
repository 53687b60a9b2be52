"""Task `classify`'s replica: a verified artifact in ONNX Runtime behind dynamic batching.

The request lifecycle, one short method each:
    infer(request)    -> decode: rows checked against the artifact's schema (app/runtime/rows.py)
                         and turned into model inputs by the artifact's fitted preprocessor,
                         before the request joins a batch (bad input fails alone, as a 400)
    _batched(inputs)  -> batch: Serve's `serve.batch`, or a call of its own (app/serve/replicas/batching.py)
    _predict(batch)   -> predict: one ONNX Runtime call on a worker thread
    (labels, probabilities) per request -> unbatch -> InferResult
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from ray import serve

from app.config import ServeConfig
from app.runtime.artifact import LOGITS, run_logits
from app.runtime.rows import request_rows, softmax
from app.runtime.types import InferRequest, InferResult, RequestError
from app.serve.metrics import Deferred, model_histogram
from app.serve.replicas.apps import SelfServing
from app.serve.replicas.base import Replica
from app.serve.replicas.batching import (
    MASK,
    measure_batch_calls,
    padding_groups,
    row_lengths,
    serve_batcher,
    spread,
    takes_any_length,
)

log = logging.getLogger("ray.serve")
Answer = tuple[list[str], np.ndarray]  # one request's labels and probabilities


class ClassifierServer(Replica):
    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        super().__init__(artifact_uri, cfg)  # the artifact, its variant's session (`load`)
        self.max_request_rows = cfg.max_request_rows
        self.max_padding_waste = cfg.batching.max_padding_waste
        # ONNX Runtime releases the GIL: its calls run on these threads, side by side.
        self.workers = cfg.batching.max_concurrent_batches
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="onnx")
        self.batch_setting = cfg.batching.calls
        self._choose_batch_calls()
        self.infer_batch = serve_batcher(self._run_batch, cfg)
        self.in_flight = 0  # validated requests called alone, queued for, or inside, a batch
        self.version, self.labels = self.artifact.version, self.artifact.preprocessor.labels
        self.pid = os.getpid()
        # Rows per ONNX Runtime call: what Serve's own metrics cannot see (a batch's calls).
        histogram = model_histogram(
            "raytorch_batch_size",
            "rows per ONNX Runtime call",
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
        )
        tags = {"model": self.artifact.name}
        self.batch_rows = Deferred(lambda buffer, rows: buffer.observe(histogram, rows, tags))
        log.info(
            "model %s: batched requests %s (%s)",
            self.artifact.name,
            "share ONNX Runtime calls" if self.share_calls else "get a call each",
            self.batch_calls,
        )

    def load(self, variant: str) -> None:
        self.session = self.artifact.session(variant, self.threads)
        self.trim = takes_any_length(self.session)

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
        tokens, half what serve.batching.max_padding_waste allows by default; every position a token."""
        row = self.artifact.preprocessor.features(self.artifact.preprocessor.sample_rows())
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

    async def check_health(self) -> None:
        # Fails when the session can no longer run: Serve then replaces this replica.
        inputs = self.artifact.preprocessor.features(self.artifact.preprocessor.sample_rows())
        await asyncio.get_running_loop().run_in_executor(
            self.pool, run_logits, self.session, inputs
        )

    def details(self) -> dict[str, Any]:
        return {"batching": self.batch_calls}

    async def infer(self, request: InferRequest) -> InferResult:
        """Rows checked against the schema and turned into model inputs for this request alone
        (whatever its input breaks stays its own 400), then batched."""
        try:
            rows = request_rows(request, self.artifact.schema, self.max_request_rows)
            inputs = self.artifact.preprocessor.features(rows)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever this input breaks stays its own 400
            log.warning("request refused: %s: %s", type(e).__name__, e)
            raise RequestError(400, f"inputs: could not be read ({type(e).__name__})") from None
        labels, probabilities = await self._batched(inputs, len(rows))
        return InferResult(labels, probabilities, self.version, self.labels, self.pid)

    async def _batched(self, inputs: dict[str, np.ndarray], rows: int) -> Answer:
        """Through the batcher, which waits up to batch_wait_timeout_s for batch mates. A request
        alone in the replica is called at once instead: no mate can come in time (a closed-loop
        client at low concurrency would pay the whole wait on every request), and the requests
        that arrive while it runs fill the next batch. When requests do not share calls there is
        nothing to wait for: straight to a thread. A request called alone that fails is this
        request's (400): with no batch mates to compare with, a model that fails everything is
        left to check_health, which fails too and has Serve replace the replica."""
        alone = not self.share_calls or self.in_flight == 0
        self.in_flight += 1
        try:
            if alone:
                self.batch_rows.append(rows)
                loop = asyncio.get_running_loop()
                try:
                    return (await loop.run_in_executor(self.pool, self._predict, [inputs]))[0]
                except Exception as e:  # noqa: BLE001 - answered as this request's error
                    log.warning("request failed on its own: %s: %s", type(e).__name__, e)
                    raise model_error(400, e) from None
            answer = await self.infer_batch(inputs)
        finally:
            self.in_flight -= 1
        if isinstance(answer, RequestError):
            raise answer
        return answer

    async def _run_batch(self, requests: list[dict[str, np.ndarray]]) -> list[Any]:
        """Per request: its Answer, or a RequestError that is that request's alone."""
        lengths = [row_lengths(r) for r in requests]
        groups = padding_groups(lengths, self.max_padding_waste)
        for group in groups:
            self.batch_rows.append(sum(len(lengths[i]) for i in group))
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

    def _predict(self, requests: list[dict[str, np.ndarray]]) -> list[Answer]:
        names = list(requests[0])
        batch = {k: np.concatenate([r[k] for r in requests]) for k in names}
        if self.trim and MASK in batch:
            longest = int(row_lengths(batch).max())
            batch = {k: v[:, :longest] for k, v in batch.items()}
        probabilities = softmax(self.session.run(LOGITS, batch)[0])  # run_logits, inline
        labels = self.artifact.preprocessor.labels
        predicted = np.asarray(labels, dtype=object)[probabilities.argmax(1)].tolist()
        out, start = [], 0
        for r in requests:
            n = len(next(iter(r.values())))
            out.append((predicted[start : start + n], probabilities[start : start + n]))
            start += n
        return out

    def _predict_alone(self, request: dict[str, np.ndarray]) -> Answer | Exception:
        try:
            return self._predict([request])[0]
        except Exception as e:  # noqa: BLE001 - answered as this request's error
            log.warning("request failed on its own: %s: %s", type(e).__name__, e)
            return e


def model_error(status: int, e: Exception) -> RequestError:
    return RequestError(
        status, f"inputs: the model could not run this request ({type(e).__name__})"
    )


@serve.ingress()
class ClassifierApp(SelfServing, ClassifierServer):
    """A classifier's replica: its HTTP routes and its ONNX Runtime session in one process."""
