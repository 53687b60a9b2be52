"""Publishing an export: the artifact's metadata and manifest, and the registry's versioned,
all-or-nothing publish (app/export/exporter.py calls it once the gate has passed).
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from typing import Any

import torch

from app import storage
from app.config import Config
from app.errors import UserError
from app.runtime import artifact as art
from app.runtime import programs as prg
from app.train.checkpoint import LoadedCheckpoint


def write_metadata(
    work: str,
    config: Config,
    loaded: LoadedCheckpoint,
    report: dict[str, Any],
    checkpoint_uri: str,
    schema: dict[str, Any],
    programs: dict[str, prg.ProgramInfo] | None = None,
) -> None:
    import onnx
    import onnxruntime
    import ray

    files = {
        "preprocessor.json": loaded.preprocessor.to_json(),
        "schema.json": json.dumps(schema, indent=2),
        "report.json": json.dumps(report, indent=2, sort_keys=True),
    }
    for name, text in files.items():
        with open(os.path.join(work, name), "w") as f:
            f.write(text + "\n")
    listed = {}
    for name in sorted(os.listdir(work)):
        with open(os.path.join(work, name), "rb") as f:
            data = f.read()
        listed[name] = art.ArtifactFile(sha256=art.sha256_bytes(data), size=len(data))
    manifest = art.ArtifactManifest(
        name=config.artifact_name,
        version=None,  # set at publish time
        created=datetime.now(UTC).isoformat(),
        source_checkpoint=checkpoint_uri,
        base_model=base_model(loaded.preprocessor),
        run_name=loaded.config.train.run_name,
        train_metrics=loaded.meta.metrics,
        workload=config.workload,
        quantization=report["quantization"],
        opset=config.export.opset,
        versions={
            "torch": torch.__version__,
            "ray": ray.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        files=listed,
        programs=programs or {},
    )
    manifest.write(os.path.join(work, art.MANIFEST))


def base_model(pre) -> dict[str, Any] | None:
    """The pretrained folder's provenance (its architecture stays in preprocessor.json)."""
    record = pre.state.get("pretrained")
    if not record:
        return None
    return {k: record.get(k) for k in ("uri", "model_type", "weights_sha256", "license")}


def next_version(registry: str, name: str) -> int:
    """One above every version number already claimed (complete or not) under `<registry>/<name>`."""
    return max(art.versions(storage.join(registry, name)), default=0) + 1


def publish(work: str, registry: str, name: str, attempts: int = 50) -> str:
    """Publish the finished folder `work` as the next version of `<registry>/<name>`; its URI.

    Safe for concurrent exports into one registry, on local disk and on object stores:
    1. claim the number: `storage.claim_dir` on `<name>/<next_version>` (os.mkdir locally, a claim
       object and a listing on object stores) gives each number to one export only; a loser
       recomputes the next number and tries again, so every export gets its own version;
    2. commit: the files go into the claimed folder with `manifest.json` last (locally a staged
       folder renamed onto the claim), so a reader never takes a half-written version for whole;
    3. `latest` moves only forward (`storage.advance_pointer`): it ends at the newest complete
       version whichever export finishes last.
    """
    import random

    folder = storage.join(registry, name)
    manifest_path = os.path.join(work, art.MANIFEST)
    for attempt in range(attempts):
        version = next_version(registry, name)
        uri = storage.join(folder, str(version))
        if not storage.claim_dir(uri):
            # Taken, or every contender lost: back off (exponential, jittered) so that the next
            # round has fewer contenders.
            time.sleep(random.uniform(0, min(0.5, 0.01 * 2**attempt)))
            continue
        manifest = art.read_manifest(work)
        manifest.model_copy(update={"version": str(version)}).write(manifest_path)
        storage.commit_dir(work, uri, art.MANIFEST)
        storage.advance_pointer(
            storage.join(folder, art.LATEST), version, lambda: art.newest_complete_version(folder)
        )
        return uri
    raise UserError(f"{folder}: could not claim a new version number in {attempts} attempts")
