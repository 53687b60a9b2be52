"""One model's replica: a verified artifact in ONNX Runtime behind Serve's dynamic batching.

`infer` validates one request against the artifact's schema and turns it into model inputs with
the artifact's fitted preprocessor (the code training used), all before it joins a batch: bad input
comes back as an error value for that request alone, never as an exception, so neither the replica
nor the requests batched with it fail because of it. `@serve.batch` then runs the batch's inputs in
one ONNX Runtime call.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np
from ray import serve

from app.artifact import Artifact, open_artifact, run_logits
from app.serve.protocol import RequestError, numeric_rows, text_rows, v1_rows

log = logging.getLogger("ray.serve")


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class ModelServer:
    def __init__(
        self,
        artifact_uri: str,
        max_batch_size: int,
        batch_wait_timeout_s: float,
        threads: int,
        max_request_rows: int = 1024,
    ):
        self.artifact: Artifact = open_artifact(artifact_uri)
        self.threads = threads
        self.max_request_rows = max_request_rows
        self.variant = "int8"
        self.session = self.artifact.session(self.variant, threads)
        # serve.batch's wrapper takes its limits at run time, so they come from config.
        self.infer_batch.set_max_batch_size(max_batch_size)  # type: ignore[attr-defined]
        self.infer_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)  # type: ignore[attr-defined]
        self._metrics = _ReplicaMetrics(self.artifact.name)
        log.info(
            "model %s version %s loaded from %s",
            self.artifact.name,
            self.artifact.version,
            self.artifact.uri,
        )

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """`user_config: {variant: fp32|int8}` switches the ONNX model without a redeploy."""
        variant = user_config.get("variant", "int8")
        if variant not in self.artifact.models:
            raise ValueError(f"variant: {variant!r} is not one of {sorted(self.artifact.models)}")
        if variant != self.variant or self.session is None:
            self.session = self.artifact.session(variant, self.threads)
            self.variant = variant
            log.info("model %s now serves the %s variant", self.artifact.name, variant)

    def check_health(self) -> None:
        # Fails when the session can no longer run: Serve then replaces this replica.
        sample = self._sample()
        run_logits(self.session, self.artifact.preprocessor.features(sample))

    def metadata(self) -> dict[str, Any]:
        a = self.artifact
        return {
            "name": a.name,
            "version": a.version,
            "variant": self.variant,
            "artifact": a.uri,
            "schema": a.schema,
            "manifest": a.manifest.model_dump(mode="json", exclude={"files"}),
            "replica_pid": os.getpid(),
        }

    async def infer(self, request: dict[str, Any]) -> dict[str, Any]:
        """request: {"protocol": "v2", "tensor": {...}} or {"protocol": "v1", "instances": [...]}."""
        try:
            inputs = self._inputs(request)
        except RequestError as e:
            return {"error": e.message, "status": e.status}
        except Exception as e:  # noqa: BLE001 - whatever this input breaks stays its own 400
            log.warning("request refused: %s: %s", type(e).__name__, e)
            return {"error": f"inputs: could not be read ({type(e).__name__})", "status": 400}
        result = await self.infer_batch(inputs)
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

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def infer_batch(self, requests: list[dict[str, np.ndarray]]) -> list[Any]:
        """Per request: (labels, probabilities), or a RequestError that is that request's alone."""
        self._metrics.batch_rows.observe(
            sum(_rows_of(r) for r in requests), tags=self._metrics.tags
        )
        try:
            return self._predict(requests)
        except Exception:  # noqa: BLE001 - one request must not fail its batch mates
            log.exception("batch of %d requests failed; running them one by one", len(requests))
        alone = [self._predict_alone(r) for r in requests]
        # A request that fails alone while others pass is the odd one out: its input (400).
        # When all fail, the model itself is broken (500; check_health replaces the replica).
        status = 400 if any(not isinstance(a, Exception) for a in alone) else 500
        return [
            RequestError(
                status, f"inputs: the model could not run this request ({type(a).__name__})"
            )
            if isinstance(a, Exception)
            else a
            for a in alone
        ]

    def _predict(self, requests: list[dict[str, np.ndarray]]) -> list[Any]:
        names = list(requests[0])
        batch = {k: np.concatenate([r[k] for r in requests]) for k in names}
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


def _rows_of(inputs: dict[str, np.ndarray]) -> int:
    return len(next(iter(inputs.values())))


class _ReplicaMetrics:
    def __init__(self, model: str):
        from ray.util.metrics import Gauge, Histogram

        self.tags = {"model": model}
        self.batch_rows = Histogram(
            "raytorch_batch_size",
            description="rows per ONNX Runtime batch",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
            tag_keys=("model",),
        )
        # Each live replica reports 1 under its own tag; the sum over replicas is the count.
        self.replicas = Gauge(
            "raytorch_replicas", description="live model replicas", tag_keys=("model", "replica")
        )
        self.replicas.set(1, tags={"model": model, "replica": str(os.getpid())})
