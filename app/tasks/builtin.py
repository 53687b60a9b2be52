"""The built-in tasks, a folder each (app/tasks/<task>/: what the task adds at every stage, its
spec in task.py). A new built-in task is a folder and a line in `TASKS`.

app/registry.py calls `register` the first time a task is looked up, which imports every
task's spec and so every stage; `routers` imports only the tasks' HTTP routers
(`<task>/http/router.py`), which every Serve application answers without paying for the rest
(a replica never loads the task specs)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

TASKS = ("classify", "lm", "retrieval", "index")


def register() -> None:
    from app.registry import register as register_task

    for name in TASKS:
        register_task(importlib.import_module(f"app.tasks.{name}.task").spec())


def routers() -> list[Any]:
    """The built-in tasks' routers (each task's spec binds the same object as its ROUTES)."""
    found = []
    for name in TASKS:
        module = f"app.tasks.{name}.http.router"
        if importlib.util.find_spec(f"app.tasks.{name}.http") is not None:
            found.append(importlib.import_module(module).router)
    return found
