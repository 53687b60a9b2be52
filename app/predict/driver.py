"""The predict stage on the driver: the input cut into pieces, each read, scored and written by
an actor, the manifest published; a tally of good and bad rows and the summary."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from app import storage
from app.config import Config, PredictConfig
from app.data.prepare import Shard
from app.data.reasons import Reasons
from app.errors import UserError
from app.predict.actor import PREDICTOR, PredictInput, Scorer
from app.predict.read import check_columns, header, input_files, pieces_of
from app.predict.row_checks import Format, InputSpec
from app.predict.worker import PieceWorker
from app.predict.write import (
    REJECTS,
    RUN_MARK,
    Destination,
    PredictionManifest,
    Written,
    check_output,
    commit,
    written_records,
)
from app.registry import task_of_schema
from app.runtime.artifact import open_artifact

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """Rows so far, and the first bad ones (id + reason) for the summary or the failure."""

    max_examples: int
    output: int = 0
    rejected: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)
    reasons: Reasons = field(default_factory=Reasons)

    def add(self, written: Written) -> None:
        self.output += written.output
        self.rejected += written.rejected
        room = max(self.max_examples - len(self.examples), 0)
        self.examples += written.examples[:room]
        if written.reasons:
            self.reasons.merge(Reasons(**written.reasons))

    def line(self) -> str:
        """Rejected rows by reason, each with its first (`12 column 'x': null (first: id
        7: column 'x': null)`)."""
        return self.reasons.line()


def predict(
    config: Config,
    artifact_uri: str,
    input_uri: str,
    output: str,
    id_column: str = "id",
    overwrite: bool = False,
) -> dict[str, Any]:
    from app.ray_runtime import connect_ray

    started = time.perf_counter()
    cfg = config.predict
    fmt, files = input_files(input_uri)
    artifact = open_artifact(artifact_uri)  # verified once here; resolves `latest` for every actor
    scorer = scorer_of(artifact.schema)
    spec = input_spec_of(scorer, artifact, config, input_uri, id_column, (fmt, files))
    expected_rows = check_columns(files, spec)
    output = output.rstrip("/")
    check_output(output, overwrite)
    existed = storage.exists(output)
    variant = artifact.choose_variant(cfg.variant or config.serve.variant)
    log.info(
        "predict: %s %s (%s) on %d %s file(s) from %s -> %s",
        artifact.name,
        artifact.version,
        variant,
        len(files),
        fmt,
        input_uri,
        output,
    )
    connect_ray()
    check_room(cfg, len(files))
    run = f"{RUN_MARK}{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    to = Destination(output, run, spec.id_column, cfg.rows_per_file, cfg.max_examples)
    try:
        tally, (parts, rejects) = _run(config, files, spec, scorer, (artifact.uri, variant), to)
        rows = {
            "input": tally.output + tally.rejected,
            "output": tally.output,
            "rejected": tally.rejected,
        }
        check_row_count(rows, expected_rows)
        manifest = PredictionManifest(
            created=datetime.now(UTC).isoformat(),
            artifact=storage.resolved(artifact.uri),
            model_name=artifact.name,
            model_version=artifact.version,
            variant=variant,
            input=input_uri,
            input_format=fmt,
            id_column=id_column,
            on_bad_rows=cfg.on_bad_rows,
            rows=rows,
            files=parts,
            rejects=rejects,
            bad_row_examples=tally.examples,
            bad_row_reasons=tally.reasons.as_list(),
        )
        commit(output, manifest, overwrite)  # last: the output counts only with it
    except BaseException:
        discard_run(output, run, existed)
        raise
    elapsed = time.perf_counter() - started
    log.info("predict: %s in %.1f s", rows, elapsed)
    rejects_at = storage.join(output, run, REJECTS) if tally.rejected else None
    return _summary(output, rejects_at, artifact, variant, tally, elapsed)


def _summary(
    output: str, rejects: str | None, artifact: Any, variant: str, tally: Tally, elapsed: float
) -> dict[str, Any]:
    """The job's result: what was read, written and refused, and how fast."""
    rows = tally.output + tally.rejected
    return {
        "stage": "predict",
        "output": output,
        "rejects": rejects,
        "artifact": artifact.uri,
        "model": artifact.name,
        "version": artifact.version,
        "variant": variant,
        # DESIGN's keys: rows read, rows rejected (the rest are predictions), rows a second.
        "rows": rows,
        "rejected": tally.rejected,
        "rows_per_second": round(rows / elapsed, 1) if elapsed else None,
        "bad_rows": {
            "count": tally.rejected,
            "reasons": tally.reasons.as_list(),
            "examples": tally.examples,
        },
        "elapsed_s": round(elapsed, 3),
    }


def input_spec_of(
    scorer: Scorer,
    artifact: Any,
    config: Config,
    input_uri: str,
    id_column: str,
    found: tuple[Format, list[str]],
) -> InputSpec:
    """What the task reads of this input; a folder of pictures only by a retrieval model."""
    fmt, files = found
    if fmt == "pictures" and artifact.schema["kind"] != "image_text":
        raise UserError(
            f"{input_uri}: a folder of pictures is embedded by a retrieval model; "
            f"{artifact.name} reads {artifact.schema['kind']} rows"
        )
    request = PredictInput(artifact.schema, id_column, fmt, header(files, fmt), config, input_uri)
    return scorer.input_spec(request)


