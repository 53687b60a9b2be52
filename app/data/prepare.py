"""Prepare: a raw source -> train/val(/test) Parquet shards + manifest.json, published whole.

The manifest (schema, rows, and the sha256 of every shard) is written last and is the only way in:
readers take a dataset through it and `verify_shards` checks a split against it.

Each run writes its shards under a fresh generation prefix,
`<output>/gen-<utc time>-<random>/<split>/part-*.parquet`, then replaces `manifest.json` (one
atomic write, fsynced on local disk) to name them, and only then deletes old generations, on
local disk and object stores alike. Until the new manifest is in, readers see the previous
dataset whole; the newest `data.keep_generations` generations stay (2 by default: the new one
and the one it replaced), so a train or predict job still reading through the old manifest can
finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol, get_args

from pydantic import Field, field_validator, model_validator

from app import storage
from app.config import Config, DataConfig
from app.data.kinds import known, prepared_as, processor
from app.data.pieces import (
    PieceResult,
    ShardRecord,
    SourcePlan,
    SplitRule,
    Target,
    Tasks,
    ordered,
    split_rows_of,
)
from app.data.preprocess import PretrainedLookup
from app.data.reasons import Reasons
from app.data.sources import Kind
from app.errors import UserError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
GENERATION_MARK = "gen-"
REQUIRED_SPLITS = ("train", "val")
LAYOUT = 2  # 2: a row's pixels one binary value (uint8 where bytes); shards named by piece


# --- the dataset manifest: written here, read by every stage that reads the shards -------------


class Shard(storage.Contract):
    file: str  # relative to the dataset root
    rows: int = Field(ge=0)
    sha256: str


class DataFile(storage.Contract):
    file: str  # relative to the dataset root
    sha256: str


class Split(storage.Contract):
    rows: int = Field(ge=0)
    shards: list[Shard]


class DatasetManifest(storage.Contract):
    """`<data.output>/manifest.json`: what a prepared dataset holds, and the only way into it."""

    # How the shards are laid out; a dataset of an older layout is prepared again (absent: 1,
    # pixels as lists of float32).
    layout: int = 1
    created: str
    source: dict[str, Any]  # the source's own description (name, path, seed, ...)
    kind: str  # a built-in kind, or a kind from outside app/ by its path (`data.kind`)
    feature_columns: list[str]
    label_column: str
    label_names: list[str]
    image_shape: list[int] | None = None  # (channels, height, width) of flat pixels
    # Column -> Arrow type. `schema` on the model itself would shadow pydantic's own attribute.
    columns: dict[str, str] = Field(alias="schema")
    rows: dict[str, int]  # split -> rows, the same splits as `splits`
    splits: dict[str, Split]
    # Files of the dataset besides its shards, by name (a token dataset's `tokenizer.json`).
    files: dict[str, DataFile] = {}
    block_size: int | None = None  # tokens: the model input length (rows hold one more)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if not known(kind):
            names = ", ".join(get_args(Kind))
            raise ValueError(f"unknown kind {kind!r} (known: {names}, or 'pkg.module:Class')")
        return kind

    @model_validator(mode="after")
    def _splits(self) -> DatasetManifest:
        missing = [s for s in REQUIRED_SPLITS if s not in self.splits]
        if missing:
            raise ValueError(f"splits: no {missing[0]!r} split")
        if set(self.rows) != set(self.splits):
            raise ValueError(f"rows: lists {sorted(self.rows)}, splits has {sorted(self.splits)}")
        return self


def prepare_dataset(
    config: Config, bases: PretrainedLookup, tasks: Tasks | None = None
) -> dict[str, Any]:
    """The source -> a published dataset: read, checked, split and written by `tasks`
    (default: Ray Data tasks on the cluster this job joins), a task a piece of the source.
    `bases`: the run's pretrained folders (app/models/families.py `Bases(config.model)`)."""
    bases.base()  # a bad pretrained folder fails before any data is read
    return prepare_pieces(
        config,
        planner_for(config.data, bases),
        bases,
        tasks or ray_tasks(config.data.stall_timeout_s),
    )


