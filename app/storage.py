"""Local paths and pyarrow-filesystem URIs (s3://, gs://, ...) behind one small API.

Two ways to publish a folder so that a reader never takes a half-written one for whole:

- Local disk: the folder is filled under a `.staging-` sibling and renamed into place
  (`staged_dir`, `commit_dir`); a rename on one filesystem is atomic.
- Object stores have no folder rename (pyarrow refuses to move a prefix on S3/GCS: it would be
  one copy per object). There every file is written under its final key and a manifest written
  LAST is the commit point; readers trust a folder only through its manifest. A single object
  write is atomic there: a reader sees the old object or the new one, never a part.

Object-store credentials and endpoint come from pyarrow's (the AWS SDK's) usual sources, the same
in the driver, Ray workers and Serve replicas: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_ENDPOINT_URL_S3` (an S3-compatible server such as MinIO), instance roles. URIs stay plain
`s3://bucket/path` so that they can be joined and passed between stages as text.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict, ValidationError

from app.errors import UserError, validation_line

STAGING_MARK = ".staging-"
CLAIM_MARK = ".claim-"
CHUNK = 1 << 20


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" in uri and not uri.startswith("file://"):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), str(Path(uri.removeprefix("file://")).absolute())


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def resolved(uri: str) -> str:
    """A local path made absolute (what it names does not depend on a process's working
    directory); a URI as it is."""
    return uri if not is_local(uri) else str(Path(uri.removeprefix("file://")).absolute())


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_file(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type == pafs.FileType.File


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def sha256(uri: str) -> str:
    """sha256 of one file, streamed (shards can be larger than memory). FileNotFoundError if absent."""
    fs, path = filesystem(uri)
    # pyarrow's S3 raises a plain OSError for a missing key: ask first, so both stores agree.
    if fs.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(uri)
    digest = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes(uri: str, data: bytes) -> None:
    """Write one file atomically: locally a temporary sibling then a rename; on an object store
    one write, which is atomic there (a temporary key and a "move" would be a copy and a delete)."""
    fs, path = filesystem(uri)
    if not is_local(uri):
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    fs.create_dir(os.path.dirname(path), recursive=True)
    tmp = f"{path}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fsync(tmp)  # on disk before the rename makes it visible: a crash leaves old or new, whole
    fs.move(tmp, path)
    fsync(os.path.dirname(path))


def write_json(uri: str, obj: Any) -> None:
    write_bytes(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


# --- typed JSON files -------------------------------------------------------------------------

C = TypeVar("C", bound="Contract")


class Contract(BaseModel):
    """A JSON file that one module writes and others (tools, tests, other stages) read.

    The module that writes the file owns its subclass; every reader goes through it, so the
    shape is declared once. A file of the wrong shape (missing key, wrong type, not JSON) is
    refused whole with one line naming the file and the field (`error`, a UserError), never a
    KeyError later. Unknown keys are kept, not refused: a newer writer may add some, and a
    rewrite (publish setting the version) must not drop them.
    """

    model_config = ConfigDict(extra="allow", frozen=True, validate_by_name=True)
    error: ClassVar[type[UserError]] = UserError  # what a bad file is refused with

    @classmethod
    def parse(cls: type[C], data: Any, source: str) -> C:
        """`data` (decoded JSON) as this contract; `source` names the file in a refusal."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise cls.error(f"{source}: {validation_line(e, data)}") from None

    @classmethod
    def parse_json(cls: type[C], raw: bytes | str, source: str) -> C:
        try:
            data = json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
            raise cls.error(f"{source}: not valid JSON ({str(e).splitlines()[0]})") from None
        return cls.parse(data, source)

    @classmethod
    def read(cls: type[C], uri: str) -> C:
        try:
            raw = read_bytes(uri)
        except FileNotFoundError:
            raise cls.error(f"{uri}: missing") from None
        return cls.parse_json(raw, uri)

    def to_json_dict(self) -> dict[str, Any]:
        """The file's content: JSON keys (aliases), unknown keys kept."""
        return self.model_dump(mode="json", by_alias=True)

    def write(self, uri: str) -> None:
        write_json(uri, self.to_json_dict())

    def __getitem__(self, key: str) -> Any:
        """Read access by JSON key, for tools written against the plain JSON (bench, tests);
        app code uses the attributes."""
        for name, field in type(self).model_fields.items():
            if (field.alias or name) == key:
                return getattr(self, name)
        if self.model_extra and key in self.model_extra:
            return self.model_extra[key]
        raise KeyError(key)


