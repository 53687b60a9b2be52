"""Typed configuration: one YAML per workload plus dotted `section.key=value` overrides.

Every key is declared here; an unknown key or a bad value fails before any work starts with one line
naming the key (`ConfigError`, exit code 2 in the jobs).
"""

from __future__ import annotations

import os
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# The domain errors live in app/errors.py; `from app.config import ConfigError` keeps working.
from app.errors import ConfigError as ConfigError

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
)
# Relative output paths resolve against this folder (default: the current directory). `ray job
# submit` runs jobs inside a temporary copy of the working dir, so the cluster scripts set it.
ROOT_ENV = "RAYTORCH_ROOT"


# A name that becomes a folder or a key under a storage root (workload, run, model, Serve
# application): letters, digits, `_.-`, not starting with a dot, so `../` cannot leave the root.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class _Section(BaseModel):
    # Numbers are accepted for text fields (labels "0".."9", run_name=2024) as their text.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class StreamConfig(_Section):
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


class DataConfig(_Section):
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
    captions_per_image: int = Field(2, ge=1, le=5)  # synthetic_image_text

    @model_validator(mode="after")
    def _fractions(self) -> DataConfig:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError("val_fraction + test_fraction must leave at least 10% for training")
        if self.source in ("imagefolder", "table", "text_files", "image_text") and not self.path:
            raise ValueError(f"data.path is required for source {self.source!r}")
        return self


class ModelConfig(_Section):
    # A Hugging Face folder as save_pretrained writes it (local path, s3://, a hub cache
    # snapshot) to fine-tune: its config.json's model_type (gpt2, bert, vit) picks the
    # architecture and its sizes, so `name` and the size keys below are left out
    # (app/pretrained.py).
    pretrained: str | None = None
    # A registered family (cnn, mlp, transformer, gpt) or "pkg.module:callable"; default cnn.
    name: str | None = None
    channels: list[int] = Field(default_factory=lambda: [32, 64])
    hidden: list[int] = Field(default_factory=lambda: [128, 64])
    dim: int = Field(64, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    ff_dim: int = Field(128, ge=8)
    # Tokens per sequence: longer text is truncated, in training and serving alike (null: 32, or
    # a pretrained checkpoint's own limit).
    max_length: int | None = Field(None, ge=4)
    vocab_size: int = Field(2000, ge=32)
    dropout: float = Field(0.1, ge=0, lt=1)
    # Retrieval (a dual encoder): the joint embedding's width; towers from one CLIP folder
    # (`pretrained`), or a BERT-family text folder, a ViT folder or both with new projections
    # (a tower without a folder is the project's own, from scratch), or the project's own
    # encoders (none set).
    embed_dim: int = Field(64, ge=8)
    pretrained_text: str | None = None
    pretrained_image: str | None = None

    @property
    def builder(self) -> str:
        """The family or callable that builds a from-scratch model."""
        return self.name or "cnn"

    def sequence_length(self, limit: int | None = None) -> int:
        """`max_length`, else the checkpoint's `limit`, else 32; never beyond `limit`."""
        length = self.max_length or limit or 32
        if limit is not None and length > limit:
            raise ConfigError(
                f"config error: model.max_length: {length} exceeds the pretrained model's "
                f"{limit} positions"
            )
        return length

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.pretrained and self.name:
            raise ValueError(
                "model.name: leave it out with model.pretrained (the folder's model_type "
                "decides the architecture)"
            )
        if self.pretrained and (self.pretrained_text or self.pretrained_image):
            key = "pretrained_text" if self.pretrained_text else "pretrained_image"
            raise ValueError(
                f"model.{key}: leave it out with model.pretrained (a CLIP folder brings both "
                "towers)"
            )
        if self.dim % self.heads:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads})"
            )
        return self


class PipelineSection(_Section):
    """`train.pipeline`: how `train.strategy: pipeline` splits the model (app/train/pipeline.py)."""

    stages: int = Field(2, ge=2)  # ranks one pipeline spans; workers are a multiple of it
    microbatches: int = Field(4, ge=1)  # a batch's slices in flight; divides train.batch_size
    # gpipe: all forwards, then all backwards (activations of every microbatch held); 1f1b:
    # one forward, one backward (at most `stages` held); interleaved_1f1b: 2 stages a rank,
    # a smaller idle share for one more send per microbatch.
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    # The first block of each stage after the first (null: the blocks split evenly).
    split_points: list[int] = Field(default_factory=list)


