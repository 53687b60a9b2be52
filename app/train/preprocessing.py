"""The run's preprocessor: the dataset's own when its task says it carries one (a corpus,
tokenized at prepare), else one fitted on the train split with the run's pretrained folders.
Here, above both, the task registry and the model families meet the data layer."""

from __future__ import annotations

from app.config import Config
from app.data.ingest import fit_on_train_split
from app.data.prepare import DatasetManifest, read_manifest
from app.data.preprocess import Preprocessor
from app.registry import run_task
from app.train.parts import DATASET_PREPROCESSOR


def fit_preprocessor(config: Config, manifest: DatasetManifest | None = None) -> Preprocessor:
    from app.models.families import Bases  # torch: the driver only

    manifest = manifest or read_manifest(config.data_output)
    task = run_task(config.train.task, manifest.kind)
    if task.has(DATASET_PREPROCESSOR):
        return task.part(DATASET_PREPROCESSOR)(config, manifest)
    return fit_on_train_split(config, manifest, Bases(config.model))
