"""Pictures and captions from a table or a Karpathy-split JSON (`data.source: image_text`),
prepared in pieces (app/data/pieces.py): a task reads its rows, reads and checks each row's
picture (app/data/pictures.py: `PictureReader`) and writes the picture's encoded bytes, the
caption, the picture's id and the table's other columns, a few hundred rows at a time.

A Parquet table is cut into runs of its row groups of about PICTURE_ROWS_PER_PIECE rows. A CSV
or JSONL file cannot be cut where a task starts reading, and a Karpathy JSON is one document: a
task each lists its rows (picture, caption, the rest as text, where each came from; Karpathy's
split) into a Parquet file in the generation, whose runs of rows tasks then prepare; the
listings are removed once the pieces are done. A row's split is
a pure function of (`data.seed`, its picture), so a picture's captions share one; Karpathy's
rows keep their own split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.config import Config, DataConfig
from app.data import table_source as tables
from app.data.pictures import CAPTION, IMAGE, IMAGE_ID, KARPATHY_SPLITS, RESERVED, PictureReader
from app.data.pieces import SPLITS, PieceResult, ShardWriter, SourcePlan, Target, Tasks, row_keys
from app.errors import UserError

PICTURE_ROWS_PER_PIECE = 5_000
READ_ROWS = 1_024  # table rows read at a time (a Parquet table may hold the pictures' bytes)
WRITE_ROWS = 256  # rows (their pictures' bytes) written at a time, a row group each
RECENT_PICTURES = 32  # pictures a task remembers: a picture's captions are usually adjacent
LISTING = "_listing.parquet"  # the Karpathy JSON's rows, in the generation while it is written
WHERE, SPLIT = "where", "split"


@dataclass(frozen=True)
class Rows:
    """How a task reads its piece's rows: which columns hold the picture and caption, what
    else travels with them, where pictures lie and whether rows carry their own split."""

    image: str
    caption: str
    extra: tuple[str, ...]
    images_root: str | None  # None: each table's own folder
    own_split: bool  # a `split` column says each row's split (Karpathy's)
    schema: pa.Schema  # what the shards hold
    max_examples: int = 5


@dataclass(frozen=True)
class PicturePiece:
    """A run of rows to prepare: of a Parquet table itself, or of a listing this job wrote of
    a CSV/JSONL table or a Karpathy JSON (whose `where` column names each row's origin)."""

    piece: tables.Piece
    origin: str  # the source file: a relative picture path is read under its folder
    listed: bool

    @property
    def index(self) -> int:
        return self.piece.index


def planned(config: Config, tasks: Tasks, folder: str) -> SourcePlan:
    cfg = config.data
    if cfg.format == "karpathy":
        return _karpathy_plan(cfg, tasks, folder)
    files = tables.table_files(cfg.path)
    names = tables.column_names(files[0])
    for column in (cfg.image_column, cfg.caption_column):
        if column not in names:
            raise UserError(f"{files[0]}: missing column {column!r} (has {names})")
    extra = [c for c in names if c not in (cfg.image_column, cfg.caption_column)]
    for column in extra:
        if column in RESERVED:
            raise UserError(
                f"{files[0]}: column {column!r} is a name prepare writes itself "
                f"({', '.join(RESERVED)}); rename it"
            )
    schema = _schema(files[0], extra)
    rows = Rows(cfg.image_column, cfg.caption_column, tuple(extra), None, False, schema)
    # A CSV or JSONL file cannot be cut where a task starts reading: one task each lists it
    # (picture, caption, the rest, as text) so that many can read its pictures.
    listings = {
        f: storage.join(folder, f"_listing-{i:05d}.parquet")
        for i, f in enumerate(files)
        if not f.lower().endswith(".parquet")
    }
    if listings:
        write = functools.partial(write_table_listing, rows=rows, group_rows=READ_ROWS)
        problems = tasks.map(write, list(listings.items()), "prepare: list")
        first = next((p for p in problems if p), None)
        if first:
            raise UserError(first)
    pieces = [
        PicturePiece(p, f, f in listings)
        for i, f in enumerate(files)
        for p in tables.file_pieces(listings.get(f, f), i, PICTURE_ROWS_PER_PIECE)
    ]
    description = {"source": "image_text", "path": cfg.path, "format": "table"}
    return _plan(cfg, rows, pieces, description, tuple(listings.values()))


def _plan(
    cfg: DataConfig,
    rows: Rows,
    pieces: list[PicturePiece],
    described: dict[str, Any],
    scratch: tuple[str, ...],
) -> SourcePlan:
    return SourcePlan(
        kind="image_text",
        features=tuple(rows.schema.names),
        label="",
        schema=rows.schema,
        pieces=pieces,
        run=functools.partial(prepare_piece, rows=rows, cfg=cfg),
        description=described,
        skip_bad_rows=cfg.skip_bad_rows,
        own_split=rows.own_split,
        scratch=scratch,
    )


def _schema(first_file: str, extra: list[str]) -> pa.Schema:
    """Picture bytes, caption, picture id, then the other columns: bytes where the first file
    stores bytes (Parquet), text otherwise."""
    binary: set[str] = set()
    if first_file.lower().endswith(".parquet"):
        arrow = tables.parquet_file(first_file).schema_arrow
        binary = {f.name for f in arrow if pa.types.is_binary(f.type)}
        binary |= {f.name for f in arrow if pa.types.is_large_binary(f.type)}
    fields = [(IMAGE, pa.binary()), (CAPTION, pa.string()), (IMAGE_ID, pa.string())]
    fields += [(c, pa.binary() if c in binary else pa.string()) for c in extra]
    return pa.schema(fields)


def write_table_listing(job: tuple[str, str], rows: Rows, group_rows: int) -> str | None:
    """A CSV or JSONL table's rows, their values as text, into a Parquet listing (`job`: the
    table, the listing); a problem is returned as the line to refuse the source with."""
    source, listing = job
    wanted = [rows.image, rows.caption, *rows.extra]
    schema = pa.schema([(WHERE, pa.string()), *((c, pa.string()) for c in wanted)])
    try:
        with storage.local_path_for(listing) as local, pq.ParquetWriter(local, schema) as out:
            for values, first in _text_batches(source, wanted):
                count = len(values[rows.image])
                columns: dict[str, list[str | None]] = {
                    WHERE: [f"{source} row {first + i}" for i in range(count)]
                }
                columns |= {c: [_text(v) for v in values[c]] for c in wanted}
                out.write_table(pa.table(columns, schema), row_group_size=group_rows)
    except KeyError as e:
        return f"{source}: missing column {e.args[0]!r}"
    except (OSError, pa.ArrowException, ValueError) as e:
        return f"{source}: cannot read ({type(e).__name__}: {tables.first_line(e)})"
    return None


def _text_batches(path: str, wanted: list[str]) -> Iterator[tuple[dict[str, list[Any]], int]]:
    piece = tables.Piece(0, path)
    if path.lower().endswith(".csv"):
        for table, row in tables.batches(piece, rows=READ_ROWS):
            yield {c: table[c].to_pylist() for c in wanted}, row
        return
    row = 0
    for frame in tables.json_frames(path, READ_ROWS):
        yield {c: frame[c].tolist() for c in wanted}, row
        row += len(frame)


def _text(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and value != value):  # NaN: missing
        return None
    return value if isinstance(value, str) else str(value)


# --- Karpathy's JSON: listed by one task, prepared by many --------------------------------------


def _karpathy_plan(cfg: DataConfig, tasks: Tasks, folder: str) -> SourcePlan:
    assert cfg.path is not None
    listing = storage.join(folder, LISTING)
    write = functools.partial(write_listing, cfg=cfg, group_rows=PICTURE_ROWS_PER_PIECE)
    [problem] = tasks.map(write, [listing], "prepare: list")
    if problem:
        raise UserError(problem)
    root = cfg.images or _folder_of(cfg.path)
    rows = Rows(IMAGE, CAPTION, (), root, True, _schema(listing, []))
    pieces = [
        PicturePiece(p, cfg.path, True)
        for p in tables.file_pieces(listing, 0, PICTURE_ROWS_PER_PIECE)
    ]
    description = {"source": "image_text", "path": cfg.path, "format": "karpathy"}
    return _plan(cfg, rows, pieces, description, (listing,))


def _folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(os.path.abspath(path))


def write_listing(listing: str, cfg: DataConfig, group_rows: int) -> str | None:
    """The JSON's rows (a caption each) into a Parquet listing, a piece's rows a row group; a
    problem is returned as the line to refuse the source with."""
    assert cfg.path is not None
    try:
        document = json.loads(storage.read_bytes(cfg.path))
        images = document["images"]
        if not isinstance(images, list):
            raise TypeError("images is not a list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{cfg.path}: not a Karpathy-split JSON ({type(e).__name__}: {e})"
    columns: dict[str, list[Any]] = {WHERE: [], IMAGE: [], CAPTION: [], SPLIT: []}
    for i, entry in enumerate(images):
        where = f"{cfg.path} images[{i}]"
        if not isinstance(entry, dict) or "filename" not in entry or "sentences" not in entry:
            return f"{where}: expected an object with filename and sentences"
        split = entry.get("split", "train")
        if split not in KARPATHY_SPLITS:
            return f"{where}: split {str(split)[:40]!r} is none of {', '.join(KARPATHY_SPLITS)}"
        path = os.path.join(str(entry.get("filepath", "")), str(entry["filename"]))
        for sentence in entry["sentences"]:
            raw = sentence.get("raw") if isinstance(sentence, dict) else None
            columns[WHERE].append(where)
            columns[IMAGE].append(path)
            columns[CAPTION].append(raw if isinstance(raw, str) else None)
            columns[SPLIT].append(KARPATHY_SPLITS[split])
    del document, images
    with storage.local_path_for(listing) as local:
        pq.write_table(pa.table(columns), local, row_group_size=group_rows)
    return None


# --- one piece, in one task ---------------------------------------------------------------------


def prepare_piece(piece: PicturePiece, target: Target, rows: Rows, cfg: DataConfig) -> PieceResult:
    """The piece's rows with their pictures read and checked, written to their splits' shards;
    a row whose picture or caption is bad is counted and named (by file and row)."""
    out = PieceResult(piece.index)
    writer = ShardWriter(target, piece.index, rows.schema)
    base = rows.images_root or _folder_of(piece.origin)
    reader = _Recent(PictureReader(base, cfg))
    pending: dict[str, list[Any]] = {name: [] for name in [*rows.schema.names, SPLIT]}
    try:
        for batch, first_row in _column_batches(piece, rows):
            problems: dict[int, str] = {}
            for i in range(len(batch[rows.image])):
                row = first_row + i
                where = batch[WHERE][i] if piece.listed else f"{piece.origin} row {row}"
                problem = _add_row(batch, i, rows, reader, pending)
                if problem:
                    problems[row] = f"{where}: {problem}"
                if len(pending[IMAGE]) >= WRITE_ROWS:
                    _flush(pending, writer, rows)
            out.rows += len(batch[rows.image])
            out.note_bad(len(problems), problems, rows.max_examples)
    except KeyError as e:
        out.problem = f"{piece.origin}: missing column {e.args[0]!r}"
    except (OSError, pa.ArrowException, ValueError) as e:
        out.problem = f"{piece.origin}: cannot read ({type(e).__name__}: {tables.first_line(e)})"
    _flush(pending, writer, rows)
    out.shards = writer.close()
    return out


def _column_batches(piece: PicturePiece, rows: Rows) -> Iterator[tuple[dict[str, list[Any]], int]]:
    """The piece's rows (Parquet: a table or a listing) as lists by column, READ_ROWS at a
    time, with their first row."""
    wanted = [rows.image, rows.caption, *rows.extra]
    wanted += [WHERE] if piece.listed else []
    wanted += [SPLIT] if rows.own_split else []
    for table, row in tables.batches(piece.piece, rows=READ_ROWS):
        yield {c: table[c].to_pylist() for c in wanted}, row


def _add_row(
    batch: dict[str, list[Any]], i: int, rows: Rows, reader: _Recent, pending: dict[str, list[Any]]
) -> str | None:
    """Row i's picture read and caption checked, into `pending`; or why it is bad."""
    image, caption = batch[rows.image][i], batch[rows.caption][i]
    key, data, problem = reader.read(image)
    if problem is None and (not isinstance(caption, str) or not caption.strip()):
        problem = f"caption: expected non-empty text, got {caption!r}"[:120]
    if problem is not None:
        return problem
    pending[IMAGE].append(data)
    pending[CAPTION].append(caption.strip())
    pending[IMAGE_ID].append(key)
    for column in rows.extra:
        value = batch[column][i]
        pending[column].append(value if isinstance(value, bytes) else str(value))
    pending[SPLIT].append(batch[SPLIT][i] if rows.own_split else None)
    return None


def _flush(pending: dict[str, list[Any]], writer: ShardWriter, rows: Rows) -> None:
    if not pending[IMAGE]:
        return
    table = pa.table({f.name: pa.array(pending[f.name], f.type) for f in rows.schema})
    keys = row_keys(table, [IMAGE_ID])
    codes = None
    if rows.own_split:
        codes = np.asarray([SPLITS.index(s) for s in pending[SPLIT]], np.int8)
    writer.add(table, keys, codes)
    for values in pending.values():
        values.clear()


class _Recent:
    """A `PictureReader` remembering the last few pictures it read (and why one was bad)."""

    def __init__(self, reader: PictureReader):
        self.reader = reader
        self.seen: OrderedDict[str, tuple[bytes | None, str | None]] = OrderedDict()

    def read(self, image: Any) -> tuple[str, bytes | None, str | None]:
        if isinstance(image, bytes | bytearray | memoryview):
            key = hashlib.sha256(bytes(image)).hexdigest()
        else:
            key = image if isinstance(image, str) else repr(image)[:60]
        if key not in self.seen:
            self.seen[key] = self.reader.read(image)
            if len(self.seen) > RECENT_PICTURES:
                self.seen.popitem(last=False)
        self.seen.move_to_end(key)
        data, problem = self.seen[key]
        return key, data, problem
