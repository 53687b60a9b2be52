"""Concurrent exports into one registry, on local disk and on S3 (moto): `app.export.publish.publish`
called from several threads at once on finished work folders.

Each must get its own version, every version must be complete (manifest naming its own version,
every listed file intact), and `latest` must end at the newest one.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import storage
from app.export.publish import publish
from app.runtime.artifact import LATEST, MANIFEST, read_manifest, sha256_bytes, verify_files
from tests.s3_server import moto_s3

pytestmark = [pytest.mark.integration]
EXPORTS = 6


def work_folder(root: Path, i: int) -> str:
    """What export leaves before publishing: the files, and a manifest listing them (no version)."""
    folder = root / f"work-{i}"
    folder.mkdir()
    files = {"model.onnx": os.urandom(2048), "report.json": json.dumps({"export": i}).encode()}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = {
        "name": "m",
        "version": None,
        "export": i,
        "files": {n: {"sha256": sha256_bytes(d), "size": len(d)} for n, d in files.items()},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return str(folder)


@pytest.fixture(params=["local", "s3"])
def registry(request, tmp_path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "registry")
        return
    with moto_s3() as bucket:
        yield f"{bucket}/registry"


class PointerWatch:
    """Reads `latest` in a loop while the exports run; every value it saw, in order."""

    def __init__(self, uri: str):
        self.uri, self.seen, self._stop = uri, [0], threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.append(storage.read_int(self.uri))
            time.sleep(0.002)

    def __enter__(self) -> PointerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def publish_together(works: list[str], registry: str) -> list[str]:
    barrier = threading.Barrier(len(works))
    uris: list[str] = [""] * len(works)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        barrier.wait()  # all at once: the race the claim must settle
        try:
            uris[i] = publish(works[i], registry, "m")
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(works))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return uris


def test_concurrent_publishes_get_distinct_complete_versions(registry, tmp_path):
    works = [work_folder(tmp_path, i) for i in range(EXPORTS)]
    with PointerWatch(storage.join(registry, "m", LATEST)) as watch:
        uris = publish_together(works, registry)

    versions = [int(uri.rsplit("/", 1)[1]) for uri in uris]
    assert len(set(versions)) == EXPORTS, versions
    assert uris == [storage.join(registry, "m", str(v)) for v in versions]
    exports = set()
    for uri, version in zip(uris, versions, strict=True):
        with tempfile.TemporaryDirectory() as tmp:
            folder = storage.download_dir(uri, tmp)
            manifest = read_manifest(folder)
            assert manifest["version"] == str(version)
            verify_files(folder, manifest)  # every listed file there and intact
            exports.add(manifest["export"])
    assert exports == set(range(EXPORTS))  # each export published once, none lost
    assert storage.read_int(storage.join(registry, "m", LATEST)) == max(versions)
    if storage.is_local(registry):
        # On local disk the pointer is updated under a lock: it never moved backwards.
        assert watch.seen == sorted(watch.seen), watch.seen


def test_next_publish_after_the_race_goes_above_every_claim(registry, tmp_path):
    works = [work_folder(tmp_path, i) for i in range(3)]
    first = publish_together(works[:2], registry)
    after = publish(works[2], registry, "m")
    numbers = [int(u.rsplit("/", 1)[1]) for u in [*first, after]]
    assert numbers[2] > max(numbers[:2])
    assert storage.read_int(storage.join(registry, "m", LATEST)) == numbers[2]
