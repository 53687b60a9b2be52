"""The table source (`data.source: table`): CSV, JSON Lines or Parquet, one file or a folder of
them, on local disk or an object store, prepared in pieces that tasks read, check and write on
their own (app/data/pieces.py).

`plan` lists the files and reads the first one's column names (nothing more) to settle what a
row holds. One pass (`prepare_piece`, a task a piece) checks each row, splits it by its key
(`data.key_column`, else the row's own values, so duplicates share a split) and streams it into
its shard, counting rows, labels and bad rows as it goes. Every piece streams its rows in record
batches, so a task holds one batch, never a file or a shard. A bad row is named by file and
row; with `data.skip_bad_rows` it is counted and left out.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from app import storage
from app.config import Config, DataConfig
from app.data.pieces import PieceResult, ShardWriter, SourcePlan, Target, Tasks, row_keys
from app.errors import UserError

TABLE_EXTENSIONS = (".csv", ".jsonl", ".json", ".parquet")
ROWS_PER_PIECE = 1_000_000  # Parquet row groups are read by tasks of about this many rows
BATCH_ROWS = 65_536  # rows a task checks and splits at a time
MAX_LABELS = 100_000  # more distinct labels than this is not a classification table


@dataclass(frozen=True)
class TableSpec:
    """What every row must hold, settled once from the config and the first file's columns."""

    features: tuple[str, ...]
    label: str
    text: bool  # the one feature is text (`data.text_column`), else every feature is a number
    declared: bool  # features named in the config: any other column in a file is refused
    labels: tuple[str, ...] | None  # data.labels: a label outside them is a bad row
    key: str | None  # data.key_column: the split key, else the row's own values
    skip_bad_rows: bool
    max_examples: int = 5

    @property
    def columns(self) -> list[str]:
        """The columns a file must have (the key column too, when it is not a feature)."""
        own = [*self.features, self.label]
        return own + ([self.key] if self.key and self.key not in own else [])

    def schema(self) -> pa.Schema:
        kind = pa.string() if self.text else pa.float64()
        return pa.schema([*((f, kind) for f in self.features), (self.label, pa.string())])


@dataclass(frozen=True)
class Piece:
    index: int  # its place in the source's order
    path: str  # a local path or URI
    row_groups: tuple[int, ...] | None = None  # Parquet: these groups; None: the whole file
    first_row: int = 0  # the piece's first row within its file


# --- planning -----------------------------------------------------------------------------------


def planned(config: Config, tasks: Tasks, folder: str) -> SourcePlan:
    """The table as prepare runs it: a task a piece (`prepare_piece`); planning reads the
    first file's header alone, here."""
    cfg = config.data
    spec, pieces = plan(cfg)
    return SourcePlan(
        kind="text" if spec.text else "tabular",
        features=spec.features,
        label=spec.label,
        schema=spec.schema(),
        pieces=pieces,
        run=functools.partial(run_piece, spec=spec),
        description={"source": "table", "path": cfg.path, "files": file_names(pieces)},
        skip_bad_rows=spec.skip_bad_rows,
        max_examples=spec.max_examples,
    )


def plan(cfg: DataConfig) -> tuple[TableSpec, list[Piece]]:
    """The spec and the pieces, in source order (sorted file paths; row groups in order)."""
    files = table_files(cfg.path)
    names = column_names(files[0])
    for column in (cfg.label_column, *([cfg.text_column] if cfg.text_column else [])):
        if column not in names:
            raise UserError(f"{files[0]}: missing column {column!r} (has {names})")
    declared = [cfg.text_column] if cfg.text_column else cfg.feature_columns
    features = declared or [c for c in names if c not in (cfg.label_column, cfg.key_column)]
    spec = TableSpec(
        tuple(features),
        cfg.label_column,
        bool(cfg.text_column),
        bool(cfg.feature_columns) and not cfg.text_column,
        tuple(cfg.labels) if cfg.labels is not None else None,
        cfg.key_column,
        cfg.skip_bad_rows,
    )
    return spec, [p for i, f in enumerate(files) for p in file_pieces(f, i)]