class Planner(Protocol):
    """A source's pieces, planned once a generation `folder` exists (a source may first write
    a listing of itself there, in a task)."""

    def __call__(self, config: Config, tasks: Tasks, folder: str, /) -> SourcePlan: ...


def planner_for(cfg: DataConfig, bases: PretrainedLookup) -> Planner:
    """How a source is cut into pieces, by `data.source` (one piece: a source one task makes).
    A corpus is encoded with the pretrained model's tokenizer when there is one."""
    from app.data import (
        chat_source,
        image_folder,
        image_text_source,
        sources,
        table_source,
        text_files,
    )

    planners: dict[str, Planner] = {
        "table": table_source.planned,
        "text_files": functools.partial(text_files.planned, bases=bases),
        "chat": functools.partial(chat_source.planned, bases=bases),
        "imagefolder": image_folder.planned,
        "image_text": image_text_source.planned,
        **{name: sources.planned for name in sources.MAKERS},
    }
    if cfg.source not in planners:
        raise UserError(f"data.source {cfg.source!r}: no planner (known: {sorted(planners)})")
    return planners[cfg.source]


def ray_tasks(stall_s: float) -> Tasks:
    from app.data.ray_tasks import RayTasks
    from app.ray_runtime import connect_ray

    connect_ray()
    return RayTasks(stall_s=stall_s)


def prepare_pieces(
    config: Config, planner: Planner, bases: PretrainedLookup, tasks: Tasks
) -> dict[str, Any]:
    """A source in one pass over its pieces, a task each, that checks, splits and writes. The
    driver holds the tasks' small records, never a row; a bad source is refused once the tasks
    are done, naming its first bad row in source order, and what they wrote is removed with the
    unpublished generation."""
    cfg, output = config.data, config.data_output
    started = time.perf_counter()
    rule = SplitRule(cfg.seed, cfg.val_fraction, cfg.test_fraction)
    results: list[PieceResult] = []
    plans: list[SourcePlan] = []

    def write(folder: str, prefix: str) -> DatasetManifest:
        plan = planner(config, tasks, folder)
        plan = dataclasses.replace(plan, kind=prepared_as(plan.kind, cfg.kind))
        plans.append(plan)
        bases.base(processor(plan.kind))  # the pretrained model must take this data
        log.info("prepare: %d piece(s) of %s -> %s", len(plan.pieces), cfg.source, output)
        target = Target(folder, prefix, cfg.rows_per_shard, rule)
        run = functools.partial(measured, run=plan.run, target=target)
        results.extend(tasks.map(run, plan.pieces, "prepare"))
        for scratch in plan.scratch:
            storage.delete_file(scratch)
        labels = checked_results(results, plan, cfg.source)
        files = write_files(plan.files, folder, prefix)
        return manifest_of([r for result in results for r in result.shards], plan, labels, files)

    manifest = publish_written(output, write, cfg.keep_generations)
    rows = {name: entry.rows for name, entry in manifest.splits.items()}
    skipped = sum(r.bad for r in results)
    seconds = time.perf_counter() - started
    summary = {"stage": "prepare", "output": output, "rows": rows}
    summary["throughput"] = {
        "seconds": round(seconds, 2),
        "rows_per_s": round((sum(rows.values()) + skipped) / max(seconds, 1e-9)),
        "bytes": sum(s.bytes for r in results for s in r.shards),
        "driver_peak_rss_mib": round(peak_rss_mib(), 1),
        # The largest peak of a process that ran pieces (a Ray worker's high-water mark).
        "task_peak_rss_mib": round(max((r.peak_rss_mib for r in results), default=0.0), 1),
    }
    reasons = bad_reasons(results)
    log.info("prepare: wrote %s%s", rows, f", skipped {reasons.line()}" if skipped else "")
    examples = [e for r in results for e in r.examples][: plans[0].max_examples]
    if not skipped:
        return summary
    return summary | {
        "skipped": skipped,
        "skipped_reasons": reasons.as_list(),
        "skipped_examples": examples,
    }


