"""`export:`: which artifacts a checkpoint becomes and what they must pass (app/export/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from app.config.section import NAME_PATTERN, Section


class ExportConfig(Section):
    registry: str = "outputs/registry"  # where artifacts are published (a path or URI)
    name: str | None = Field(None, pattern=NAME_PATTERN)  # default: the workload name
    opset: int = Field(17, ge=13)  # ONNX opset of the exported graphs
    # A graph whose weights pass this many bytes keeps them in one external-data file beside it
    # (`model.onnx.data`, hashed in the manifest): protobuf holds no message over 2 GB.
    external_data_bytes: int = Field(1_800_000_000, ge=0)
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
    # Language models (task lm, app/tasks/lm/export.py): int8 perplexity may exceed fp32's by this
    # fraction on `perplexity_rows` val sequences, and along fp32's greedy continuation of
    # `greedy_prompts` val prompts (`greedy_prompt_tokens` each, `greedy_tokens` tokens) int8
    # must pick fp32's token at this share of positions at least (teacher-forced: each position
    # is one decision, app/tasks/lm/export.py:greedy_agreement).
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