def table_files(path: str | None) -> list[str]:
    files = [p for p in listed_files(path, "table") if p.lower().endswith(TABLE_EXTENSIONS)]
    if not files:
        raise UserError(f"{path}: no CSV, JSONL or Parquet files")
    return files


def listed_files(path: str | None, source: str) -> list[str]:
    """The file `path` names, or every file under the folder it names (local or an object
    store), sorted."""
    if not path:
        raise UserError(f"data.path is required for source {source!r}")
    if storage.is_local(path):
        if not os.path.exists(path):
            raise UserError(f"data.path {path!r} does not exist")
        if os.path.isfile(path):
            return [path]
        found = glob.glob(os.path.join(path, "**", "*"), recursive=True)
        return sorted(p for p in found if os.path.isfile(p))
    if storage.is_file(path):
        return [path]
    return sorted(storage.join(path, name) for name, _, _ in storage.list_files(path))


def file_pieces(path: str, number: int, rows_per_piece: int = ROWS_PER_PIECE) -> list[Piece]:
    """A CSV or JSONL file is one piece; a Parquet file's row groups are cut into runs of about
    `rows_per_piece` rows (`number` orders the file among the source's files)."""
    base = number * 1_000_000  # a file's pieces sort after the previous file's
    if not path.lower().endswith(".parquet"):
        return [Piece(base, path)]
    try:
        meta = parquet_file(path).metadata
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{path}: cannot read ({type(e).__name__}: {first_line(e)})") from None
    pieces: list[Piece] = []
    groups: list[int] = []
    rows, first = 0, 0
    for g in range(meta.num_row_groups):
        groups.append(g)
        rows += meta.row_group(g).num_rows
        if rows >= rows_per_piece or g == meta.num_row_groups - 1:
            pieces.append(Piece(base + len(pieces), path, tuple(groups), first))
            first += rows
            groups, rows = [], 0
    return pieces or [Piece(base, path, ())]


def column_names(path: str) -> list[str]:
    """A file's column names from its header alone (Parquet's schema, CSV's first line, the
    first JSON line's keys)."""
    try:
        if path.lower().endswith(".parquet"):
            return list(parquet_file(path).schema_arrow.names)
        if path.lower().endswith(".csv"):
            names = _csv_header(path)
        else:
            frame = next(json_frames(path), None)
            names = list(frame.columns) if frame is not None and len(frame) else None
    except (OSError, pa.ArrowException, ValueError) as e:
        raise UserError(f"{path}: cannot read ({type(e).__name__}: {first_line(e)})") from None
    if names is None:
        raise UserError(f"{path}: no rows")
    return [str(n) for n in names]


def file_names(pieces: list[Piece]) -> list[str]:
    """The source's files, in order, by name (the manifest's description)."""
    return list(dict.fromkeys(os.path.basename(p.path) for p in pieces))


# --- reading ------------------------------------------------------------------------------------


def batches(
    piece: Piece, spec: TableSpec | None = None, rows: int = BATCH_ROWS
) -> Iterator[tuple[pa.Table, int]]:
    """The piece's rows, `rows` at a time (CSV: a block at a time), with each batch's first row
    within the file (JSON Lines, whose values have no column type, read as `spec` wants them)."""
    path, row = piece.path, piece.first_row
    lower = path.lower()
    if lower.endswith(".parquet"):
        groups = list(piece.row_groups) if piece.row_groups is not None else None
        for batch in parquet_file(path).iter_batches(rows, row_groups=groups):
            yield pa.Table.from_batches([batch]), row
            row += batch.num_rows
    elif lower.endswith(".csv"):
        import pyarrow.csv as pcsv

        fs, local = storage.filesystem(path)
        with fs.open_input_stream(local) as f:
            options = pcsv.ReadOptions(block_size=16 << 20)
            for batch in pcsv.open_csv(f, read_options=options):
                yield pa.Table.from_batches([batch]), row
                row += batch.num_rows
    else:
        assert spec is not None, "JSON Lines are read as a spec wants them"
        for frame in json_frames(path, rows):
            yield _typed(frame, spec), row
            row += len(frame)


