"""The whole config, and how it is loaded: one YAML per workload plus dotted `section.key=value`
overrides, validated into typed sections, relative paths resolved once."""

from __future__ import annotations

import os
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from app.config.data_config import DataConfig
from app.config.export_config import ExportConfig
from app.config.index_config import IndexConfig
from app.config.model_config import ModelConfig
from app.config.predict_config import PredictConfig
from app.config.section import NAME_PATTERN, Section
from app.config.serve_config import ServeConfig
from app.config.train_config import TrainConfig
from app.config.tune_config import TuneSection
from app.errors import ConfigError

# Relative output paths resolve against this folder (default: the current directory). `ray job
# submit` runs jobs inside a temporary copy of the working dir, so the cluster scripts set it.
ROOT_ENV = "RAYTORCH_ROOT"


class Config(Section):
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

    @model_validator(mode="after")
    def _packed_rows_stay_whole(self) -> Config:
        if self.data.source == "chat" and self.data.pack and self.train.strategy == "pipeline":
            raise ValueError(
                "train.strategy=pipeline cannot train packed chat rows (the mask that keeps "
                "their conversations apart does not cross stages): set data.pack=false"
            )
        return self

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
