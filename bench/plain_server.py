"""The no-Ray baseline of B5: plain uvicorn + the project's own FastAPI app (app.serve.ingress
.create_api) with the model server (app.serve.model_server.ModelServer: artifact -> ONNX Runtime,
the same @serve.batch dynamic batching) in the same process.

    python -m bench.plain_server --artifact URI --port P [--serve-json '{...ServeConfig...}']

Only the transport differs from Ray Serve: handles become direct calls. Outside a Serve replica,
`@serve.batch` works as a plain asyncio batcher except for one start-up check that asks for the
replica context; that check (a warning about max_ongoing_requests) is skipped here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args: Any):
        result = self.fn(*args)
        if asyncio.iscoroutine(result):
            return result

        async def done() -> Any:
            return result

        return done()


class LocalHandle:
    """What ModelRouter needs of a DeploymentHandle: `.infer.remote(...)`, `.metadata.remote()`."""

    def __init__(self, server):
        self.infer = _Method(server.infer)
        self.metadata = _Method(server.metadata)


def build(artifact_uri: str, serve_config: dict[str, Any]):
    import math

    from ray.serve import batching

    from app.artifact import resolve
    from app.config import ServeConfig, resolve_uri
    from app.serve.ingress import IngressMetrics, ModelRouter, create_api
    from app.serve.model_server import ModelServer

    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
    cfg = ServeConfig.model_validate(serve_config)
    server = ModelServer(
        resolve(resolve_uri(artifact_uri)),
        cfg.max_batch_size,
        cfg.batch_wait_timeout_s,
        max(1, math.floor(cfg.replica_cpus)),
    )
    server.reconfigure({"variant": cfg.variant})
    return create_api(
        cfg, ModelRouter({server.artifact.name: LocalHandle(server)}), IngressMetrics()
    )


def main(argv=None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--serve-json", default="{}")
    args = p.parse_args(argv)
    api = build(args.artifact, json.loads(args.serve_json))
    uvicorn.run(api, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
