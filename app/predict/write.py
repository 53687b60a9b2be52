"""Writing the output: Parquet parts hashed as they close, the manifest written last (the
commit point), published as a staged folder (local) or uploaded manifest-last (object stores)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.data.prepare import Shard, sha256_file
from app.errors import UserError

log = logging.getLogger(__name__)


MANIFEST = "manifest.json"


REJECTS = "rejects"


class PartWriter:
    """Parquet parts of at most `rows_per_file` rows in a local folder, hashed as they close."""

    def __init__(self, folder: str, rel: str, rows_per_file: int, run: str):
        self.folder, self.rel, self.rows_per_file, self.run = folder, rel, rows_per_file, run
        self.shards: list[Shard] = []
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._path, self._part_rows, self.schema = "", 0, None

    def write(self, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = table.schema
        table = self._conform(table)
        while table.num_rows:
            if self._writer is None:
                self._open()
            take = min(table.num_rows, self.rows_per_file - self._part_rows)
            self._writer.write_table(table.slice(0, take))  # type: ignore[union-attr]
            self._part_rows += take
            self.rows += take
            table = table.slice(take)
            if self._part_rows >= self.rows_per_file:
                self._close()

    def _conform(self, table: pa.Table) -> pa.Table:
        """Every part has the first batch's schema (an id column read as int in one file and as
        text in another is refused, naming it, rather than written as two schemas)."""
        if table.schema.equals(self.schema):
            return table
        try:
            return table.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
            raise UserError(
                f"input: column types differ between files or rows ({str(e).splitlines()[0][:120]})"
            ) from None

    def _open(self) -> None:
        name = f"part-{len(self.shards):05d}-{self.run}.parquet"
        self._path = (
            os.path.join(self.folder, self.rel, name)
            if self.rel
            else os.path.join(self.folder, name)
        )
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._writer = pq.ParquetWriter(self._path, self.schema)
        self._part_rows = 0

    def _close(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        rel = os.path.relpath(self._path, self.folder)
        self.shards.append(Shard(file=rel, rows=self._part_rows, sha256=sha256_file(self._path)))

    def close(self) -> list[Shard]:
        self._close()
        return self.shards


class PredictionManifest(storage.Contract):
    """`<output>/manifest.json`: what a predict run wrote, with every file's sha256; written last."""

    stage: Literal["predict"] = "predict"
    created: str
    artifact: str
    model_name: str
    model_version: str
    variant: str
    input: str
    input_format: str
    id_column: str
    on_bad_rows: str
    rows: dict[str, int]  # input, output, rejected
    files: list[Shard]  # relative to the output folder
    rejects: list[Shard]
    bad_row_examples: list[dict[str, str]] = []


def verify_output(uri: str) -> PredictionManifest:
    """The manifest of a predict output, every listed file hashed against it (one line naming a
    missing or altered file)."""
    manifest = PredictionManifest.read(storage.join(uri, MANIFEST))
    for shard in [*manifest.files, *manifest.rejects]:
        target = storage.join(uri, shard.file)
        try:
            digest = storage.sha256(target)
        except FileNotFoundError:
            raise UserError(f"{target}: missing (listed in {MANIFEST})") from None
        if digest != shard.sha256:
            raise UserError(f"{target}: sha256 differs from {MANIFEST} (altered or truncated)")
    return manifest


def publish(local: str, output: str) -> None:
    """Local disk: the caller filled a `staged_dir`, renamed into place on return. Object
    stores: every file, then the manifest LAST (the commit point), then the files of an earlier
    run that the new manifest does not list."""
    if storage.is_local(output):
        return
    names = [os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs]
    for rel in sorted(n for n in names if n != MANIFEST):
        storage.upload_file(os.path.join(local, rel), storage.join(output, rel))
    storage.upload_file(os.path.join(local, MANIFEST), storage.join(output, MANIFEST))
    for folder in (output, storage.join(output, REJECTS)):
        for name in storage.list_dir(folder):
            rel = os.path.relpath(storage.join(folder, name), output)
            if name.startswith("part-") and rel not in names:
                storage.delete_file(storage.join(folder, name))


def refuse_foreign_output(output: str) -> None:
    """Never replace a folder that is not an earlier predict output (a typo in --output)."""
    if not storage.exists(output) or not storage.list_dir(output):
        return
    if not storage.is_file(storage.join(output, MANIFEST)):
        raise UserError(f"{output}: exists and is not a predict output; choose another --output")
    PredictionManifest.read(storage.join(output, MANIFEST))  # refuses another stage's manifest


@contextlib.contextmanager
def _output_folder(output: str) -> Iterator[str]:
    """A local folder to fill: a staged folder renamed into `output` on success (local disk),
    or a temporary one that `publish` uploads (object stores)."""
    if storage.is_local(output):
        with storage.staged_dir(output) as local:
            yield local
    else:
        with tempfile.TemporaryDirectory(prefix="predict-") as local:
            yield local