def discard_run(output: str, run: str, existed: bool) -> None:
    """What a failed run's tasks wrote, and the output folder if they made it (best effort:
    readers skip `_run-` folders anyway)."""
    with contextlib.suppress(Exception):
        storage.delete_dir(storage.join(output, run))
        if not existed and not storage.list_dir(output):
            storage.delete_dir(output)


def scorer_of(schema: dict[str, Any]) -> Scorer:
    task = task_of_schema(schema)
    if not task.has(PREDICTOR):
        raise UserError(f"predict: task {task.name!r} has no batch inference (jobs.predict)")
    return task.part(PREDICTOR)


ROOM_WAIT_S = 5.0  # how long the CPUs the run needs may take to come free


def check_room(cfg: PredictConfig, files: int) -> None:
    """The CPUs of one inference actor (it reads, scores and writes) must come free within
    seconds: a cluster without them would otherwise wait forever. Asked of the scheduler
    itself with a placement group (the cluster's resource view lags), then let go. One line
    naming them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    probe = placement_group([{"CPU": cfg.actor_cpus}], strategy="PACK")
    try:
        fits = probe.wait(timeout_seconds=ROOM_WAIT_S)
    finally:
        remove_placement_group(probe)
    if not fits:
        free = ray.available_resources().get("CPU", 0.0)
        total = ray.cluster_resources().get("CPU", 0.0)
        raise UserError(
            f"predict: needs {cfg.actor_cpus:g} free CPUs for an inference actor "
            f"(predict.actor_cpus) to read, score and write {files} file(s); the cluster has "
            f"about {free:g} free of {total:g}: free some or lower predict.actor_cpus"
        )


def check_row_count(rows: dict[str, int], expected_rows: int | None) -> None:
    """Every row read comes out as a prediction or a reject; for Parquet the files' own
    metadata gives an independent count."""
    if expected_rows is not None and expected_rows != rows["input"]:
        raise UserError(
            f"predict: read {rows['input']} rows, the input holds {expected_rows}; "
            "nothing published"
        )


def _run(
    config: Config,
    files: list[str],
    spec: InputSpec,
    scorer: Scorer,
    model: tuple[str, str],
    to: Destination,
) -> tuple[Tally, tuple[list[Shard], list[Shard]]]:
    """The pieces handed to an autoscaling pool of actors that read, score and write them; the
    driver reads only their records (what they wrote, their counts, the first rejects)."""
    import ray
    import ray.data

    from app.data.ingest import quiet_progress

    cfg = config.predict
    quiet_progress()
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
    pieces = pieces_of(files, spec)
    records = ray.data.from_items(pieces, override_num_blocks=len(pieces)).map_batches(
        PieceWorker,
        fn_constructor_args=(
            scorer,
            (*model, cfg.threads, spec),
            storage.filesystem(files[0])[0],
            cfg.batch_size,
            to,
        ),
        batch_format="pyarrow",
        batch_size=1,
        # Every actor started at once (one is enough to begin), and at most two pieces queued
        # at an actor: a piece is seconds of work, and four queued behind a busy actor left
        # the others idle at the end of a run.
        compute=ray.data.ActorPoolStrategy(
            min_size=1,
            max_size=cfg.max_actors,
            initial_size=cfg.max_actors,
            max_tasks_in_flight_per_actor=2,
        ),
        num_cpus=cfg.actor_cpus,
        num_gpus=cfg.gpus_per_actor if use_gpu else None,
    )
    return _tally(records, cfg)


def _tally(records, cfg: PredictConfig) -> tuple[Tally, tuple[list[Shard], list[Shard]]]:
    tally, parts, rejects, schemas = Tally(cfg.max_examples), [], [], set()
    last_log = time.monotonic()
    for block in records.iter_batches(batch_format="pyarrow", batch_size=None):
        for record in written_records(block):
            tally.add(record)
            parts += [Shard(**p) for p in record.parts]
            rejects += [Shard(**p) for p in record.rejects]
            schemas |= set(record.schemas)
        if tally.rejected and cfg.on_bad_rows == "fail":
            raise UserError(
                f"input: malformed rows ({tally.rejected} in the first "
                f"{tally.output + tally.rejected} read): {tally.line()}; "
                "predict.on_bad_rows=reject writes them to <output>/rejects instead"
            )
        if len(schemas) > 1:
            raise UserError(
                "input: column types differ between files or rows: "
                + " | ".join(sorted(schemas))[:300]
            )
        if time.monotonic() - last_log > 10:
            log.info("predict: %d rows predicted, %d rejected", tally.output, tally.rejected)
            last_log = time.monotonic()
    key = lambda s: s.file  # noqa: E731 - the manifest lists parts by name
    return tally, (sorted(parts, key=key), sorted(rejects, key=key))
