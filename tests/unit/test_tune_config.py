"""The `tune:` section and how a trial's values become its config (no Ray)."""

from __future__ import annotations

import pytest

from app.config import ConfigError, dump, load_config
from app.train.tuning import require_tune, sample_corner, trial_config
from tests.conftest import DIGITS_YAML

pytestmark = pytest.mark.unit


def test_digits_carries_a_four_trial_search():
    spec = require_tune(load_config(DIGITS_YAML))
    assert spec.num_trials == 4 and spec.mode == "max"
    assert spec.space["train.lr"].loguniform == (0.0005, 0.01)


def test_a_trial_is_the_base_config_with_its_values_and_own_run_name():
    base = dump(load_config(DIGITS_YAML))
    config = trial_config(base, {"train.lr": 0.002, "model.dropout": 0.2}, "search-abc")
    assert config.train.lr == 0.002 and config.model.dropout == 0.2
    assert config.train.run_name == "search-abc" and config.tune is None
    assert config.train.epochs == 12  # everything else is the base's


def test_a_space_that_makes_a_bad_config_is_refused_naming_the_key():
    base = dump(load_config(DIGITS_YAML))
    with pytest.raises(ConfigError, match="tune.space gives a bad config.*train.lr"):
        trial_config(base, {"train.lr": -1.0}, "x")


@pytest.mark.parametrize(
    "space, fragment",
    [
        ({"train.lr": {}}, "exactly one of"),
        ({"train.lr": {"uniform": [2, 1]}}, "low must be below high"),
        ({"train.lr": {"loguniform": [0, 1]}}, "positive"),
        ({"lr": {"choice": [1]}}, "dotted config key"),
        ({"data.seed": {"choice": [1, 2]}}, "cannot vary"),
    ],
)
def test_bad_spaces_are_config_errors(tmp_path, space, fragment):
    import yaml

    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"tune": {"space": space}}))
    with pytest.raises(ConfigError, match=fragment):
        load_config(path)


def test_corner_samples_cover_bounds_and_choices():
    spec = require_tune(load_config(DIGITS_YAML))
    assert sample_corner(spec, 0) == {"train.lr": 0.0005, "model.dropout": 0.0}
    assert sample_corner(spec, 1) == {"train.lr": 0.01, "model.dropout": 0.1}


def test_no_tune_section_is_a_config_error():
    with pytest.raises(ConfigError, match="no `tune:` section"):
        require_tune(load_config(DIGITS_YAML, ["workload=x"]).model_copy(update={"tune": None}))