def _csv_header(path: str) -> list[str] | None:
    """A CSV file's column names from its first block (None: no rows), read without the
    threads that would read ahead into the rest of the file."""
    import pyarrow.csv as pcsv

    fs, local = storage.filesystem(path)
    options = pcsv.ReadOptions(use_threads=False, block_size=1 << 20)
    with fs.open_input_stream(local) as f:
        reader = pcsv.open_csv(f, read_options=options)
        try:
            first = reader.read_next_batch()
        except StopIteration:  # a header alone
            return None
        return reader.schema.names if first.num_rows else None


def json_frames(path: str, rows: int = BATCH_ROWS) -> Iterator[pd.DataFrame]:
    """JSON Lines through pandas, which keeps each value as written (pyarrow's reader fixes a
    column's type from the first block and fails a later row that differs)."""
    fs, local = storage.filesystem(path)
    with fs.open_input_stream(local) as f:
        yield from pd.read_json(
            f,
            lines=True,
            chunksize=rows,
            precise_float=True,
            dtype=False,
            convert_dates=False,
        )


def _typed(frame: pd.DataFrame, spec: TableSpec) -> pa.Table:
    """A JSON frame's columns as `checked` reads them: numbers as float64 (NaN where a value is
    no number), text as text (null where a value is not a string), labels as text."""
    columns = {}
    for name in frame.columns:
        values = frame[name]
        if name in spec.features and not spec.text:
            columns[name] = pa.array(pd.to_numeric(values, errors="coerce"), pa.float64())
        elif name in spec.features:
            columns[name] = pa.array(
                [v if isinstance(v, str) else None for v in values], pa.string()
            )
        else:
            columns[name] = pa.array([_label_text(v) for v in values], pa.string())
    return pa.table(columns)


def _label_text(value: object) -> str | None:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def parquet_file(path: str) -> pq.ParquetFile:
    fs, local = storage.filesystem(path)
    return pq.ParquetFile(fs.open_input_file(local))


# --- checking -----------------------------------------------------------------------------------


@dataclass
class Checked:
    """A batch as its shards store it (features as float64 or text, the label as text), each
    row's split key, which rows are bad, and why (by row within the file; the lowest bad rows of
    each column, the batch's first bad row always among them)."""

    table: pa.Table
    keys: np.ndarray
    bad: np.ndarray
    problems: dict[int, str]

    def good(self) -> tuple[pa.Table, np.ndarray]:
        if not self.bad.any():
            return self.table, self.keys
        return self.table.filter(pa.array(~self.bad)), self.keys[~self.bad]


def checked(table: pa.Table, spec: TableSpec, path: str, first_row: int) -> Checked:
    missing = [c for c in spec.columns if c not in table.column_names]
    if missing:
        raise FileProblem(f"{path}: missing column {missing[0]!r} (has {table.column_names})")
    if spec.declared:
        extra = [c for c in table.column_names if c not in spec.columns]
        if extra:
            raise FileProblem(
                f"{path}: unexpected column {extra[0]!r} (declare it in data.feature_columns "
                "or remove it from the file)"
            )
    bad = np.zeros(table.num_rows, bool)
    why: dict[int, str] = {}
    columns = {}
    for name in spec.features:
        columns[name], wrong = (_texts if spec.text else _numbers)(table[name])
        _note(
            wrong,
            bad,
            why,
            f"column {name!r}",
            "expected text" if spec.text else "expected a finite number",
            table[name],
        )
    columns[spec.label], wrong = _labels(table[spec.label], spec.labels)
    _note(
        wrong,
        bad,
        why,
        f"column {spec.label!r}",
        "missing label" if spec.labels is None else f"label not in data.labels {list(spec.labels)}",
        table[spec.label],
    )
    out = pa.table(columns).cast(spec.schema())
    keys = row_keys(table, [spec.key]) if spec.key else row_keys(out, out.column_names)
    problems = {first_row + r: f"{path} row {first_row + r}: {why[r]}" for r in sorted(why)}
    return Checked(out, keys, bad, problems)


