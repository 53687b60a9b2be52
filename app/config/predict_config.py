"""`predict:`: batch inference over data of any size (app/predict/)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from app.config.section import Section


class PredictGenerationConfig(Section):
    """`predict.generation`: completions of a language model's rows (app/tasks/lm/predict.py)."""

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


class PredictConfig(Section):
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
