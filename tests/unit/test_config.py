"""app/config/: YAML + typed dotted overrides; every bad key or value is one line naming the key."""

from __future__ import annotations

import os
import re

import pytest

from app.config import ROOT_ENV, Config, dump, load_config, validate
from app.errors import ConfigError
from jobs import prepare as prepare_job
from tests.conftest import REPO
from tests.unit.unit_helpers import DIGITS_YAML, run_main

pytestmark = pytest.mark.unit


def refused(*overrides: str, path=DIGITS_YAML) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


def test_digits_yaml_loads_with_its_values_and_defaults():
    config = load_config(DIGITS_YAML)
    assert config.workload == "digits"  # from the file name
    assert config.data.source == "digits"
    assert config.data.rows_per_shard == 500
    assert config.model.name == "cnn" and config.model.channels == [32, 64]
    assert config.train.epochs == 12 and config.train.batch_size == 32
    assert config.train.lr == pytest.approx(0.003)
    assert config.export.quantization == "static"
    assert config.serve.variant == "int8"
    # Keys the YAML leaves out keep their defaults (a relative path made absolute where loaded).
    assert config.train.storage_path == os.path.join(os.getcwd(), "outputs", "runs")
    assert config.serve.host == "127.0.0.1"


def test_overrides_are_typed():
    config = load_config(
        DIGITS_YAML,
        [
            "train.num_workers=4",
            "data.labels=[a,b]",
            "train.use_gpu=true",
            "train.lr=0.01",
            "data.feature_columns=[x1, x2]",
            "serve.autoscaling.max_replicas=5",
            "data.path=",
        ],
    )
    assert config.train.num_workers == 4 and type(config.train.num_workers) is int
    assert config.data.labels == ["a", "b"]
    assert config.train.use_gpu is True
    assert config.train.lr == pytest.approx(0.01)
    assert config.data.feature_columns == ["x1", "x2"]
    assert config.serve.autoscaling.max_replicas == 5
    assert config.data.path is None  # empty value -> null


def test_override_wins_over_yaml_and_leaves_siblings():
    config = load_config(DIGITS_YAML, ["train.epochs=3"])
    assert config.train.epochs == 3
    assert config.train.batch_size == 32  # sibling from the YAML untouched


def test_nested_override():
    config = load_config(
        DIGITS_YAML, ["data.stream.prefetch_blocks=7", "serve.generation.max_streams=3"]
    )
    assert (config.data.stream.prefetch_blocks, config.serve.generation.max_streams) == (7, 3)


def test_string_keys_keep_numeric_looking_values_as_strings():
    # Digits' label names are "0".."9": declaring them, or naming a run "2024", must work.
    config = load_config(DIGITS_YAML, ["train.run_name=2024", "data.labels=[0,1,2]"])
    assert config.train.run_name == "2024"
    assert config.data.labels == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.bogus=1", "data.bogus"),
        ("serve.autoscaling.bogus=1", "serve.autoscaling.bogus"),
        ("bogus=1", "bogus"),
    ],
)
def test_unknown_key_is_one_line_naming_it(override, key):
    message = refused(override)
    assert f"{key}:" in message
    assert "unknown key" in message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.precision=fp8", "train.precision"),
        ("train.num_workers=0", "train.num_workers"),
        ("train.num_workers=four", "train.num_workers"),
        ("data.source=mnist", "data.source"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("serve.port=70000", "serve.port"),
        ("model.channels=3", "model.channels"),
    ],
)
def test_bad_value_is_one_line_naming_the_key_and_value(override, key):
    message = refused(override)
    assert message.startswith(f"config error: {key}")
    assert override.split("=", 1)[1] in message  # the offending value is shown


def test_batch_larger_than_ongoing_requests_is_refused():
    message = refused("serve.batching.max_batch_size=32", "serve.max_ongoing_requests=16")
    assert "serve.batching.max_batch_size" in message and "serve.max_ongoing_requests" in message
    # Equal is fine.
    config = load_config(
        DIGITS_YAML, ["serve.batching.max_batch_size=16", "serve.max_ongoing_requests=16"]
    )
    assert config.serve.batching.max_batch_size == 16


@pytest.mark.parametrize("source", ["table", "imagefolder"])
def test_path_sources_need_data_path(source):
    assert "data.path" in refused(f"data.source={source}")
    config = load_config(DIGITS_YAML, [f"data.source={source}", "data.path=/somewhere"])
    assert config.data.path == "/somewhere"


def test_heads_must_divide_dim():
    message = refused("model.dim=30", "model.heads=4")
    assert "model.dim" in message and "model.heads" in message


def test_fractions_must_leave_training_rows():
    assert "val_fraction" in refused("data.val_fraction=0.5", "data.test_fraction=0.45")


@pytest.mark.parametrize("item", ["train.epochs", "=3", "train..epochs=3", ".epochs=3"])
def test_malformed_override_is_refused(item):
    assert item in refused(item)


def test_override_into_a_scalar_is_refused():
    assert "train.epochs" in refused("train.epochs.x=1")


