"""A language model's batch inference without Ray or a model: which columns it reads, and each
row's sampling read and checked as the completions endpoint reads a body."""

from __future__ import annotations

import pytest

from app.config import ServeConfig, load_config
from app.errors import UserError
from app.predict.actor import PredictInput
from app.runtime.types import RequestError
from app.tasks.lm.predict import CompletionPredictor, Settings, sampling_params

pytestmark = pytest.mark.unit
SCHEMA = {"kind": "tokens", "task": "lm"}


def config(*overrides: str):
    return load_config(None, ["data.source=synthetic_text", *overrides])


def test_a_rows_own_sampling_columns_override_the_configs_and_null_keeps_it():
    settings = Settings.of(config("predict.generation.sampling={max_tokens: 9, temperature: 0}"))
    serve = ServeConfig()
    greedy = sampling_params({"temperature": None, "seed": None}, settings, serve)
    assert (greedy.max_tokens, greedy.temperature, greedy.seed) == (9, 0.0, None)
    seeded = sampling_params({"temperature": 1.0, "seed": 7, "stop": ["\n"]}, settings, serve)
    assert (seeded.temperature, seeded.seed, seeded.stop) == (1.0, 7, ("\n",))
    for values, field in [
        ({"temperature": 3.0}, "temperature"),
        ({"max_tokens": 10**6}, "max_tokens"),  # beyond serve.generation.max_tokens
        ({"temperature": "hot"}, "temperature"),  # strict: no string for a number
        ({"stop": [""]}, "stop"),
    ]:
        with pytest.raises(RequestError) as refused:
            sampling_params(values, settings, serve)
        assert refused.value.message.startswith(f"{field}:"), refused.value.message


def spec_of(id_column: str, fmt, present: list[str], cfg=None):
    request = PredictInput(SCHEMA, id_column, fmt, present, cfg or config(), "in")
    return CompletionPredictor.input_spec(request)


def test_the_columns_read_follow_the_input_and_bad_defaults_fail_up_front():
    spec = spec_of("id", "parquet", ["id", "prompt", "seed"])
    assert (spec.feature_columns, spec.options) == (("prompt",), ("seed",))
    chat = spec_of("id", "parquet", ["id", "messages"])
    assert chat.feature_columns == ("messages",)
    lines = spec_of("id", "jsonl", [])
    assert lines.feature_columns == ("prompt", "messages") and "temperature" in lines.options
    csv = spec_of("id", "csv", ["id", "prompt", "seed"])
    assert csv.options == ()  # CSV values are text: sampling comes from the config alone
    with pytest.raises(UserError, match=r"^predict\.generation\.sampling\.temperature: "):
        spec_of(
            "id",
            "parquet",
            ["id", "prompt"],
            config("predict.generation.sampling={temperature: 9}"),
        )
    with pytest.raises(UserError, match="--id-column 'prompt'"):
        spec_of("prompt", "parquet", ["prompt"])
