"""`tune:`: a Ray Tune search over dotted config keys (jobs.tune)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from app.config.section import Section


class SearchDimension(Section):
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


class TuneSection(Section):
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
