"""Every failure a user can act on ends a job with one line and its documented exit code
(README, "The jobs": 1 bad input or a failed run, 2 bad config or no cluster, 3 export gate).

In-process: the jobs' own `main` (or `run_job`), SystemExit and stderr via capsys."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from PIL import Image

from app.cli import run_job
from app.data.prepare import MANIFEST
from app.errors import ConfigError, GateError, NoClusterError, UserError
from jobs import prepare as prepare_job
from jobs import train as train_job
from tests.unit.unit_helpers import DIGITS_YAML

pytestmark = pytest.mark.unit


def fails(capsys, main, *argv: str) -> tuple[int, str]:
    """Run a job's main; its exit code and the last stderr line (the one the user reads)."""
    with pytest.raises(SystemExit) as info:
        main(["--config", str(DIGITS_YAML), *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return info.value.code, err.strip().splitlines()[-1]


def args(tmp_path: Path, summary_file: str | None = None) -> argparse.Namespace:
    overrides = [f"data.output={tmp_path / 'data'}"]
    return argparse.Namespace(
        config=str(DIGITS_YAML), overrides=overrides, summary_file=summary_file
    )


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (UserError("data.csv: missing column 'a'"), 1, "error: data.csv: missing column 'a'"),
        (ConfigError("config error: train.lr: bad"), 2, "config error: train.lr: bad"),
        (NoClusterError("no running Ray cluster found"), 2, "error: no running Ray cluster"),
        (GateError("export refused: int8 ...", {}), 3, "error: export refused"),
        (PermissionError(13, "Permission denied", "/srv/out"), 1, "error: /srv/out: Permission"),
        (
            OSError(28, "No space left on device", "/d/x", None, "/d/y"),
            1,
            "error: /d/x -> /d/y: No",
        ),
    ],
)
def test_each_failure_has_its_exit_code_and_one_line(capsys, tmp_path, error, code, line):
    def body(config):
        raise error

    with pytest.raises(SystemExit) as info:
        run_job(args(tmp_path), body)
    err = capsys.readouterr().err
    assert info.value.code == code
    assert err.strip().splitlines() == [err.strip()] and err.startswith(line), err


def test_output_under_a_file_is_one_line_naming_the_path(capsys, tmp_path):
    # Tests run as root, where a read-only folder does not stop writes: a path whose parent is a
    # regular file fails for everyone (NotADirectoryError / FileExistsError, both OSError).
    (tmp_path / "afile").write_text("not a folder")
    code, line = fails(capsys, prepare_job.main, f"data.output={tmp_path / 'afile' / 'sub'}")
    assert code == 1
    assert line.startswith("error: ") and str(tmp_path / "afile") in line, line


def test_summary_file_that_cannot_be_written_is_one_line(capsys, tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    summary_file = str(tmp_path / "afile" / "summary.json")
    with pytest.raises(SystemExit) as info:
        run_job(args(tmp_path, summary_file), lambda config: {"stage": "test"})
    assert info.value.code == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: ") and str(tmp_path / "afile") in line, line


def test_decompression_bomb_in_an_image_folder_names_the_file(capsys, tmp_path, monkeypatch):
    # Pillow refuses images over 2 x MAX_IMAGE_PIXELS with DecompressionBombError, which is not
    # an OSError; a small limit stands in for a real bomb.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "images" / label / "small.png")
    bomb = tmp_path / "images" / "dog" / "zbomb.png"
    Image.new("RGB", (64, 64)).save(bomb)
    code, line = fails(
        capsys,
        prepare_job.main,
        "data.source=imagefolder",
        f"data.path={tmp_path / 'images'}",
        f"data.output={tmp_path / 'data'}",
    )
    assert code == 1
    assert line.startswith(f"error: {bomb}: unreadable image (DecompressionBombError"), line


def test_manifest_of_the_wrong_shape_stops_training_with_one_line(capsys, tmp_path):
    output = tmp_path / "data"
    output.mkdir()
    (output / MANIFEST).write_text(json.dumps({"kind": "image", "rows": {"train": "many"}}))
    code, line = fails(
        capsys,
        train_job.main,
        f"data.output={output}",
        f"train.storage_path={tmp_path / 'runs'}",
    )
    assert code == 1
    assert line.startswith(f"error: {output / MANIFEST}: "), line


def test_a_ray_address_that_does_not_answer_fails_in_seconds_naming_it(monkeypatch):
    """A cluster that is gone: Ray itself retries the GCS for minutes, printing only its own
    warnings. The job says in one line which address did not answer, and exits 2."""
    import socket
    import time

    from app.errors import NoClusterError
    from app.ray_runtime import connect_ray

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(NoClusterError) as failed:
        connect_ray()
    assert time.monotonic() - start < 5
    message = str(failed.value)
    assert f"RAY_ADDRESS=127.0.0.1:{port}: nothing answers there" in message
    assert "unset RAY_ADDRESS" in message and "\n" not in message
    assert failed.value.exit_code == 2
