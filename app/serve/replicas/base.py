"""What every model replica shares, whatever its task: start-up (the artifact verified and
opened, ONNX Runtime threads from `serve.replica_cpus`), the variant it serves and
`reconfigure` switching it without a redeploy, its `info`, and the refusal of a route that is
another task's. A task's replica (app/tasks/<task>/replica.py) adds only its own loading
(`load`) and its routes' methods."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from app.config import ServeConfig
from app.registry import DEFAULT as DEFAULT_TASK
from app.runtime.artifact import Artifact, open_artifact
from app.runtime.types import InferRequest, ModelInfo, RequestError

log = logging.getLogger("ray.serve")


class Replica:
    """A model replica's state; `load(variant)` (the task's) builds what serves that variant."""

    # What a client sends this model instead of Open Inference Protocol's infer (None: infer).
    ROUTE: str | None = None

    def __init__(self, artifact_uri: str, cfg: ServeConfig):
        self.cfg = cfg
        self.threads = max(1, math.floor(cfg.replica_cpus))
        self.artifact: Any = self.open(artifact_uri)
        self.variant = self.choose(cfg.variant)
        self.load(self.variant)
        log.info("%s version %s loaded", self.describe(), self.artifact.version)

    def open(self, uri: str) -> Any:
        """The verified artifact this replica serves (an index opens its own kind)."""
        return open_artifact(uri)

    def choose(self, variant: str) -> str:
        """The variant `serve.variant` names, as this artifact can serve it."""
        return self.artifact.choose_variant(variant)

    def load(self, variant: str) -> None:
        """The task's sessions (or decode loop) for `variant`."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"model {self.artifact.name}"

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """`user_config: {variant: auto|fp32|int8|aoti}` switches the variant without a redeploy."""
        variant = self.choose(user_config.get("variant", "int8"))
        if variant != self.variant:
            self.load(variant)
            self.variant = variant
            log.info("%s now serves the %s variant", self.describe(), variant)

    def details(self) -> dict[str, Any]:
        """What `info` adds for this task (its ModelInfo flags and figures)."""
        return {}

    async def info(self) -> ModelInfo:
        return model_info(self.artifact, self.variant, **self.details())

    async def infer(self, request: InferRequest) -> Any:
        raise RequestError(400, f"model {self.artifact.name!r} {self.ROUTE}")


def model_info(a: Artifact, variant: str, generates: bool = False, **extra: Any) -> ModelInfo:
    """What a replica says about the artifact it serves (a replica never loads the task
    registry: it would import every stage)."""
    return ModelInfo(
        name=a.name,
        version=a.version,
        variant=variant,
        artifact=a.uri,
        task=str(a.schema.get("task", DEFAULT_TASK)),
        generates=generates,
        inputs=a.schema["inputs"],
        outputs=a.schema["outputs"],
        labels=a.schema.get("labels", []),
        manifest=a.manifest.model_dump(mode="json", exclude={"files"}),
        replica_pid=os.getpid(),
        **extra,
    )
