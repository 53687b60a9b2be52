"""The README's commands as a user runs them (tests/readme_commands.py): the digits chain in
`make test`, the rest in `make test-all`."""

from __future__ import annotations

import json

import pytest
import requests

from tests.conftest import REPO
from tests.e2e.conftest import (
    API_KEY_HEADER,
    SERVE,
    get_json,
    live_models,
    run_command,
    undeploy,
)
from tests.readme_commands import LATER, SEEDED, fill

pytestmark = pytest.mark.e2e


def test_the_readme_chain_runs_as_shown_with_its_default_paths(readme_chain):
    root = readme_chain["root"]
    assert readme_chain["prepare"]["output"].startswith(str(root / "outputs" / "data"))
    assert readme_chain["train"]["checkpoint"].startswith(str(root / "outputs" / "runs"))
    assert readme_chain["evaluate"]["metrics"]["accuracy"] >= 0.9
    artifact = readme_chain["export"]["artifact"]
    assert artifact.startswith(str(root / "outputs" / "registry" / "digits"))
    assert readme_chain["predict"]["rows"] > 0 and readme_chain["predict"]["rejected"] == 0
    trials = readme_chain["tune"]["trials"]
    assert len(trials) == 2 and all(t["error"] is None and t["best_value"] for t in trials)
    assert readme_chain["deploy"]["url"] == SERVE
    [digits] = [m for m in readme_chain["models"]["models"] if m["name"] == "digits"]
    assert digits["live"] == artifact.rstrip("/").split("/")[-1]
    assert get_json("/v2/models/digits", headers=API_KEY_HEADER)["name"] == "digits"


def test_prepare_and_predict_tasks_return_records_ray_data_keeps_without_a_warning(readme_chain):
    """Their tasks' records are plain columns: Ray Data stores them in Arrow, with no
    conversion fallback printed from each task."""
    for stage in ("prepare", "predict"):
        err = readme_chain["stderr"][stage]
        noise = [line for line in err.splitlines() if "Failed to convert column" in line]
        assert not noise and "ArrowConversionError" not in err, (stage, noise[:2])


@pytest.fixture(scope="module")
def chain_alone(readme_chain) -> dict:
    """The README chain's state, with every model but the chain's own taken off the cluster:
    the commands below train on two of its four CPUs, which the replicas the other modules
    left deployed (a share of a CPU each) would otherwise hold (`make test-all`)."""
    undeploy([name for name in live_models() if name != "digits"], readme_chain["root"])
    return readme_chain


@pytest.mark.slow
@pytest.mark.parametrize("command", list(LATER))
def test_the_other_readme_commands_run_as_shown(command, chain_alone):
    """The commands `make test` leaves out, from the same checkout after the chain, each with
    the budget it maps to; `ray job submit` submits that checkout as its working dir."""
    root = chain_alone["root"]
    argv = fill(command, chain_alone) + LATER[command]
    if argv[0] == "ray":  # the job's summary comes back as a file: its stdout is ray's
        summary_file = root / "submitted.json"
        argv = [str(REPO / ".venv/bin/ray"), *argv[1:], "--summary-file", str(summary_file)]
        run_command(argv, root, timeout=900, summary=False)
        summary = json.loads(summary_file.read_text())
    else:
        summary = run_command(argv, root, timeout=900)
    if "undeploy" in command:
        assert summary["undeployed"] == ["digits"]
        assert (
            requests.get(
                f"{SERVE}/v2/models/digits", headers=API_KEY_HEADER, timeout=10
            ).status_code
            == 404
        )
    elif "prune" in command:
        assert summary["stage"] == "models"
    elif "pipeline" in command:
        assert summary["url"] == SERVE and summary["stages"]["export"]["artifact"]
    if "export.formats" in command:  # every program verified, and `auto` served
        report = summary["stages"]["export"]["report"]
        assert all(p["published"] for p in report["programs"].values()), report["programs"]
        served = get_json("/v2/models/tabular")["parameters"]["variant"]
        assert served == report["serving"]["auto"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, seed", [(c, seed) for c, seeds in SEEDED.items() for seed in seeds]
)
def test_the_retrieval_pipeline_reaches_its_bar_for_every_seed(command, seed, chain_alone):
    """configs/retrieval.yaml as shown, from the README chain's checkout: prepared, trained,
    evaluated, exported, indexed and deployed; R@5 >= 50 both ways on its val split, and the
    deployed search finds a val caption's picture."""
    root = chain_alone["root"]
    argv = fill(command, chain_alone) + [f"train.seed={seed}", f"export.name=retrieval-s{seed}"]
    summary = run_command(argv, root, timeout=1500)
    try:
        metrics = summary["stages"]["evaluate"]["metrics"]
        assert metrics["i2t_r5"] >= 50 and metrics["t2i_r5"] >= 50, metrics
        sample = summary["sample_request"]
        assert sample["picture"] in sample["hits"], sample
    finally:
        # Its model and index hold a CPU of the cluster's four, which the next seed trains on.
        undeploy([f"retrieval-s{seed}", f"retrieval-s{seed}-index"], root)
