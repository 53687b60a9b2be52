"""Evaluation metrics: scikit-learn's, on label indices, with every class reported."""

from __future__ import annotations

import numpy as np
import pytest

from app.tasks.classify.evaluate import classification_metrics

pytestmark = pytest.mark.unit


def test_metrics_per_class_and_confusion_matrix():
    m = classification_metrics(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]), ["a", "b", "c"])
    assert m["accuracy"] == 0.75 and m["rows"] == 4
    assert m["confusion_matrix"] == [[1, 0, 0], [0, 1, 1], [0, 0, 1]]
    assert m["per_class"]["b"] == pytest.approx(
        {"precision": 1.0, "recall": 0.5, "f1": 2 / 3, "support": 2}
    )
    assert m["macro_f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


def test_a_class_never_seen_or_predicted_is_still_listed():
    m = classification_metrics(np.array([0, 0]), np.array([0, 0]), ["a", "b"])
    assert m["per_class"]["b"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    assert m["confusion_matrix"] == [[2, 0], [0, 0]]
