"""A vector index (app/tasks/index/build.py) as the registry sees it: not trained, only served: its
schema's task names this entry, whose replica class searches it."""

from __future__ import annotations

from app.registry import Task
from app.runtime.vector_index import INDEX_TASK
from app.serve.control.builders import ROUTE_PREFIX, SERVER
from app.serve.http.api import ROUTES
from app.tasks.index.http.router import router, search_route
from app.tasks.index.replica import SearchApp


def spec() -> Task:
    return Task(
        name=INDEX_TASK,
        dataset_kinds=(),
        metrics=(),
        # Its application takes the one path search traffic uses: the proxy hands a search
        # straight to the index's replicas (thumbnails and the page go through `/`).
        parts=dict([SERVER.of(SearchApp), ROUTES.of(router), ROUTE_PREFIX.of(search_route)]),
    )