def measured(piece: Any, run: Callable[..., PieceResult], target: Target) -> PieceResult:
    """`run` on one piece, its result carrying the running process's peak memory."""
    result = run(piece, target=target)
    result.peak_rss_mib = peak_rss_mib()
    return result


def checked_results(results: list[PieceResult], plan: SourcePlan, source: str) -> list[str]:
    """The label set of the pieces' records; the first problem in source order refuses the
    source in one line (a bad row too, unless skipped), as do splits left empty."""
    bad = bad_reasons(results)
    for result in results:
        if result.problem:
            raise UserError(result.problem)
        if result.first_bad and not plan.skip_bad_rows:
            counted = f"; {bad.total():,} bad rows in all: {bad.line()}" if bad.total() > 1 else ""
            raise UserError(
                f"{result.first_bad} (data.skip_bad_rows=true skips such rows){counted}"
            )
    rows = sum(r.rows - r.bad for r in results)
    if not rows and bad.total():
        raise UserError(
            f"data source {source!r}: {bad.total():,} of {sum(r.rows for r in results):,} rows "
            f"skipped, none left: {bad.line()}"
        )
    if not rows:
        raise UserError(f"data source {source!r} produced no rows")
    splits = split_rows_of([s for r in results for s in r.shards])
    missing = [s for s in REQUIRED_SPLITS if not splits.get(s)]
    if missing and plan.own_split:
        raise UserError(f"the source's own split has no {missing[0]!r} rows")
    if missing:
        raise UserError(plan.too_few.format(rows=rows, split=missing[0]))
    return sorted({label for r in results for label in r.labels})


def bad_reasons(results: list[PieceResult]) -> Reasons:
    """Every piece's bad rows by reason, in source order (each reason's first example is the
    first in the source)."""
    out = Reasons()
    for result in results:
        out.merge(result.reasons)
    return out


def write_files(files: dict[str, bytes], folder: str, prefix: str) -> dict[str, DataFile]:
    """`files` beside the shards in `folder`, listed by name with their sha256 (`prefix` is
    `folder` relative to the dataset root)."""
    listed = {}
    for name, content in files.items():
        storage.write_bytes(storage.join(folder, name), content)
        rel = f"{prefix}/{name}" if prefix else name
        listed[name] = DataFile(file=rel, sha256=hashlib.sha256(content).hexdigest())
    return listed


def manifest_of(
    records: list[ShardRecord],
    plan: SourcePlan,
    labels: list[str],
    files: dict[str, DataFile] | None = None,
) -> DatasetManifest:
    by_split = ordered(records)
    splits = {
        name: Split(
            rows=sum(r.rows for r in shards),
            shards=[Shard(file=r.file, rows=r.rows, sha256=r.sha256) for r in shards],
        )
        for name, shards in by_split.items()
    }
    return DatasetManifest(
        layout=LAYOUT,
        created=datetime.now(UTC).isoformat(),
        source=plan.description,
        kind=plan.kind,
        feature_columns=list(plan.features),
        label_column=plan.label,
        label_names=labels,
        image_shape=list(plan.image_shape) if plan.image_shape else None,
        columns={f.name: str(f.type) for f in plan.schema},
        rows={name: s.rows for name, s in splits.items()},
        splits=splits,
        files=files or {},
        block_size=plan.block_size,
    )


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def publish_written(
    output: str, write: Callable[[str, str], DatasetManifest], keep: int
) -> DatasetManifest:
    """`write(folder, prefix)` fills a new generation and returns its manifest, which is then
    written (the commit point); a failure removes the partial generation, and the previous
    dataset stays whole."""
    stamp = f"{datetime.now(UTC):%Y%m%dT%H%M%S%f}"
    generation = f"{GENERATION_MARK}{stamp}-{uuid.uuid4().hex[:8]}"
    existed = storage.exists(output)
    try:
        manifest = write(storage.join(output, generation), generation)
        manifest.write(storage.join(output, MANIFEST))  # the commit point
    except BaseException:
        # Best effort: a leftover is collected by a later run anyway.
        with contextlib.suppress(Exception):
            if current_generation(output) != generation:
                storage.delete_dir(storage.join(output, generation))
            if not existed and not storage.list_dir(output):  # this run made it: leave none
                storage.delete_dir(output)
        raise
    collect_generations(output, generation, keep)
    return manifest


