"""Typed configuration: one YAML per workload plus dotted `section.key=value` overrides.

A module per section (data, model, train, export, index, serve, predict, tune), the whole and
its loading in root.py. Every key is declared; an unknown key or a bad value fails before any
work starts with one line naming the key (`ConfigError`, exit code 2 in the jobs).
"""

from app.config.data_config import SOURCES, DataConfig, StreamConfig
from app.config.export_config import ExportConfig
from app.config.index_config import IndexConfig
from app.config.model_config import ModelConfig
from app.config.predict_config import PredictConfig, PredictGenerationConfig
from app.config.root import (
    PATH_KEYS,
    ROOT_ENV,
    Config,
    apply_override,
    dump,
    load_config,
    resolve_paths,
    resolve_uri,
    validate,
)
from app.config.section import NAME_PATTERN, Section
from app.config.serve_config import AutoscalingConfig, BatchingConfig, GenerationConfig, ServeConfig
from app.config.train_config import PipelineSection, TrainConfig
from app.config.tune_config import SearchDimension, TuneSection
from app.errors import ConfigError

__all__ = [
    "NAME_PATTERN",
    "PATH_KEYS",
    "ROOT_ENV",
    "SOURCES",
    "AutoscalingConfig",
    "BatchingConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ExportConfig",
    "GenerationConfig",
    "IndexConfig",
    "ModelConfig",
    "PipelineSection",
    "PredictConfig",
    "PredictGenerationConfig",
    "Section",
    "SearchDimension",
    "ServeConfig",
    "StreamConfig",
    "TrainConfig",
    "TuneSection",
    "apply_override",
    "dump",
    "load_config",
    "resolve_paths",
    "resolve_uri",
    "validate",
]