class FileProblem(Exception):
    """A file that does not hold what the spec says (a column missing or extra)."""


def _numbers(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    else:  # text that may hold numbers (CSV cells, JSON strings)
        values = pd.to_numeric(column.to_pandas(), errors="coerce").to_numpy(np.float64)
    values = np.asarray(values, np.float64)
    wrong = ~np.isfinite(values)
    return pa.array(np.where(wrong, 0.0, values)), wrong


def _texts(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        wrong = column.is_null().to_numpy(zero_copy_only=False)
        return pc.fill_null(column, "").combine_chunks(), wrong
    return pa.array([""] * len(column)), np.ones(len(column), bool)


def _labels(
    column: pa.ChunkedArray, declared: tuple[str, ...] | None
) -> tuple[pa.Array, np.ndarray]:
    if pa.types.is_floating(column.type):  # 1.0 written for 1 by a reader: the label is "1"
        floats = column.to_numpy(zero_copy_only=False)
        whole = np.isfinite(floats) & (floats == np.round(floats))
        texts = [str(int(v)) if w else str(v) for v, w in zip(floats, whole, strict=True)]
        values = pa.array(texts, pa.string())
        missing = np.isnan(floats)
    else:
        missing = column.is_null().to_numpy(zero_copy_only=False)
        values = pc.cast(pc.fill_null(column.cast(pa.string()), ""), pa.string()).combine_chunks()
        missing |= pc.equal(values, "").to_numpy(zero_copy_only=False)
    wrong = missing.copy()
    if declared is not None:
        wrong |= ~pc.is_in(values, pa.array(declared, pa.string())).to_numpy(zero_copy_only=False)
    return values, wrong


def _note(
    wrong: np.ndarray,
    bad: np.ndarray,
    why: dict[int, str],
    where: str,
    what: str,
    raw: pa.ChunkedArray,
) -> None:
    for r in np.flatnonzero(wrong & ~bad)[:1000].tolist():
        why[r] = f"{where}: {what}, got {_short(raw[r].as_py())}"
    bad |= wrong


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- one piece, in one task ---------------------------------------------------------------------


def run_piece(piece: Piece, target: Target, spec: TableSpec) -> PieceResult:
    return prepare_piece(piece, spec, target)


def prepare_piece(piece: Piece, spec: TableSpec, target: Target) -> PieceResult:
    """The piece read once: its rows checked, its good rows written to their shards, and a
    record of it all (rows, bad rows, the first one, labels, the shards). A file that cannot be
    read as the spec says is a `problem`; the driver refuses the source on the first problem or
    bad row in source order (unless bad rows are skipped) and removes what was written."""
    out = PieceResult(piece.index)
    labels: set[str] = set()
    writer = ShardWriter(target, piece.index, spec.schema())
    try:
        for table, first_row in batches(piece, spec):
            batch = checked(table, spec, piece.path, first_row)
            out.rows += table.num_rows
            out.note_bad(int(batch.bad.sum()), batch.problems, spec.max_examples)
            good, keys = batch.good()
            labels.update(pc.unique(good[spec.label]).to_pylist())
            if len(labels) > MAX_LABELS:
                out.problem = (
                    f"{piece.path}: column {spec.label!r} holds more than {MAX_LABELS} "
                    "distinct labels"
                )
                break
            writer.add(good, keys)
    except FileProblem as e:
        out.problem = str(e)
    except (OSError, pa.ArrowException, ValueError) as e:
        out.problem = f"{piece.path}: cannot read ({type(e).__name__}: {first_line(e)})"
    out.shards = writer.close()
    out.labels = sorted(labels)
    return out


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