@pytest.mark.parametrize(
    ("name", "text"),
    [("missing.yaml", None), ("list.yaml", "- a\n- b\n"), ("broken.yaml", "data: [unclosed\n")],
)
def test_config_file_errors_are_one_line_naming_the_file(tmp_path, name, text):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert str(path) in refused(path=path)


def test_relative_outputs_resolve_under_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    config = load_config(DIGITS_YAML)
    assert config.data_output == str(tmp_path / "outputs" / "data" / "digits")
    assert config.storage_path == str(tmp_path / "outputs" / "runs")
    assert config.registry == str(tmp_path / "outputs" / "registry")
    remote = load_config(DIGITS_YAML, ["export.registry=s3://bucket/reg"])
    assert remote.registry == "s3://bucket/reg"  # URIs with a scheme stay as they are


def test_paths_are_resolved_once_where_the_job_loads_its_config(monkeypatch, tmp_path):
    """A Tune trial or a Train worker runs in a working directory of its own and rebuilds the
    config from its dump: the paths it gets are the ones the job resolved, never its own."""
    monkeypatch.delenv(ROOT_ENV, raising=False)
    job = tmp_path / "checkout"
    job.mkdir()
    monkeypatch.chdir(job)
    overrides = ["data.path=tables/x.csv", "model.name=", "model.pretrained=models/m"]
    config = load_config(DIGITS_YAML, overrides)
    trial = tmp_path / "trial"
    trial.mkdir()
    monkeypatch.chdir(trial)
    again = validate(dump(config))
    assert again.data_output == str(job / "outputs" / "data" / "digits")
    assert again.storage_path == str(job / "outputs" / "runs")
    assert again.registry == str(job / "outputs" / "registry")
    assert again.data.path == str(job / "tables" / "x.csv")
    assert again.model.pretrained == str(job / "models" / "m")
    stdlib = load_config(DIGITS_YAML, ["data.source=text_files", "data.path={stdlib}/*.py"])
    assert stdlib.data.path == "{stdlib}/*.py"  # expanded by the source itself


def test_dump_round_trips():
    config = load_config(DIGITS_YAML, ["data.stream.prefetch_blocks=7", "data.labels=[a,b]"])
    again = validate(dump(config))
    assert isinstance(again, Config)
    assert again == config


def test_run_name_defaults_to_workload_time_and_a_random_suffix():
    config = load_config(DIGITS_YAML)
    names = {config.run_name() for _ in range(200)}  # all within the same second or two
    assert len(names) == 200  # two runs started together never share (and resume) a run
    for name in names:
        assert re.fullmatch(r"digits-\d{8}-\d{6}-[0-9a-f]{6}", name), name
    assert load_config(DIGITS_YAML, ["train.run_name=mine"]).run_name() == "mine"


# --- the job CLI: exit 2 with one stderr line, before any work ---------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [("data.bogus=1", "data.bogus"), ("train.precision=fp8", "train.precision")],
)
def test_job_cli_bad_override_exits_2_with_one_line(tmp_path, monkeypatch, capsys, override, key):
    env_root = tmp_path / "root"
    env_root.mkdir()
    monkeypatch.setenv(ROOT_ENV, str(env_root))
    argv = ["--config", str(DIGITS_YAML), override]
    code, out, err = run_main(capsys, prepare_job.main, argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert key in lines[0]
    assert out == ""
    assert list(env_root.iterdir()) == []  # no work started: nothing written


@pytest.mark.parametrize(
    "override", ["export.name=../elsewhere", "train.run_name=../../tmp/x", "workload=a/b"]
)
def test_names_that_become_folders_cannot_leave_their_root(config_factory, override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        config_factory(override)


def test_grouped_keys_take_overrides(config_factory):
    config = config_factory("serve.batching.max_batch_size=8", "data.stream.prefetch_blocks=2")
    assert config.serve.batching.max_batch_size == 8 and config.data.stream.prefetch_blocks == 2


def test_the_config_reference_lists_every_key_as_the_code_declares_it():
    """docs/config.md is written from app/config/ (`python -m tools.config_reference`): a key
    added, removed or re-commented without regenerating it fails here."""
    from tools.config_reference import all_keys, render

    reference = (REPO / "docs" / "config.md").read_text()
    assert reference == render(), "regenerate: python -m tools.config_reference > docs/config.md"
    assert all(f"| `{key}` |" in reference for key in all_keys())
    assert "docs/config.md" in (REPO / "README.md").read_text()


def test_a_clip_folder_and_a_tower_folder_together_are_refused_naming_the_tower():
    with pytest.raises(ConfigError, match=r"model\.pretrained_image: leave it out with model"):
        load_config(None, ["model.pretrained=/clip", "model.pretrained_image=/vit"])


def test_a_tower_folder_on_a_dataset_of_another_kind_is_refused(tmp_path):
    from app.data.kinds.image import Image
    from app.models.families import tower_bases
    from tools.make_tiny_pretrained import make_vit

    config = load_config(None, [f"model.pretrained_image={make_vit(str(tmp_path / 'vit'))}"])
    with pytest.raises(ConfigError, match=r"model\.pretrained_image: a dual encoder's tower"):
        tower_bases(config.model, Image)
    text, image = tower_bases(config.model)  # one tower alone: the other from scratch
    assert text is None and image is not None and image.model_type == "vit"
