"""`data:`: where a workload's rows come from and how they are prepared and fed (app/data/)."""

from __future__ import annotations

from datetime import date
from typing import Literal

from pydantic import Field, model_validator

from app.config.section import Section

SOURCES = (
    "digits",
    "breast_cancer",
    "wine",
    "imagefolder",
    "table",
    "synthetic_text",
    "synthetic_image",
    "text_files",
    "image_text",
    "synthetic_image_text",
    "chat",
)


class StreamConfig(Section):
    """`data.stream`: how a streamed split reaches the train workers (app/data/ingest.py)."""

    # Ray Data read tasks per train worker (parallel reads that overlap training).
    read_tasks_per_worker: int = Field(4, ge=1)
    # Read tasks running at once, per train worker. Each running task is a worker process Ray
    # must start at the first epoch, which delays the first step on a small machine; one per
    # train worker keeps up whenever reading a row costs less than training on it.
    reads_in_flight_per_worker: int = Field(1, ge=1)
    # Blocks (one read task's piece each, up to a shard) each worker fetches ahead of its
    # training loop; batches are cut from them in the worker (app/data/feed.py:rebatch).
    prefetch_blocks: int = Field(4, ge=0)
    # CPUs Ray Data may use at once, shared equally by the workers' streams (null: what the train
    # workers leave free, at least one task's worth each), so neither side starves the other.
    max_cpus: float | None = Field(None, gt=0)
    # Object store memory Ray Data may fill with blocks in flight, shared equally by the
    # workers' streams, so memory stays flat however large the data.
    object_store_mb: float = Field(256, gt=0)


class DataConfig(Section):
    source: Literal[SOURCES] = "digits"  # type: ignore[valid-type]
    path: str | None = None
    label_column: str = "label"  # the column holding each row's label (table sources)
    feature_columns: list[str] | None = None
    text_column: str | None = None
    labels: list[str] | None = None  # declared label set; rows outside it are refused
    # table: the column whose value decides a row's split (rows sharing it share a split); by
    # default a row's own values do (duplicate rows land in one split).
    key_column: str | None = None
    val_fraction: float = Field(
        0.2, gt=0, lt=1
    )  # share of rows (documents, for a corpus) held out for validation
    test_fraction: float = Field(
        0.0, ge=0, lt=1
    )  # share held out for jobs.evaluate alone (0: it scores val)
    # The kind of data the rows are, by its processor class: "pkg.module:Class", a subclass of
    # the source's own kind's (a table's `Tabular`, ...) that brings its own preprocessing;
    # null: the source's own kind.
    kind: str | None = None
    seed: int = 0
    output: str = "outputs/data/{workload}"  # where prepared shards go (a path or URI)
    rows_per_shard: int = Field(1000, ge=1)  # rows per Parquet shard
    # Dataset generations kept after a prepare: the new one and the ones before it, which jobs
    # still reading through an older manifest may need (app/data/prepare.py).
    keep_generations: int = Field(2, ge=1)
    # CPUs each Ray Data read/preprocess task asks for. Fractional, so ingest still schedules on
    # a 2-core machine beside train workers and Serve replicas (Ray Data's default is 1 CPU).
    task_cpus: float = Field(0.25, gt=0)
    # How training gets its batches (app/data/ingest.py:plan_data_path decides, and the job log says
    # why): `memory` preprocesses each worker's shard once and keeps it in the worker for every
    # epoch; `stream` reads and preprocesses with Ray Data every epoch; `auto` picks memory when
    # the preprocessed train + val splits fit `cache_budget_mb`.
    cache: Literal["auto", "memory", "stream"] = "auto"
    # Default (null): a quarter of the cluster's object store memory.
    cache_budget_mb: float | None = Field(None, gt=0)
    stream: StreamConfig = Field(default_factory=lambda: StreamConfig())
    # Generators and image folders.
    num_rows: int = Field(4000, ge=10)
    num_classes: int = Field(4, ge=2, le=64)
    image_size: int = Field(16, ge=4, le=512)
    # text_files (a language-model corpus): `path` is a glob (`**` recurses; `{stdlib}` stands for
    # this Python's standard library folder), one document per file; files under a folder named
    # in `exclude_dirs` are skipped.
    exclude_dirs: list[str] = Field(default_factory=list)
    # image_text: a table (CSV/JSONL/Parquet) of an image column (a path, relative to the
    # table's folder, or a URI, or the image's bytes) and a caption column, several rows a
    # picture allowed; or the Karpathy-split JSON of COCO and Flickr30k (`format: karpathy`,
    # `path` the JSON, `images` the folder its file names are in).
    image_column: str = "image"
    caption_column: str = "caption"
    format: Literal["table", "karpathy"] = "table"
    images: str | None = None  # karpathy: the folder of the pictures (default: the JSON's)
    # A picture's longer side over its shorter (prepare and predict); more is a bad row. A
    # resize to a shortest edge scales the long side with it: 4,194,304 x 4 pixels would be
    # gigabytes at 224.
    max_image_aspect: float = Field(20.0, ge=1)
    # image_text: where pictures named by path may be read. A relative path is read under the
    # table's folder (the JSON's, or `images`, for karpathy); an absolute path or a URI only
    # under one of these roots. A path outside, a missing file and a non-regular one (a
    # device, a folder) are one "cannot read" refusal alike.
    image_roots: list[str] = Field(default_factory=list)
    max_image_bytes: int = Field(32 * 2**20, ge=1024)  # one picture's file, read at most
    # A picture that cannot be read (missing, corrupt, a decompression bomb): a one-line
    # refusal naming its row, or, when set, skipped and counted in the prepare summary.
    skip_bad_rows: bool = False
    # A prepare stage whose tasks show no sign of life this long (no CPU used, no function
    # returned, no result delivered) fails naming them and their nodes instead of waiting.
    stall_timeout_s: float = Field(300.0, gt=0)
    captions_per_image: int = Field(2, ge=1, le=5)  # synthetic_image_text
    # chat (app/data/chat_source.py): JSON Lines of conversations, rendered by the pretrained
    # folder's chat template. `train_on`: the tokens the loss counts (the assistant turns with
    # their end-of-turn tokens, or every token); `pack`: several conversations to a row, kept
    # apart by the attention mask (off: one a row, padded); `truncate`: cut a conversation
    # longer than model.max_length instead of refusing it; `chat_date`: the day a template's
    # strftime_now renders (Llama 3's "Today Date"), fixed so that prepared shards repeat.
    train_on: Literal["assistant", "all"] = "assistant"
    pack: bool = True
    truncate: bool = False
    chat_date: str = "2026-01-01"

    @model_validator(mode="after")
    def _fractions(self) -> DataConfig:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError("val_fraction + test_fraction must leave at least 10% for training")
        if (
            self.source in ("imagefolder", "table", "text_files", "image_text", "chat")
            and not self.path
        ):
            raise ValueError(f"data.path is required for source {self.source!r}")
        try:
            date.fromisoformat(self.chat_date)
        except ValueError:
            raise ValueError(f"chat_date {self.chat_date!r} is not a date (YYYY-MM-DD)") from None
        return self
