"""The built-in tasks, a folder each (app/tasks/<task>/: what the task adds at every stage, its
spec in task.py), registered in the task registry. app/registry.py calls `register` the first
time a task is looked up. A new built-in task is a folder and a line here."""

from __future__ import annotations

from app.registry import register as register_task
from app.tasks.classify import task as classify
from app.tasks.index import task as index
from app.tasks.lm import task as lm
from app.tasks.retrieval import task as retrieval


def register() -> None:
    for spec in (classify.spec(), lm.spec(), retrieval.spec(), index.spec()):
        register_task(spec)