def upload_file(local: str, uri: str) -> None:
    """Copy one local file to `uri`, streamed (on an object store the object appears whole)."""
    fs, path = filesystem(uri)
    if is_local(uri):
        fs.create_dir(os.path.dirname(path), recursive=True)
    with open(local, "rb") as src, fs.open_output_stream(path) as dst:
        shutil.copyfileobj(src, dst, CHUNK)  # type: ignore[misc]  # a pyarrow stream is file-like


def download_file(uri: str, local: str) -> None:
    """Copy the file `uri` to the local path `local`, streamed."""
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as src, open(local, "wb") as dst:
        shutil.copyfileobj(src, dst, CHUNK)  # type: ignore[misc]  # a pyarrow stream is file-like


@contextlib.contextmanager
def local_path_for(uri: str) -> Iterator[str]:
    """A local path through which to write the file `uri`: the path itself when local, else a
    temporary file uploaded to `uri` when the block succeeds (lets pyarrow.parquet, torch or any
    writer that wants a path write to an object store)."""
    if is_local(uri):
        path = filesystem(uri)[1]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, os.path.basename(uri.rstrip("/")))
        yield path
        upload_file(path, uri)


def list_files(uri: str) -> list[tuple[str, int, int]]:
    """(relative name, size, mtime in ns) of every file under `uri`, recursively, sorted."""
    fs, path = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    root = path.rstrip("/") + "/"
    return sorted(
        (i.path.removeprefix(root), i.size or 0, i.mtime_ns or 0)
        for i in infos
        if i.type == pafs.FileType.File
    )


def list_dir(uri: str) -> list[str]:
    """Entry names in `uri` ([] when it does not exist)."""
    fs, path = filesystem(uri)
    if is_local(uri):
        # One readdir: pyarrow's listing also stats each entry, and fails the whole listing
        # when a concurrent publish renames one away in between.
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(os.path.basename(i.path) for i in infos)


def delete_dir(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


def delete_file(uri: str) -> None:
    fs, path = filesystem(uri)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(path)


@contextlib.contextmanager
def staged_dir(uri: str, replace: bool = True) -> Iterator[str]:
    """Yield a local folder to fill; on success it becomes the local folder `uri` in one rename.

    On any exception the staging folder is removed and `uri` is left as it was; the previous
    folder is removed only once the new one is in place. Local destinations only: object stores
    cannot rename a folder (publish there with files first and a manifest last).
    """
    if not is_local(uri):
        raise ValueError(f"{uri}: staged_dir renames a folder, which only a local disk can do")
    dest = filesystem(uri)[1]
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    staging = f"{dest}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
    os.makedirs(staging)
    try:
        yield staging
        fsync_tree(staging)
        _swap_local(staging, dest, replace)
        fsync(os.path.dirname(dest))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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


def fsync(path: str) -> None:
    """Flush a local file, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Every file under `root`, then the folders themselves: what a rename is about to publish
    is on disk before it, so a crash right after leaves no published file empty or torn."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync(os.path.join(folder, name))
        fsync(folder)


def download_dir(uri: str, local: str) -> str:
    """Return a local folder holding `uri`'s files (the folder itself when already local)."""
    if is_local(uri):
        return filesystem(uri)[1]
    fs, src = filesystem(uri)
    pafs.copy_files(src, local, source_filesystem=fs)
    return local


# --- claiming a name, committing a folder, a pointer that only moves forward ----------------------


def claim_dir(uri: str) -> bool:
    """Try to take the folder name `uri` for this caller alone; True when it is now ours.

    Exactly one of any number of concurrent callers (threads, processes, machines) gets True for a
    given name, and never one after a folder was published there.

    - Local disk: `os.mkdir`, which is atomic; the claimed folder stays empty until `commit_dir`.
    - Object stores: pyarrow has no write-if-absent, so each caller writes its own claim object
      `<uri>/.claim-<random>` and then lists `<uri>/`. It wins only if its claim is the only entry
      there; otherwise it deletes its claim and loses. Two winners are impossible on a store with
      read-after-write listing (S3 and GCS guarantee it): if A and B both won, A listed before B
      wrote (A did not see B) and B listed before A wrote, but each writes before it lists, so
      A wrote < A listed < B wrote < B listed < A wrote. A winner never deletes its claim, so a
      later caller always sees it and loses. Contenders can all lose (each saw the other): they
      retry with another name; the name is then skipped, never given twice.
    """
    fs, path = filesystem(uri)
    if is_local(uri):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path)
        except FileExistsError:
            return False
        return True
    mine = f"{CLAIM_MARK}{uuid.uuid4().hex}"
    write_bytes(join(uri, mine), b"")
    if list_dir(uri) == [mine]:
        return True
    delete_file(join(uri, mine))
    return False


