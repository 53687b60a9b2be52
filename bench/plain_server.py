"""The no-Ray baseline of B5: plain uvicorn + the project's own FastAPI app (app.serve.http.api
.create_api) with the model server (app.tasks.classify.replica.ClassifierServer: artifact -> ONNX Runtime,
the same @serve.batch dynamic batching) in the same process.

    python -m bench.plain_server --artifact URI --port P [--serve-json '{...ServeConfig...}'] [--one-call]

Only the transport differs from Ray Serve, where each model's replica runs this same app and
model server (app.tasks.classify.replica.ClassifierApp) behind Serve's proxy or HAProxy. Outside a Serve replica,
`@serve.batch` works as a plain asyncio batcher except for one start-up check that asks for the
replica context; that check (a warning about max_ongoing_requests) is skipped here.

`--one-call` is B5b's hand-written baseline: serve.batching.calls=off, so no batcher at all, one ONNX
Runtime call per request on the worker threads (serve.batching.max_concurrent_batches of them), same
validation and answer.
"""

from __future__ import annotations

import json
from typing import Any

from bench.common import server_parser


def build(artifact_uri: str, serve_config: dict[str, Any], one_call: bool = False):
    from ray.serve import batching

    from app.config import ServeConfig, resolve_uri
    from app.runtime.artifact import resolve
    from app.serve.http.api import create_api
    from app.serve.http.clients import LocalModel, Models
    from app.serve.http.gate import IngressMetrics
    from app.tasks.classify.replica import ClassifierServer

    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None  # type: ignore[method-assign]
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


def main(argv=None) -> None:
    import uvicorn

    p = server_parser(__doc__)
    p.add_argument("--one-call", action="store_true", help="no batching: one call per request")
    args = p.parse_args(argv)
    api = build(args.artifact, json.loads(args.serve_json), args.one_call)
    uvicorn.run(api, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
