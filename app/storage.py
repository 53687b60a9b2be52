"""Local paths and pyarrow-filesystem URIs (s3://, gs://, ...) behind one small API.

Outputs are staged under a temporary sibling name and moved into place only when complete, so a
failed or killed job never leaves something a later stage would take for whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

STAGING_MARK = ".staging-"


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" in uri and not uri.startswith("file://"):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), str(Path(uri.removeprefix("file://")).absolute())


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def read_json(uri: str) -> Any:
    return json.loads(read_bytes(uri))


def write_bytes(uri: str, data: bytes) -> None:
    """Write one file atomically: a temporary sibling, then a rename."""
    fs, path = filesystem(uri)
    fs.create_dir(os.path.dirname(path), recursive=True)
    tmp = f"{path}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def write_json(uri: str, obj: Any) -> None:
    write_bytes(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def list_dir(uri: str) -> list[str]:
    fs, path = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(os.path.basename(i.path) for i in infos)


def delete_dir(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


@contextlib.contextmanager
def staged_dir(uri: str, replace: bool = True) -> Iterator[str]:
    """Yield a local folder to fill; on success it becomes `uri` in one move.

    On any exception the staging folder is removed and `uri` is left as it was. For a local
    destination the final step is a rename on the same filesystem (atomic); for object stores it
    is an upload to a staging prefix followed by a server-side move, and readers should trust a
    folder only through the manifest that is written last.
    """
    fs, dest = filesystem(uri)
    fs.create_dir(os.path.dirname(dest), recursive=True)
    if is_local(uri):
        staging = f"{dest}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
        os.makedirs(staging)
        try:
            yield staging
            _swap_local(staging, dest, replace)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return
    with tempfile.TemporaryDirectory() as local:
        yield local
        staging = f"{dest}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
        pafs.copy_files(local, staging, destination_filesystem=fs)
        if replace and fs.get_file_info(dest).type != pafs.FileType.NotFound:
            fs.delete_dir(dest)
        fs.move(staging, dest)


def _swap_local(staging: str, dest: str, replace: bool) -> None:
    if not os.path.exists(dest):
        os.rename(staging, dest)
        return
    if not replace:
        raise FileExistsError(dest)
    old = f"{dest}{STAGING_MARK}old-{uuid.uuid4().hex[:8]}"
    os.rename(dest, old)
    os.rename(staging, dest)
    shutil.rmtree(old, ignore_errors=True)


def upload_dir(local: str, uri: str) -> None:
    fs, dest = filesystem(uri)
    fs.create_dir(dest, recursive=True)
    pafs.copy_files(local, dest, destination_filesystem=fs)


def download_dir(uri: str, local: str) -> str:
    """Return a local folder holding `uri`'s files (the folder itself when already local)."""
    if is_local(uri):
        return filesystem(uri)[1]
    fs, src = filesystem(uri)
    pafs.copy_files(src, local, source_filesystem=fs)
    return local