def commit_dir(local: str, uri: str, commit_file: str) -> None:
    """Publish the files of the local folder `local` into `uri`, a folder `claim_dir` gave us.

    Local disk: copied into a staging sibling, then renamed onto the claimed (empty) folder, which
    rename(2) does atomically. Object stores: every file under its final key, `commit_file` (the
    manifest) LAST, so the folder counts only once it is complete.
    """
    names = sorted(os.listdir(local))
    if commit_file not in names:
        raise FileNotFoundError(os.path.join(local, commit_file))
    if is_local(uri):
        dest = filesystem(uri)[1]
        staging = f"{dest}{STAGING_MARK}{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(local, staging)
            fsync_tree(staging)
            os.rename(staging, dest)  # replaces the empty claimed folder in one step
            fsync(os.path.dirname(dest))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return
    for name in [n for n in names if n != commit_file] + [commit_file]:
        upload_file(os.path.join(local, name), join(uri, name))


def read_int(uri: str) -> int:
    """The integer a pointer file holds; 0 when there is none yet (or it holds no number)."""
    if not is_file(uri):
        return 0
    try:
        return int(read_bytes(uri).decode().strip())
    except ValueError:
        return 0


def advance_pointer(uri: str, value: int, highest: Callable[[], int], attempts: int = 50) -> int:
    """Make the integer file `uri` hold at least `value`, never a smaller number than it holds.

    `highest()` is the largest value any caller may write (for a registry: the newest complete
    version); it must be >= `value` once the caller's own work is complete. Returns what `uri` holds.

    - Local disk: read-compare-write under an exclusive `flock` on the parent folder (no extra
      file), so the pointer only ever moves forward.
    - Object stores have no compare-and-swap in pyarrow, so: read; if it is below `highest()`,
      write `highest()`; read again; repeat until the pointer is at least `highest()`. A writer
      that read an old listing can overwrite a newer value, but every writer re-reads after its
      own write and lists again, and the last writer lists after every complete version was
      published, so once all publishers have returned the pointer holds the newest version. The
      window in which it can lag is one write long and is repaired by the writer that caused it.
    """
    if is_local(uri):
        folder = os.path.dirname(filesystem(uri)[1])
        os.makedirs(folder, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = read_int(uri)
            if value > current:
                write_bytes(uri, f"{value}\n".encode())
                return value
            return current
        finally:
            os.close(fd)  # releases the lock
    current = 0
    for attempt in range(attempts):
        current = read_int(uri)
        target = max(value, highest())
        if current >= target:
            return current
        write_bytes(uri, f"{target}\n".encode())
        if attempt:  # contended: let the other writers finish their write and re-read
            time.sleep(random.uniform(0, 0.02 * attempt))
    return current