def current_generation(output: str) -> str:
    """The generation the dataset's manifest names ("" when none, or not a generation layout)."""
    uri = storage.join(output, MANIFEST)
    if not storage.is_file(uri):
        return ""
    try:
        manifest = DatasetManifest.read(uri)
    except UserError:  # a damaged manifest names no generation to keep
        return ""
    for entry in manifest.splits.values():
        for shard in entry.shards:
            first = shard.file.split("/", 1)[0]
            return first if first.startswith(GENERATION_MARK) else ""
    return ""


def collect_generations(output: str, current: str, keep: int) -> None:
    """Keep `current` and the `keep - 1` generations just before it (a job may still read them
    through an older manifest); delete the older ones, those of superseded or failed runs.

    A generation newer than `current` is left alone: it can be another prepare still writing.
    """
    older = sorted(
        (n for n in storage.list_dir(output) if n.startswith(GENERATION_MARK) and n < current),
        reverse=True,
    )
    for name in older[keep - 1 :]:
        log.info("prepare: deleting the shards of %s (data.keep_generations=%d)", name, keep)
        storage.delete_dir(storage.join(output, name))


def read_manifest(output: str) -> DatasetManifest:
    """The dataset at `output`; a missing or malformed manifest is one line naming it."""
    uri = storage.join(output, MANIFEST)
    if not storage.exists(uri):
        raise UserError(
            f"{output}: no prepared dataset (manifest.json missing); run jobs.prepare first"
        )
    manifest = DatasetManifest.read(uri)
    if manifest.layout != LAYOUT:
        raise UserError(
            f"{uri}: prepared in layout {manifest.layout}, this version reads layout {LAYOUT}; "
            "run jobs.prepare again"
        )
    return manifest


def split_files(output: str, manifest: DatasetManifest, split: str) -> list[str]:
    if split not in manifest.splits:
        raise UserError(f"{output}: the prepared dataset has no {split!r} split")
    return [storage.join(output, s.file) for s in manifest.splits[split].shards]


def read_dataset_file(output: str, manifest: DatasetManifest, name: str) -> bytes:
    """One of the dataset's `files`, checked against the sha256 the manifest lists."""
    entry = manifest.files.get(name)
    if entry is None:
        raise UserError(f"{output}: the prepared dataset has no {name}; run jobs.prepare again")
    uri = storage.join(output, entry.file)
    if not storage.is_file(uri):
        raise UserError(f"{uri}: missing (listed in {MANIFEST}); run jobs.prepare again")
    content = storage.read_bytes(uri)
    if hashlib.sha256(content).hexdigest() != entry.sha256:
        raise UserError(
            f"{uri}: sha256 differs from {MANIFEST} (altered or truncated); run jobs.prepare again"
        )
    return content


def verify_shards(output: str, manifest: DatasetManifest, split: str) -> list[str]:
    """`split_files`, each shard hashed (streamed) against the sha256 the manifest lists.

    Refuses a missing, altered or truncated shard with a one-line UserError naming it. Costs one
    read of the split: call it where shards are read once anyway (on the driver) or once per run.
    """
    files = split_files(output, manifest, split)
    for uri, shard in zip(files, manifest.splits[split].shards, strict=True):
        try:
            digest = storage.sha256(uri)
        except FileNotFoundError:
            raise UserError(
                f"{uri}: shard missing (listed in {MANIFEST}); run jobs.prepare again"
            ) from None
        if digest != shard.sha256:
            raise UserError(
                f"{uri}: sha256 differs from {MANIFEST} (altered or truncated); "
                "run jobs.prepare again"
            )
    return files
