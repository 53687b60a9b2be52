"""Pictures (app/plots.py) and where evaluate finds a run's history for its training curves."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from app import plots
from app.evaluate.held_out import run_history
from app.tasks.classify.evaluate import CONFUSION_PNG, CURVES_PNG, write_plots
from app.train.checkpoint import META

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def _font_cache():
    """matplotlib builds its font cache once per machine and asks `fc-list` for system fonts
    then; a module fixture runs before the unit tier's no-subprocess guard (function scope)."""
    import matplotlib.font_manager  # noqa: F401


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a valid PNG; PIL raises on anything else."""
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    image.verify()
    return image.size


def epochs(n: int) -> list[dict]:
    return [
        {
            "epoch": e,
            "train_loss": 1.0 / e,
            "val_loss": 1.2 / e,
            "val_accuracy": 0.5 + 0.05 * e,
            "learning_rate": 1e-3,
            "samples_per_second": 1000.0,
        }
        for e in range(1, n + 1)
    ]


def quality(report: dict):
    from app.tasks.classify.export import quality

    return quality(report)


def test_each_picture_is_a_png_of_a_sensible_size():
    report = {
        "accuracy": {"torch_fp32": 0.97, "onnx_fp32": 0.97, "onnx_int8": 0.96},
        "accuracy_rows": 360,
        "size_bytes": {"fp32": 300_000, "int8": 95_000},
        "size_ratio_int8": 0.32,
        "latency_ms": {
            "fp32": {"batch_1": 0.05, "batch_32": 1.2},
            "int8": {"batch_1": 0.03, "batch_32": 0.5},
        },
        "quantization": {"method": "static"},
    }
    pictures = {
        "confusion": plots.confusion_matrix([[5, 1], [0, 7]], ["cat", "dog"]),
        "curves": plots.training_curves(epochs(4), marked_epoch=3),
        "quantization": plots.quantization(quality(report), report["size_bytes"]),
        "bars": plots.grouped_bars({"a": {"x": 1.0, "y": 2.0}, "b": {"x": 3.0}}, "t", "s"),
    }
    for name, data in pictures.items():
        width, height = png_size(data)
        assert 300 <= width <= 2000 and 200 <= height <= 1500, name
        assert len(data) < 300_000, name  # commit-sized


def test_many_classes_still_render():
    labels = [f"c{i}" for i in range(40)]
    matrix = [[3 if i == j else 0 for j in range(40)] for i in range(40)]
    width, height = png_size(plots.confusion_matrix(matrix, labels))
    assert width <= 2000 and height <= 1500


def write_meta(folder: Path, history: list[dict]) -> None:
    folder.mkdir(parents=True)
    meta = {
        "config": {},
        "epoch": history[-1]["epoch"],
        "step": 10,
        "metrics": history[-1],
        "preprocessor": "{}",
        "history": history,
    }
    (folder / META).write_text(json.dumps(meta))


def test_curves_take_the_whole_run_from_the_newest_checkpoint(tmp_path):
    """The evaluated (best) checkpoint knows epochs 1-2; its run's newest one knows 1-4."""
    from app.train.checkpoint import CheckpointMeta

    run = tmp_path / "run"
    write_meta(run / "checkpoint_a", epochs(2))
    write_meta(run / "checkpoint_b", epochs(4))
    (run / "tensorboard").mkdir()
    best = str(run / "checkpoint_a")
    meta = CheckpointMeta.read(f"{best}/{META}")
    assert [m["epoch"] for m in run_history(best, meta)] == [1, 2, 3, 4]

    metrics = {
        "split": "val",
        "accuracy": 0.9,
        "rows": 13,
        "labels": ["cat", "dog"],
        "confusion_matrix": [[5, 1], [0, 7]],
    }
    uris = write_plots(best, meta, metrics)
    assert uris == {
        "confusion_matrix": f"{best}/{CONFUSION_PNG}",
        "training_curves": f"{best}/{CURVES_PNG}",
    }
    for uri in uris.values():
        png_size(Path(uri).read_bytes())


def test_a_checkpoint_without_history_gets_no_curves(tmp_path):
    from app.train.checkpoint import CheckpointMeta

    folder = tmp_path / "run" / "checkpoint_old"
    write_meta(folder, epochs(1))
    raw = json.loads((folder / META).read_text())
    del raw["history"]  # written before the history was recorded
    (folder / META).write_text(json.dumps(raw))
    meta = CheckpointMeta.read(str(folder / META))
    metrics = {
        "split": "val",
        "accuracy": 1.0,
        "rows": 2,
        "labels": ["a"],
        "confusion_matrix": [[2]],
    }
    assert set(write_plots(str(folder), meta, metrics)) == {"confusion_matrix"}
