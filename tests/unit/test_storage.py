"""app/storage.py on local disk: claiming a name, committing a folder, a forward-only pointer.

The same protocols on an object store (a real S3 API, moto) are in tests/integration/test_s3.py
and tests/integration/test_publish.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from app import storage
from tests.unit.unit_helpers import staging_leftovers

pytestmark = pytest.mark.unit


def run_together(n: int, fn) -> list:
    """Call fn(i) from n threads released at once; the results in thread order."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_claim_dir_gives_a_name_to_one_caller_only(tmp_path):
    target = str(tmp_path / "registry" / "m" / "1")
    wins = run_together(8, lambda i: storage.claim_dir(target))
    assert wins.count(True) == 1
    assert os.path.isdir(target) and os.listdir(target) == []
    assert storage.claim_dir(target) is False  # and never again


def test_commit_dir_replaces_the_claimed_folder_in_one_rename(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.bin").write_bytes(b"weights")
    (work / "manifest.json").write_text("{}")
    target = str(tmp_path / "registry" / "m" / "1")
    assert storage.claim_dir(target)
    storage.commit_dir(str(work), target, "manifest.json")
    assert sorted(os.listdir(target)) == ["manifest.json", "model.bin"]
    assert staging_leftovers(tmp_path) == []


def test_commit_dir_needs_its_commit_file(tmp_path):
    (tmp_path / "work").mkdir()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        storage.commit_dir(str(tmp_path / "work"), str(tmp_path / "dest"), "manifest.json")


def test_advance_pointer_only_moves_forward(tmp_path):
    pointer = str(tmp_path / "m" / "latest")
    assert storage.read_int(pointer) == 0
    assert storage.advance_pointer(pointer, 3, lambda: 3) == 3
    assert storage.advance_pointer(pointer, 2, lambda: 3) == 3  # an older version: no change
    assert Path(pointer).read_text().strip() == "3"
    assert storage.advance_pointer(pointer, 4, lambda: 4) == 4


def test_advance_pointer_under_contention_ends_at_the_maximum(tmp_path):
    pointer = str(tmp_path / "m" / "latest")
    values = list(range(1, 17))
    run_together(len(values), lambda i: storage.advance_pointer(pointer, values[i], lambda: 16))
    assert storage.read_int(pointer) == 16
    assert sorted(os.listdir(tmp_path / "m")) == ["latest"]  # the lock leaves no file


def test_staged_dir_refuses_an_object_store():
    with pytest.raises(ValueError, match="local disk"), storage.staged_dir("s3://bucket/data"):
        pass


def test_sha256_streams_and_names_a_missing_file(tmp_path):
    path = tmp_path / "big.bin"
    data = os.urandom(3 * storage.CHUNK + 5)
    path.write_bytes(data)
    assert storage.sha256(str(path)) == hashlib.sha256(data).hexdigest()
    with pytest.raises(FileNotFoundError):
        storage.sha256(str(tmp_path / "nothing"))


def test_local_path_for_a_local_uri_is_the_path_itself(tmp_path):
    uri = str(tmp_path / "a" / "b.txt")
    with storage.local_path_for(uri) as path:
        Path(path).write_text("hi")
    assert path == uri and Path(uri).read_text() == "hi"


def test_write_bytes_is_atomic_and_leaves_no_temporary(tmp_path):
    uri = str(tmp_path / "x" / "f.json")
    storage.write_json(uri, {"a": 1})
    storage.write_json(uri, {"a": 2})
    assert json.loads(storage.read_bytes(uri)) == {"a": 2}
    assert staging_leftovers(tmp_path) == []


def test_local_publishes_are_on_disk_before_their_rename(tmp_path, monkeypatch):
    """A file and its folder are fsynced before the rename that publishes them, the parent
    after it: a crash then leaves the old version or the new one, never an empty file."""
    import os

    from app import storage

    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    dest = tmp_path / "dataset"
    with storage.staged_dir(str(dest)) as staging:
        (Path(staging) / "part-0.parquet").write_bytes(b"rows")
    kinds = [k for k, _ in events]
    renamed = kinds.index("rename")
    synced = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert any(p.endswith("part-0.parquet") for p in synced)
    assert any(".staging" in p or p.endswith(os.path.basename(staging)) for p in synced)
    assert ("fsync", str(tmp_path)) in events[renamed:]
    assert (dest / "part-0.parquet").read_bytes() == b"rows"


def test_a_latest_pointer_that_is_not_a_version_number_is_refused(tmp_path):
    from app.errors import ArtifactError
    from app.runtime.artifact import resolve

    model = tmp_path / "registry" / "digits"
    model.mkdir(parents=True)
    (model / "latest").write_text("../../../etc\n")
    with pytest.raises(ArtifactError, match="not a version number"):
        resolve(str(model / "latest"))
