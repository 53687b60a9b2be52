"""Export: the best checkpoint -> its task's verified artifact, or nothing at all.

The task's `EXPORT` part (app/tasks/<task>/export.py) builds and measures everything in a private
temporary folder; only when its gate passes is the folder published as
`<registry>/<name>/<version>/` (app/export/publish.py: one move, the manifest last) and the
`latest` pointer advanced. A refusal exits 3 and leaves the registry untouched.
"""

from __future__ import annotations

from typing import Any, Protocol

from app.config import Config
from app.registry import Part, run_task
from app.train.checkpoint import LoadedCheckpoint, load_checkpoint


class Export(Protocol):
    """A checkpoint exported, verified, gated and published: the export summary."""

    def __call__(
        self, config: Config, loaded: LoadedCheckpoint, checkpoint_uri: str, /
    ) -> dict[str, Any]: ...


EXPORT = Part[Export]("export")


def export(config: Config, checkpoint_uri: str) -> dict[str, Any]:
    """The checkpoint's task builds, verifies, gates and publishes its artifact."""
    loaded = load_checkpoint(checkpoint_uri)
    task = run_task(loaded.config.train.task, loaded.preprocessor.kind)
    return task.part(EXPORT)(config, loaded, checkpoint_uri)
