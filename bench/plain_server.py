"""The no-Ray baseline of B5: plain uvicorn + the project's own FastAPI app (app.serve.http.api
.create_api) with the model server (app.tasks.classify.replica.ClassifierServer: artifact -> ONNX Runtime,
the same @serve.batch dynamic batching) in the same process.

    python -m bench.plain_server --artifact URI --port P [--serve-json '{...ServeConfig...}'] [--one-call]

Only the transport differs from Ray Serve, where each model's replica runs this same app and
model server (app.tasks.classify.replica.ClassifierApp) behind Serve's proxy or HAProxy. Outside a Serve replica,
`@serve.batch` works as a plain asyncio batcher (app.ray_private.batching_outside_serve).

`--search` serves a vector index instead (B19's peer: app.tasks.index.replica.SearchServer, the
same search routes), in `--processes` uvicorn worker processes, each with its own copy.

`--one-call` is B5b's hand-written baseline: serve.batching.calls=off, so no batcher at all, one ONNX
Runtime call per request on the worker threads (serve.batching.max_concurrent_batches of them), same
validation and answer.
"""

from __future__ import annotations

import json
import os
from typing import Any

from bench.common import server_parser


def build(artifact_uri: str, serve_config: dict[str, Any], one_call: bool = False):
    from app.config import ServeConfig, resolve_uri
    from app.runtime.artifact import resolve
    from app.serve.http.api import create_api
    from app.serve.http.clients import LocalModel, Models
    from app.serve.http.gate import IngressMetrics
    from app.tasks.classify.replica import ClassifierServer

    cfg = ServeConfig.model_validate(
        {
            **serve_config,
            "batching": {
                **serve_config.get("batching", {}),
                **({"calls": "off"} if one_call else {}),
            },
        }
    )
    server = ClassifierServer(resolve(resolve_uri(artifact_uri)), cfg)
    models = Models.configured({server.artifact.name: LocalModel(server)}, cfg)
    return create_api(cfg, models, IngressMetrics())


def build_search(artifact_uri: str, serve_config: dict[str, Any]):
    from app.config import ServeConfig
    from app.serve.http.api import create_api
    from app.serve.http.clients import LocalModel, Models
    from app.serve.http.gate import IngressMetrics
    from app.tasks.index.replica import SearchServer

    cfg = ServeConfig.model_validate(serve_config)
    server = SearchServer(artifact_uri, cfg)
    models = Models.configured({server.vectors.name: LocalModel(server)}, cfg)
    return create_api(cfg, models, IngressMetrics())


def search_app():
    """uvicorn's factory in each worker process (its arguments from the environment)."""
    args = json.loads(os.environ[SEARCH_ARGS])
    return build_search(args["artifact"], args["serve"])


SEARCH_ARGS = "BENCH_PLAIN_SEARCH"


def main(argv=None) -> None:
    import uvicorn

    p = server_parser(__doc__)
    p.add_argument("--one-call", action="store_true", help="no batching: one call per request")
    p.add_argument("--search", action="store_true", help="serve a vector index")
    p.add_argument("--processes", type=int, default=1, help="uvicorn workers (--search)")
    args = p.parse_args(argv)
    quiet = {"host": "127.0.0.1", "port": args.port, "log_level": "warning", "access_log": False}
    if args.search:
        os.environ[SEARCH_ARGS] = json.dumps(
            {"artifact": args.artifact, "serve": json.loads(args.serve_json)}
        )
        target = "bench.plain_server:search_app"
        uvicorn.run(target, factory=True, workers=args.processes, **quiet)  # type: ignore[arg-type]
        return
    api = build(args.artifact, json.loads(args.serve_json), args.one_call)
    uvicorn.run(api, **quiet)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