class TrainConfig(_Section):
    # What the run learns: a registered task (app/tasks/registry.py) or "pkg.module:TASK";
    # by default the one the dataset's kind calls for (classify labelled rows, lm token rows).
    task: str | None = None
    # Default "<workload>-<timestamp>-<6 hex>"; an existing one resumes. A folder name, never a path.
    run_name: str | None = Field(None, pattern=NAME_PATTERN)
    storage_path: str = "outputs/runs"  # where runs and checkpoints go (a path or URI)
    # Ray Train workers (DDP or FSDP ranks): a count, or [min, max] for an elastic run that
    # starts once `min` fit, grows toward `max` as resources appear and goes on with fewer when
    # a node is lost, each time from the latest checkpoint (app/train/elastic.py).
    num_workers: int | tuple[int, int] = 2
    # Elastic runs: how often Ray Train considers a resize (its elastic_resize_monitor_interval_s).
    elastic_resize_interval_s: float = Field(60.0, gt=0)
    use_gpu: bool = False
    # Fractional CPUs so Ray Data's read/map tasks still fit beside the workers on 2 cores.
    cpus_per_worker: float = Field(0.5, gt=0)
    gpus_per_worker: float = Field(1.0, ge=0)  # GPUs each worker asks for when train.use_gpu
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"] = "PACK"
    epochs: int = Field(
        10, ge=1
    )  # passes over the train split (each bounded by max_steps_per_epoch)
    batch_size: int = Field(64, ge=1)  # per worker
    lr: float = Field(2e-3, gt=0)  # AdamW's peak learning rate
    # AdamW's decoupled weight decay, on weight matrices only: biases, norms' scales (and other
    # 1-d parameters) are not decayed, as in the BERT and GPT-2 recipes.
    weight_decay: float = Field(0.01, ge=0)
    # Learning rate: linear warmup over `warmup_steps` optimizer steps (null: `warmup_fraction`
    # of the run's steps), then `lr_schedule`: constant, linear decay to 0, or cosine decay to
    # 10% of `lr`.
    warmup_fraction: float = Field(0.05, ge=0, lt=1)
    warmup_steps: int | None = Field(None, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping (of the global gradient norm)
    grad_accum_steps: int = Field(1, ge=1)  # micro-batches per optimizer step
    # At most this many optimizer steps in the whole run (null: `epochs` full epochs); the last
    # epoch is cut short when it is reached.
    max_steps: int | None = Field(None, ge=1)
    # Fine-tuning a pretrained model (model.pretrained): which weights stay frozen: none, the
    # embeddings, or the whole backbone (only the new classifier head trains).
    freeze: Literal["none", "embeddings", "backbone", "image", "text", "towers"] = "none"
    # LoRA adapters of this rank on the Linear layers named (by dotted suffix) in
    # `lora_targets`; the rest of the backbone is frozen. 0: off. Adapters are merged into
    # the weights at export, so the artifact and serving are unchanged.
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_targets: list[str] = Field(default_factory=lambda: ["query", "value", "attn.qkv"])
    # At most this many optimizer steps per epoch (null: the whole train split). Bounds an
    # epoch on a large corpus: each epoch then trains on a fresh seeded sample of the split.
    max_steps_per_epoch: int | None = Field(None, ge=1)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # How ranks share the model (app/train/parallel.py): `ddp` replicates it; `fsdp` shards parameters,
    # gradients and optimizer state per block (FSDP2), with sharded checkpoints; `pipeline`
    # splits a transformer's blocks into `train.pipeline.stages` stages, one a rank (rows of
    # stages when there are more workers: data parallel across rows), sharded checkpoints too.
    strategy: Literal["ddp", "fsdp", "pipeline"] = "ddp"
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    compile: bool = False  # torch.compile each block (or the whole model if it has no blocks)
    # torch.profiler trace of this many optimizer steps (after one warm-up step) per rank, to
    # <run>/profile/rank<k>.json (Chrome trace format: Perfetto, chrome://tracing); 0: off.
    profile_steps: int = Field(0, ge=0)
    seed: int = 0
    torch_threads: int = Field(1, ge=1)  # torch intra-op threads per worker
    # Streamed data: rows pooled and permuted before batches are cut (app/data/feed.py:rebatch);
    # 0 keeps each block's order. The in-memory path permutes the whole shard every epoch.
    shuffle_buffer: int = Field(2000, ge=0)
    keep_checkpoints: int = Field(2, ge=1)  # best checkpoints kept by checkpoint_metric
    # `async` uploads while the next epoch trains (worth it for large checkpoints to remote
    # storage). `sync` by default: on CPU workers the async upload thread competes with the
    # training thread for the whole epoch, while a small checkpoint to local disk takes ms.
    checkpoint_upload: Literal["sync", "async"] = "sync"
    # How often Ray Train's controller polls the workers. It takes each epoch's report only when
    # it polls, and a worker's next report waits for that, so Ray's default (2 s) makes every
    # short epoch last 2 s. An explicit RAY_TRAIN_HEALTH_CHECK_INTERVAL_S wins.
    controller_poll_s: float = Field(0.2, gt=0)
    # Ranks checkpoints: any metric the task reports (null: the task's own, val_accuracy for
    # classifiers, val_loss for language models, val_rsum for retrieval; and its direction).
    checkpoint_metric: str | None = None
    checkpoint_mode: Literal["max", "min"] | None = None
    # Stop once `early_stopping_metric` has not improved (by more than `early_stopping_min_delta`)
    # for this many epochs; null trains all `epochs`. Decided on the all-reduced metric, so every
    # rank stops after the same epoch (app/train/loop.py:should_stop_early).
    early_stopping_patience: int | None = Field(None, ge=1)
    early_stopping_metric: str = "val_loss"  # any metric the task reports
    early_stopping_mode: Literal["min", "max"] = "min"
    early_stopping_min_delta: float = Field(0.0, ge=0)
    max_failures: int = Field(
        0, ge=-1
    )  # worker group restarts from the latest checkpoint (-1: no limit)
    # Progress line every N optimizer steps inside an epoch (long streamed epochs); 0: one
    # line per epoch only.
    log_every_steps: int = Field(0, ge=0)

    @field_validator("num_workers")
    @classmethod
    def _worker_range(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (value, value) if isinstance(value, int) else value
        if low < 1 or high < low:
            raise ValueError("a count >= 1, or [min, max] with 1 <= min <= max")
        return value

    @model_validator(mode="after")
    def _pipeline_fits(self) -> TrainConfig:
        if self.strategy != "pipeline":
            return self
        p = self.pipeline
        if self.batch_size % p.microbatches:
            raise ValueError(
                f"train.batch_size={self.batch_size} must be a multiple of "
                f"train.pipeline.microbatches={p.microbatches}"
            )
        if not isinstance(self.num_workers, int) or self.num_workers % p.stages:
            # Not elastic: Ray may start or resize a group at any size within a range.
            raise ValueError(
                f"train.num_workers={self.num_workers}: with train.strategy=pipeline a fixed "
                f"multiple of train.pipeline.stages={p.stages}"
            )
        # torch's limits: 1F1B runs a microbatch a stage at once; interleaving goes in rounds
        # of `stages` microbatches (fewer: one round).
        rounds = max(1, p.microbatches // p.stages)
        what = None
        if p.schedule == "1f1b" and p.microbatches < p.stages:
            what = f"at least {p.stages}"
        elif p.schedule == "interleaved_1f1b" and p.microbatches % rounds:
            what = f"a multiple of {rounds}"
        if what:
            raise ValueError(
                f"train.pipeline.microbatches={p.microbatches}: schedule {p.schedule} on "
                f"{p.stages} stages needs {what}"
            )
        if self.precision == "fp16" or self.compile:
            raise ValueError(
                "train.strategy=pipeline runs fp32 or bf16 without train.compile "
                "(fp16's loss scaling and compiled stages are not supported)"
            )
        return self

    @property
    def stages(self) -> int:
        """Ranks that see the same batch: a pipeline's stages (1 under ddp and fsdp)."""
        return self.pipeline.stages if self.strategy == "pipeline" else 1

    @property
    def worker_range(self) -> tuple[int, int]:
        n = self.num_workers
        return (n, n) if isinstance(n, int) else (int(n[0]), int(n[1]))

    @property
    def min_workers(self) -> int:
        return self.worker_range[0]

    @property
    def max_workers(self) -> int:
        return self.worker_range[1]

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers


class ExportConfig(_Section):
    registry: str = "outputs/registry"  # where artifacts are published (a path or URI)
    name: str | None = Field(None, pattern=NAME_PATTERN)  # default: the workload name
    opset: int = Field(17, ge=13)  # ONNX opset of the exported graphs
    # auto: static everywhere, else static on the Linear layers alone, else weight-only (each
    # batch-independent: app/export/quantize.py); dynamic scales activations per call.
    quantization: Literal["auto", "dynamic", "static", "static_linear"] = "auto"
    calibration_batches: int = Field(32, ge=1)  # of 32 train rows, spread over the split
    # Percentage points int8 may lose against fp32 (never less than one validation sample);
    # negative demands that int8 beat fp32.
    max_accuracy_drop: float = 0.5
    # int8 bytes / fp32 bytes at most (null: no bound). Export keeps at most `max_fp32_layers`
    # of the most accuracy-sensitive layers in fp32 when int8 would lose too much, and only
    # while this bound holds.
    max_size_ratio: float | None = Field(None, gt=0)
    max_fp32_layers: int = Field(2, ge=0)
    parity_tolerance: float = Field(
        1e-3, gt=0
    )  # largest |ONNX fp32 - torch| logit difference allowed
    parity_rows: int = Field(256, ge=1)  # val rows the parity check and calibration sample use
    latency_repeats: int = Field(30, ge=3)  # timed calls per batch size in the report
    # What classifiers and retrieval encoders are exported as: ONNX always (fp32 and int8, what
    # every path can serve), plus `aoti` (model.pt2: AOTInductor, native code for this machine's
    # CPU, servable) and `executorch` (model.pte, model.int8.pte: XNNPACK programs for phones
    # and edge devices; a retrieval model's per encoder, image.pt2, text.pte, ...).
    # A program that cannot be built or fails the gate is left out and the report says why.
    formats: list[Literal["onnx", "aoti", "executorch"]] = ["onnx"]  # pydantic copies defaults
    # Language models (task lm, app/export/lm.py): int8 perplexity may exceed fp32's by this
    # fraction on `perplexity_rows` val sequences, and along fp32's greedy continuation of
    # `greedy_prompts` val prompts (`greedy_prompt_tokens` each, `greedy_tokens` tokens) int8
    # must pick fp32's token at this share of positions at least (teacher-forced: each position
    # is one decision, app/export/lm.py:greedy_agreement).
    max_perplexity_increase: float = Field(0.02, ge=0)
    perplexity_rows: int = Field(64, ge=1)
    min_greedy_agreement: float = Field(0.9, ge=0, le=1)
    greedy_prompts: int = Field(8, ge=1)
    greedy_prompt_tokens: int = Field(16, ge=1)
    greedy_tokens: int = Field(16, ge=1)
    # Retrieval: points of val Recall@1 (either direction) int8 may lose against fp32 (a loss
    # beyond it refuses the export when it is more than chance flips: McNemar's test on the
    # queries), and the cosine every fp32 ONNX embedding must reach against torch's.
    max_recall_drop: float = 2.0
    min_cosine: float = Field(0.999, gt=0, le=1)

    @field_validator("formats")
    @classmethod
    def _names_onnx(cls, formats: list[str]) -> list[str]:
        if "onnx" not in formats or len(set(formats)) != len(formats):
            raise ValueError(
                f"export.formats: {formats} must name onnx (what every path serves) and each "
                "format once"
            )
        return formats


class IndexConfig(_Section):
    """`index`: the vector index `jobs.index` builds from a retrieval model's embeddings."""

    name: str | None = Field(None, pattern=NAME_PATTERN)  # default: <export name>-index
    # exact: inner product over every vector (faiss IndexFlatIP); hnsw: a graph of `hnsw_m`
    # neighbours a node; ivf: `nlist` inverted lists, `nprobe` of them searched a query.
    method: Literal["exact", "hnsw", "ivf"] = "exact"
    hnsw_m: int = Field(32, ge=4, le=256)
    ef_construction: int = Field(80, ge=8)
    ef_search: int = Field(64, ge=1)
    nlist: int = Field(256, ge=1)
    nprobe: int = Field(16, ge=1)
    # Held-out queries whose top-10 from the index is compared with the exact top-10.
    recall_queries: int = Field(200, ge=1)
    batch_rows: int = Field(8192, ge=1)  # embeddings read and added at a time (never all at once)
    # An item's stored metadata (its passthrough columns) at most: a search answer carries up
    # to serve.max_search_results items, so this bounds its size. More is refused, by row.
    max_metadata_bytes: int = Field(4096, ge=64)
    # A JPEG thumbnail per picture (jobs.predict makes it as it embeds, jobs.index stores it)
    # for the search page: longest side `thumbnail_px`; one over `max_thumbnail_bytes` is
    # left out (the page shows the item without it).
    thumbnails: bool = False
    thumbnail_px: int = Field(128, ge=16, le=128)
    max_thumbnail_bytes: int = Field(16384, ge=1024, le=65536)


class AutoscalingConfig(_Section):
    min_replicas: int = Field(1, ge=0)  # replicas per model at least
    max_replicas: int = Field(2, ge=1)  # replicas per model at most
    target_ongoing_requests: float = Field(
        2.0, gt=0
    )  # Serve scales toward this many requests in flight per replica
    upscale_delay_s: float = Field(
        5.0, ge=0
    )  # how long load must stay high before a replica is added
    downscale_delay_s: float = Field(
        30.0, ge=0
    )  # how long load must stay low before one is removed
    metrics_interval_s: float = Field(1.0, gt=0)  # how often replicas report their load
    look_back_period_s: float = Field(5.0, gt=0)  # the window the load is averaged over


class BatchingConfig(_Section):
    """`serve.batching`: how a classifier replica batches requests (app/serve/replicas/batching.py)."""

    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    # Batches a replica may have in flight at once, and its ONNX Runtime worker threads: a
    # batch's length groups run side by side, and a batch forms while the previous one runs.
    max_concurrent_batches: int = Field(2, ge=1)
    # A batch is split into groups of similar text length: padding at most this many times the
    # real tokens of a group (0: only equal lengths share a call).
    max_padding_waste: float = Field(0.5, ge=0)
    # Whether the requests a batch gathers share ONNX Runtime calls. on: grouped by length;
    # off: one call per request, spread over the worker threads; auto: the replica measures at
    # start whether one call on 8 rows costs less than 8 calls on one row plus the thread
    # hand-offs (a small MLP or CNN gains, a wide Transformer on few cores loses), and chooses.
    calls: Literal["auto", "on", "off"] = "auto"


class GenerationConfig(_Section):
    """`serve.generation`: a language model's replica (app/serve/replicas/lm_server.py)."""

    # Prompt tokens at most (and never beyond the model's window), `max_tokens` a request may
    # ask for and its default, and generations a replica runs at once (one more is a 503; the
    # decode loop steps them all together). A stream holds one of serve.max_ongoing_requests
    # while it runs: raise that too for more streams, or they queue in front of the replica.
    max_prompt_tokens: int = Field(1024, ge=1)
    max_tokens: int = Field(512, ge=1)
    default_max_tokens: int = Field(16, ge=1)
    max_streams: int = Field(16, ge=1)
    # Tokens one request may ask for in all (n x max_tokens): its decoding shares the one
    # decode thread with every other stream, and its answer body grows with it.
    max_request_tokens: int = Field(4096, ge=1)
    # KV-cache memory (MiB) the decode batch may hold: rows x the longest prompt + max_tokens
    # (rows are padded to it) x 2 (a step's outputs); a stream beyond it waits, then is a 503
    # (None: max_streams alone bounds it).
    max_kv_cache_mib: float | None = Field(None, gt=0)
    # A stream's text that comes within this many ms of its last event goes out with the next
    # one (the first at once): each event crosses from the replica to the routing app and out
    # as an SSE write, work that takes the replica's GIL from the decode loop (0: every token).
    stream_interval_ms: float = Field(40.0, ge=0)

    @model_validator(mode="after")
    def _default_fits(self) -> GenerationConfig:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"serve.generation.default_max_tokens ({self.default_max_tokens}) must not "
                f"exceed serve.generation.max_tokens ({self.max_tokens})"
            )
        return self


class ServeConfig(_Section):
    app_name: str = "models"  # the Serve application routing to every model
    host: str = "127.0.0.1"  # where Serve's HTTP proxy listens
    port: int = Field(8000, ge=1, le=65535)  # Serve's HTTP port
    # auto: the variant export measured fastest at `batching.max_batch_size` rows among those
    # this process can run (ONNX fp32, ONNX int8, AOTInductor); aoti needs export.formats aoti.
    variant: Literal["auto", "fp32", "int8", "aoti"] = "int8"
    # Name of an environment variable holding the API key; when set there, every model route
    # needs `Authorization: Bearer <key>`. Required when `host` or the host Serve really listens
    # on (http_options.host) is not loopback (the rule: app.serve.http.gate.api_key).
    api_key_env: str = "RAYTORCH_API_KEY"
    # Rows after flattening: a text tensor of shape [1, N] is N rows.
    max_request_rows: int = Field(1024, ge=1)
    # How long the ingress waits for a model replica's answer before replying 504.
    request_timeout_s: float = Field(30.0, gt=0)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger request bodies get a 413
    # Retrieval, each read from a picture's header before anything is decoded: the pixels a
    # sent picture may decode to (more is a 413: a small file can decode to gigabytes), its
    # longer side over its shorter (more is a 400: a shortest-edge resize scales the long side
    # with it), and the pixels of all the pictures of one request together (more is a 413).
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    max_image_aspect: float = Field(20.0, ge=1)
    max_request_pixels: int = Field(64 * 2**20, ge=1)
    # Search: results per query, queries per request (max_request_rows, the rows any request
    # may carry, bounds them too) and results per request, queries x top_k (more of any is a
    # 413): a request's encoding time and its answer's size stay bounded.
    max_top_k: int = Field(100, ge=1)
    max_queries: int = Field(256, ge=1)
    max_search_results: int = Field(10_000, ge=1)
    batching: BatchingConfig = Field(default_factory=lambda: BatchingConfig())
    max_ongoing_requests: int = Field(16, ge=1)  # requests a model replica holds at once
    max_queued_requests: int = Field(64, ge=-1)  # waiting beyond that get a 503 (-1: unbounded)
    replica_cpus: float = Field(0.5, gt=0)  # CPUs per model replica
    replica_gpus: float = Field(0.0, ge=0)  # GPUs per model replica
    ingress_cpus: float = Field(0.25, gt=0)  # CPUs per replica of the routing application
    ingress_replicas: int = Field(1, ge=1)  # replicas of the routing application
    # The ingress only parses and forwards, so it can hold many requests at once; Serve's
    # default (5) would make it the bottleneck.
    ingress_max_ongoing_requests: int = Field(256, ge=1)
    health_check_period_s: float = Field(10.0, gt=0)  # Serve's replica health check period
    # A check that has not answered by then fails it (a replica failing 3 in a row is replaced).
    health_check_timeout_s: float = Field(30.0, gt=0)
    # A replica being stopped (downscaled, replaced, unhealthy) waits this long for its running
    # requests, then is killed: raise it for long generations, lower it to replace a wedged
    # replica sooner. Serve's default.
    graceful_shutdown_timeout_s: float = Field(20.0, gt=0)
    # Serve's per-request access log line in each model replica's log. Off by default: every
    # request is already counted in raytorch_requests_total (model, status) and Serve's own
    # request metrics, and the line costs a measurable share of a small model's request.
    access_log: bool = False
    generation: GenerationConfig = Field(default_factory=lambda: GenerationConfig())
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)

    @model_validator(mode="after")
    def _batch_fits(self) -> ServeConfig:
        # A replica never holds more than max_ongoing_requests requests, so a larger batch
        # could never fill and would only add wait.
        if self.batching.max_batch_size > self.max_ongoing_requests:
            raise ValueError(
                f"serve.batching.max_batch_size ({self.batching.max_batch_size}) must not exceed "
                f"serve.max_ongoing_requests ({self.max_ongoing_requests})"
            )
        if self.autoscaling.min_replicas > self.autoscaling.max_replicas:
            raise ValueError("serve.autoscaling.min_replicas must not exceed max_replicas")
        return self

    def query_limit(self) -> tuple[str, int]:
        """The queries one search may carry, and the key that sets it: max_queries, or fewer
        when every request's rows (max_request_rows) are fewer."""
        if self.max_request_rows < self.max_queries:
            return "max_request_rows", self.max_request_rows
        return "max_queries", self.max_queries


class PredictGenerationConfig(_Section):
    """`predict.generation`: completions of a language model's rows (app/predict/generate.py)."""

    # The column of each row's prompt, or of its chat messages (a list of {role, content},
    # rendered with the model's chat template, as /v1/chat/completions does).
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    # Each row's sampling fields, read and checked as /v1/completions reads its body (the
    # bounds of serve.generation apply); a column of the same name sets a row's own value
    # (null: this default). Absent fields are the endpoint's defaults.
    sampling: dict[str, Any] = Field(default_factory=lambda: {"max_tokens": 64, "temperature": 0})
    logprobs: int | None = Field(None, ge=0, le=5)  # each token's log-probability (and top n)
    max_streams: int = Field(16, ge=1)  # rows one actor decodes together (continuous batching)


class PredictConfig(_Section):
    """Offline batch inference (`jobs.predict`, app/predict/)."""

    # A malformed input row (missing or null value, not a number, NaN, undecodable text):
    # `fail` stops the job (exit 1) naming the first ones; `reject` writes them with their reason
    # to `<output>/rejects/` and predicts the rest. Either way none is dropped silently.
    on_bad_rows: Literal["fail", "reject"] = "fail"
    max_examples: int = Field(5, ge=1)  # malformed rows named in the summary or the failure
    batch_size: int = Field(1024, ge=1)  # rows per ONNX Runtime call
    # The actor pool autoscales from one actor to `max_actors`; each builds its ONNX Runtime
    # session once, then reads, scores and writes the pieces it is handed.
    max_actors: int = Field(2, ge=1)
    actor_cpus: float = Field(0.5, gt=0)  # CPUs per predict actor
    threads: int = Field(1, ge=1)  # ONNX Runtime intra-op threads per actor
    # null: a GPU per actor (`gpus_per_actor`) when the cluster has GPUs, else CPU.
    use_gpu: bool | None = None
    gpus_per_actor: float = Field(1.0, gt=0)  # GPUs per predict actor when on GPU
    variant: Literal["auto", "fp32", "int8", "aoti"] | None = None  # null: `serve.variant`
    rows_per_file: int = Field(1_000_000, ge=1)  # rows per output Parquet file
    generation: PredictGenerationConfig = Field(default_factory=lambda: PredictGenerationConfig())


class SearchDimension(_Section):
    """One searched key: exactly one of `choice`, `uniform` or `loguniform` ([low, high])."""

    choice: list[Any] | None = Field(None, min_length=1)
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> SearchDimension:
        kinds = [k for k in ("choice", "uniform", "loguniform") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of choice, uniform, loguniform")
        bounds = self.uniform or self.loguniform
        if bounds and not bounds[0] < bounds[1]:
            raise ValueError(f"low must be below high (got {list(bounds)})")
        if self.loguniform and self.loguniform[0] <= 0:
            raise ValueError("loguniform bounds must be positive")
        return self


class TuneSection(_Section):
    """`jobs.tune`: dotted config keys searched with Ray Tune, trials stopped early by ASHA."""

    space: dict[str, SearchDimension] = Field(
        min_length=1
    )  # dotted config key -> its search dimension
    num_trials: int = Field(4, ge=1)  # trials sampled from `space`
    metric: str = "val_accuracy"  # any metric the training loop reports each epoch
    mode: Literal["min", "max"] = "max"
    # Trials running at once; each is a whole Train run (train.num_workers workers).
    max_concurrent_trials: int = Field(1, ge=1)
    grace_period: int = Field(2, ge=1)  # epochs every trial runs before ASHA may stop it
    reduction_factor: float = Field(
        2.0, gt=1
    )  # ASHA keeps 1 / reduction_factor of trials at each rung
    seed: int = 0

    @model_validator(mode="after")
    def _keys_are_config_keys(self) -> TuneSection:
        for key in self.space:
            if key.split(".")[0] not in ("data", "model", "train", "export", "serve", "predict"):
                raise ValueError(f"space key {key!r} must be a dotted config key like train.lr")
            if key.split(".")[0] == "data" or key in ("train.run_name", "train.storage_path"):
                raise ValueError(f"space key {key!r} cannot vary between trials")
        return self


class Config(_Section):
    workload: str = Field(
        "digits", pattern=NAME_PATTERN
    )  # names the data, runs and artifact; default: the config file's name
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    predict: PredictConfig = Field(default_factory=PredictConfig)
    tune: TuneSection | None = None  # only jobs.tune reads it
    index: IndexConfig = Field(default_factory=IndexConfig)

    @property
    def data_output(self) -> str:
        return resolve_uri(self.data.output.format(workload=self.workload))

    @property
    def storage_path(self) -> str:
        return resolve_uri(self.train.storage_path)

    @property
    def registry(self) -> str:
        return resolve_uri(self.export.registry)

    @property
    def artifact_name(self) -> str:
        return self.export.name or self.workload

    def run_name(self) -> str:
        """`train.run_name`, else a new name: `<workload>-<local time>-<6 hex>`. The random
        suffix keeps two runs started in the same second apart (the same name would resume)."""
        if self.train.run_name:
            return self.train.run_name
        return f"{self.workload}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def resolve_uri(uri: str) -> str:
    """A URI with a scheme stays as is; a local path becomes absolute (under $RAYTORCH_ROOT)."""
    if "://" in uri:
        return uri
    path = Path(uri).expanduser()
    if not path.is_absolute():
        path = Path(os.environ.get(ROOT_ENV) or os.getcwd()) / path
    return str(path)


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None
) -> Config:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"config file {path}: not valid YAML{where}: {problem}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        raw.setdefault("workload", Path(path).stem)
    for item in overrides or []:
        apply_override(raw, item)
    return resolve_paths(validate(raw))


# Keys holding a local path or URI, resolved once where a job loads its config: a Tune trial or a
# Train worker runs in a working directory of its own and must never resolve them again there.
PATH_KEYS = (
    ("data", "output"),
    ("data", "path"),
    ("data", "images"),
    ("data", "image_roots"),
    ("model", "pretrained"),
    ("train", "storage_path"),
    ("export", "registry"),
)


def resolve_paths(config: Config) -> Config:
    """The config with every relative path key made absolute (`resolve_uri`); URIs with a
    scheme, and `data.path` globs under `{stdlib}`, stay as they are."""
    for section, key in PATH_KEYS:
        node = getattr(config, section)
        value = getattr(node, key)
        if isinstance(value, list):
            setattr(node, key, [resolve_uri(v) for v in value])
        elif value and not value.startswith("{stdlib}"):
            setattr(node, key, resolve_uri(value))
    return config


def apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected section.key=value")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError:
        node[parts[-1]] = value


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        msg = msg.removeprefix("Value error, ")  # a validator's own message says what is wrong
        if (
            err["type"] != "extra_forbidden"
            and "input" in err
            and not isinstance(err["input"], dict)
        ):
            msg += f" (got {err['input']!r})"
        where = f"{loc}: " if loc else ""
        raise ConfigError(f"config error: {where}{msg}") from None


def dump(config: Config) -> dict[str, Any]:
    return config.model_dump(mode="json")
