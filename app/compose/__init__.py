"""The composition root: the built-in tasks, each a spec of the real functions every stage calls
for it (app/compose/<task>.py), registered in the task registry. The top layer: the only place
that imports from every stage. app/tasks/registry.py calls `register` the first time a task is
looked up."""

from __future__ import annotations

from app.compose import classify, index, lm, retrieval
from app.tasks.registry import register as register_task


def register() -> None:
    for spec in (classify.spec(), lm.spec(), retrieval.spec(), index.spec()):
        register_task(spec)
