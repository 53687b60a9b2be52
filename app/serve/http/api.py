"""The HTTP API of every application: the v1 and v2 routers of app/serve/http/routes and each
task's own (its `ROUTES` part) over a `Models` directory, inside the middleware of
app/serve/http/gate.py.

Routes (README.md, "The HTTP API"): /v2, /v2/health/{live,ready}, /v2/models/{name}[/ready|/infer]
(also under /versions/{version}), /v1/models, /v1/models/{name}:predict, /v1/completions,
/v2/models/{name}/generate[_stream]. Every error is a JSON body naming the problem:
{"error": ...}; never a traceback, never a 500 for bad input; 413 for oversize bodies or too
many rows, 503 (with Retry-After where ours) when a model's queue is full or its replica died,
504 when it does not answer within serve.request_timeout_s.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute, APIRouter
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import __version__
from app.config import ServeConfig
from app.registry import Part, builtin_routers, looked_up
from app.runtime.types import RequestError
from app.serve.http.clients import Models
from app.serve.http.gate import Gate, RequestMetrics, api_key, error, request_id
from app.serve.http.routes import v1, v2

log = logging.getLogger("ray.serve")
# Optional: a task's own HTTP routes (app/tasks/<task>/http/router.py), beside the v1 and v2 routes
# every model answers.
ROUTES = Part[APIRouter]("routes")


def task_routers() -> list[APIRouter]:
    """The built-in tasks' routes, and those of each task from outside app/ this process has
    looked up (a model's replica looks its own task up first)."""
    routers = builtin_routers() + [t.part(ROUTES) for t in looked_up() if t.has(ROUTES)]
    return list({id(router): router for router in routers}.values())


def create_api(
    cfg: ServeConfig,
    models: Models,
    metrics: RequestMetrics | None = None,
    serve_host: str | None = None,
    under_serve: bool = False,
) -> FastAPI:
    """The HTTP API over `models`. `serve_host`: the host Serve listens on (the API key rule);
    `under_serve`: the app runs in a Serve replica, whose own middleware echoes the request id."""
    api = FastAPI(title="raytorch", version=__version__, docs_url=None, redoc_url=None)
    api.state.models, api.state.config = models, cfg
    # Each route on the app itself (FastAPI matches an included router through a wrapper of its
    # own on every request), the POST routes first: a request is matched against each route in
    # turn, and inference is nearly all of the traffic (no two routes overlap).
    routers = (v2.router, v1.router, *task_routers())
    routes = [route for r in routers for route in r.routes if isinstance(route, APIRoute)]
    for route in sorted(routes, key=lambda route: "POST" not in (route.methods or ())):
        methods = sorted(route.methods or ())
        api.add_api_route(route.path, route.endpoint, methods=methods, name=route.name)
    api.add_api_route("/{path:path}", not_found, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    api.add_exception_handler(RequestError, request_error)
    api.add_exception_handler(StarletteHTTPException, http_error)
    api.add_exception_handler(RequestValidationError, validation_error)
    api.add_middleware(
        Gate,
        key=api_key(cfg, serve_host),
        max_body_bytes=cfg.max_body_bytes,
        metrics=metrics,
        models=frozenset(models.clients),
        echo_request_id=not under_serve,
    )
    return api


async def not_found(path: str):
    return error(404, f"no route /{path}")


async def request_error(request: Request, exc: Exception):
    assert isinstance(exc, RequestError)
    log.info("request %s: %d %s", request_id(request.scope), exc.status, exc.message)
    return error(exc.status, exc.message, exc.retry_after_s, request.url.path)


async def http_error(request: Request, exc: Exception):
    assert isinstance(exc, StarletteHTTPException)
    return error(exc.status_code, str(exc.detail), path=request.url.path)


async def validation_error(request: Request, exc: Exception):
    assert isinstance(exc, RequestValidationError)
    return error(400, str(exc.errors()[0].get("msg", "invalid request")), path=request.url.path)
