"""Writing the output: Parquet parts written to `<output>/_run-<id>/` by the tasks that hold the
predictions (`PieceOutput`: one record of what it wrote comes back to the driver), the manifest
written last as the commit.

- Parts go straight to the output (local disk), or are uploaded and dropped one by one (object
  stores): nothing passes through the driver, nothing is staged whole on any disk.
- A run's folder starts with `_`, which pyarrow, Spark and Ray Data skip when they read a
  folder: until the manifest names its parts, no reader counts them, and a run that crashes
  leaves only such a folder behind.
- The manifest is one atomic write (a fsynced rename locally, one PUT on object stores). After
  it, the parts of the manifest it replaced are deleted: never those of the manifest now in
  place, so two runs to one output cannot leave a manifest naming deleted parts.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.data.prepare import Shard
from app.data.reasons import Reasons
from app.errors import UserError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
REJECTS = "rejects"
RUN_MARK = "_run-"
# Taken (storage.claim_dir) by the first run to commit: a run without --overwrite that finds it
# taken lost a race to another run to the same output, and publishes nothing.
COMMIT_CLAIM = f"{RUN_MARK}committed"


class PartWriter:
    """Parquet parts of at most `rows_per_file` rows under `<output>/<rel>/`, each hashed as it
    closes and, on an object store, uploaded and removed from local disk at once."""

    def __init__(self, output: str, rel: str, rows_per_file: int, run: str):
        self.output, self.rel, self.rows_per_file, self.run = output, rel, rows_per_file, run
        self.local = storage.is_local(output)
        self._tmp = None if self.local else tempfile.TemporaryDirectory(prefix="predict-part-")
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

    def _rel_name(self) -> str:
        name = f"part-{len(self.shards):05d}-{self.run}.parquet"
        return f"{self.rel}/{name}" if self.rel else name

    def _open(self) -> None:
        rel = self._rel_name()
        root = storage.filesystem(self.output)[1] if self.local else self._tmp.name  # type: ignore[union-attr]
        self._path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._writer = pq.ParquetWriter(self._path, self.schema)
        self._part_rows = 0

    def _close(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        rel = self._rel_name()
        shard = Shard(file=rel, rows=self._part_rows, sha256=storage.sha256(self._path))
        if self.local:
            storage.fsync(self._path)
        else:
            storage.upload_file(self._path, storage.join(self.output, rel))
            os.remove(self._path)
        self.shards.append(shard)

    def close(self) -> list[Shard]:
        self._close()
        if self._tmp is not None:
            self._tmp.cleanup()
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
    bad_row_reasons: list[dict[str, Any]] = []  # each reason's rows and first example


@dataclass
class Written:
    """What one actor wrote of a piece: its parts and rejects, their counts, the first rejects
    (id, reason) and the predictions' schemas (every part must share one)."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    output: int = 0
    rejected: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)
    schemas: list[str] = field(default_factory=list)
    reasons: dict[str, Any] = field(default_factory=dict)  # app/data/reasons.py's, as a dict


@dataclass(frozen=True)
class Destination:
    """Where a run's parts go and how they are cut."""

    output: str
    run: str  # the run's folder under the output, `_run-<id>`
    id_column: str
    rows_per_file: int
    examples: int  # rejects named in a piece's record


class PieceOutput:
    """A piece's predictions and rejects streamed into parts named by the piece's number
    (`<run>/part-<n>-<piece>.parquet`, rejects under `<run>/rejects/`), batch by batch; the
    record of what was written at the end."""

    def __init__(self, to: Destination, piece: int):
        from app.predict.actor import split_predictions

        self.split, self.to, self.done = split_predictions, to, Written()
        self.reasons = Reasons()
        tag = f"{piece:06d}"
        self.good = PartWriter(to.output, to.run, to.rows_per_file, tag)
        self.bad = PartWriter(to.output, f"{to.run}/{REJECTS}", to.rows_per_file, tag)

    def add(self, scored: pa.Table) -> bool:
        """One scored batch written; False when its predictions' schema differs from the
        piece's first (the driver refuses the run, naming both)."""
        good, bad = self.split(scored, self.to.id_column)
        done = self.done
        if good.num_rows:
            schema = str(good.schema)
            if done.schemas and schema != done.schemas[0]:
                done.schemas.append(schema)
                return False
            done.schemas[:1] = [schema]
            self.good.write(good)
        if bad.num_rows:
            self.bad.write(bad)
        room = max(self.to.examples - len(done.examples), 0)
        done.examples += [
            {"id": r["id"], "reason": r["reason"]} for r in bad.slice(0, room).to_pylist()
        ]
        for r in bad.select(["id", "reason"]).to_pylist():
            self.reasons.add(r["reason"], example=f"id {r['id']}: {r['reason']}")
        done.output += good.num_rows
        done.rejected += bad.num_rows
        return True

    def close(self) -> Written:
        self.done.reasons = asdict(self.reasons)
        self.done.parts = [s.model_dump() for s in self.good.close()]
        self.done.rejects = [s.model_dump() for s in self.bad.close()]
        return self.done


def records_table(written: list[Written]) -> pa.Table:
    return pa.table({"written": [json.dumps(asdict(w)) for w in written]})


def written_records(table: pa.Table) -> list[Written]:
    return [Written(**json.loads(w)) for w in table["written"].to_pylist()]


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


def check_output(output: str, overwrite: bool) -> None:
    """An existing output is never replaced silently, and a folder that is not a predict output
    (a typo in --output) never at all."""
    if not storage.exists(output) or not storage.list_dir(output):
        return
    manifest = storage.join(output, MANIFEST)
    if not storage.is_file(manifest):
        names = storage.list_dir(output)
        if COMMIT_CLAIM in names and not overwrite:
            raise UserError(
                f"{output}: a predict run died while committing there; pass --overwrite"
            )
        if all(n.startswith(RUN_MARK) for n in names):
            return  # only runs that never committed (crashed, or writing now)
        raise UserError(f"{output}: exists and is not a predict output; choose another --output")
    PredictionManifest.read(manifest)  # refuses another stage's manifest
    if not overwrite:
        raise UserError(f"{output}: holds predictions already; pass --overwrite to replace them")


def commit(output: str, manifest: PredictionManifest, overwrite: bool = True) -> None:
    """Write the manifest (the commit point), then delete the parts of the one it replaced.

    Every run claims the output as it commits; without `overwrite`, a claim already taken means
    another run committed there since this one's start check, and nothing is written."""
    uri = storage.join(output, MANIFEST)
    claimed = storage.claim_dir(storage.join(output, COMMIT_CLAIM))
    if not claimed and not overwrite:
        raise UserError(
            f"{output}: another predict run committed there while this one ran; nothing of "
            "this run is kept (pass --overwrite to replace its predictions)"
        )
    replaced = PredictionManifest.read(uri) if storage.is_file(uri) else None
    try:
        manifest.write(uri)  # atomic: a fsynced rename locally, one PUT on an object store
    except BaseException:
        if claimed and replaced is None:  # the output stays as it was: unclaimed
            storage.delete_dir(storage.join(output, COMMIT_CLAIM))
        raise
    if replaced is None:
        return
    kept = {s.file for s in [*manifest.files, *manifest.rejects]}
    for shard in [*replaced.files, *replaced.rejects]:
        if shard.file not in kept:
            storage.delete_file(storage.join(output, shard.file))
    for folder in {s.file.split("/", 1)[0] for s in [*replaced.files, *replaced.rejects]}:
        if folder.startswith(RUN_MARK) and not any(f.startswith(f"{folder}/") for f in kept):
            storage.delete_dir(storage.join(output, folder))
