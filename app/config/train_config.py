"""`train:`: how a run trains: workers, strategy, optimizer, precision, checkpoints (app/train/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from app.config.section import NAME_PATTERN, Section


class PipelineSection(Section):
    """`train.pipeline`: how `train.strategy: pipeline` splits the model (app/train/pipelining.py)."""

    stages: int = Field(2, ge=2)  # ranks one pipeline spans; workers are a multiple of it
    microbatches: int = Field(4, ge=1)  # a batch's slices in flight; divides train.batch_size
    # gpipe: all forwards, then all backwards (activations of every microbatch held); 1f1b:
    # one forward, one backward (at most `stages` held); interleaved_1f1b: 2 stages a rank,
    # a smaller idle share for one more send per microbatch.
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    # The first block of each stage after the first (null: the blocks split evenly).
    split_points: list[int] = Field(default_factory=list)


class TrainConfig(Section):
    # What the run learns: a registered task (app/registry.py) or "pkg.module:TASK";
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
    # `lora_targets` (null: the model's own defaults: a Llama-style decoder's every attention
    # and MLP projection, else query, value and attn.qkv); the rest of the backbone is frozen.
    # 0: off. Adapters are merged into the weights at export: the artifact and serving are
    # unchanged.
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_targets: list[str] | None = None
    # At most this many optimizer steps per epoch (null: the whole train split). Bounds an
    # epoch on a large corpus: each epoch then trains on a fresh seeded sample of the split.
    max_steps_per_epoch: int | None = Field(None, ge=1)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # How ranks share the model (app/train/parallel.py): `ddp` replicates it; `fsdp` shards parameters,
    # gradients and optimizer state per block (FSDP2), with sharded checkpoints; `pipeline`
    # splits a transformer's blocks into `train.pipeline.stages` stages, one a rank (rows of
    # stages when there are more workers: data parallel across rows), sharded checkpoints too.
    strategy: Literal["ddp", "fsdp", "pipeline"] = "ddp"
    # fsdp: a causal LM's token embedding and LM head (one table when tied) stay sharded by rows
    # and are never gathered; activations cross ranks instead (app/train/vocab_parallel.py).
    # false: FSDP2 gathers them like any parameter (the whole table and its gradient per rank).
    shard_vocab: bool = True
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
