"""`model:`: the architecture trained, from scratch or from a pretrained folder (app/models/)."""

from __future__ import annotations

from pydantic import Field, model_validator

from app.config.section import Section
from app.errors import ConfigError


class ModelConfig(Section):
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
