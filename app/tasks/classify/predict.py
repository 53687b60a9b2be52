"""Task `classify`'s batch inference (jobs.predict): each good row's label and probabilities."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from app.predict.actor import ArtifactBatches, PredictInput, outputs_table
from app.predict.row_checks import CheckedBatch, InputSpec, check_batch
from app.runtime.artifact import run_logits
from app.runtime.rows import softmax


class ClassifierPredictor(ArtifactBatches):
    """A classifier's batches: labels and probabilities."""

    @staticmethod
    def input_spec(request: PredictInput) -> InputSpec:
        return InputSpec.of(request.schema, request.id_column, request.format)

    def __init__(self, artifact_uri: str, variant: str, threads: int, spec: InputSpec):
        super().__init__(artifact_uri, spec)
        self.session = self.artifact.session(variant, threads)
        self.labels = np.asarray(self.artifact.preprocessor.labels, dtype=object)

    def __call__(self, batch: pa.Table) -> pa.Table:
        columns, n, known, where = self.columns(batch)
        checked = check_batch(columns, n, self.spec, known)
        outputs = classifier_outputs(self._probabilities(checked), self.labels)
        return outputs_table(columns, self.spec.id_column, checked, outputs, where, self.meta)

    def _probabilities(self, checked: CheckedBatch) -> np.ndarray:
        if not len(checked.good):
            return np.zeros((0, len(self.labels)), np.float32)
        inputs = self.artifact.preprocessor.features(checked.raw)
        return softmax(run_logits(self.session, inputs)).astype(np.float32)


def classifier_outputs(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, pa.Array]:
    """Each good row's label (the likeliest) and its probabilities."""
    flat = pa.array(probabilities.reshape(-1), pa.float32())
    chosen = labels[probabilities.argmax(1)].tolist() if len(probabilities) else []
    return {
        "label": pa.array(chosen, pa.string()),
        "probabilities": pa.FixedSizeListArray.from_arrays(flat, probabilities.shape[1]).cast(
            pa.list_(pa.float32())
        ),
    }
