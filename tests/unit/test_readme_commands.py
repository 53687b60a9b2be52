"""Every command the README shows is run by a test, or skipped with a reason
(tests/readme_commands.py), and the placeholders fill from the summaries before them."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO
from tests.readme_commands import (
    CHAIN,
    LATER,
    PRETRAINED,
    SEEDED,
    SHIPPED,
    SKIPPED,
    fill,
    readme_commands,
)

pytestmark = pytest.mark.unit


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    commands = readme_commands()
    known = [*CHAIN, *PRETRAINED.values(), *LATER, *SEEDED, *SHIPPED, *SKIPPED]
    assert [c for c in commands if c not in known] == [], "a README command no test runs"
    assert [c for c in known if c not in commands] == [], "listed, but gone from the README"
    assert all(reason.strip() for reason in SKIPPED.values())
    for command, test in SHIPPED.items():  # its test runs the README's command itself
        assert "SHIPPED" in (REPO / test).read_text(), (command, test)


def test_commands_are_read_across_continuation_lines_without_comments():
    text = "```bash\nray job submit --address A \\\n    -- python -m jobs.x  # note\nls\n```\n"
    assert readme_commands(text) == ["ray job submit --address A -- python -m jobs.x"]


def test_placeholders_fill_from_the_summaries_before_them():
    state = {
        "train": {"checkpoint": "/r/run/checkpoint_3"},
        "export": {"artifact": "/reg/digits/2"},
        "input": "/in.parquet",
        "output": "/out",
    }
    predict = next(c for c in CHAIN if "jobs.predict" in c)
    assert fill(predict, state) == [
        sys.executable,
        *[
            "-m",
            "jobs.predict",
            "--artifact",
            "/reg/digits/2",
            "--input",
            "/in.parquet",
            "--output",
            "/out",
        ],
    ]
    assert fill(CHAIN[1], state)[-1] == "train.epochs=4"  # the budget of make test
    undeploy = next(c for c in LATER if "undeploy" in c)
    assert fill(undeploy, state)[-1] == "digits"  # NAME: the exported model's
    # An optional part is a bracketed word of its own; a list inside a word is a value.
    [programs] = [c for c in LATER if "export.formats" in c]
    assert "export.formats=[onnx,aoti,executorch]" in fill(programs, state)
