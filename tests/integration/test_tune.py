"""jobs.tune's search on the real local Ray: trials are whole training runs, ASHA stops trials
that trail, and the best checkpoint is an ordinary one that export takes as is."""

from __future__ import annotations

import pytest

from app import storage
from app.train import checkpoint
from tests.integration.conftest import workload_config
from tests.s3_server import free_port

pytestmark = pytest.mark.integration
OWN_RAY = True  # starts its own Ray (tests/integration/conftest.py: _private_ray_only)


def start_ray_with_dashboard(num_cpus: int) -> None:
    """A private Ray with its dashboard (on a free port), as every real cluster has: a trial that
    ASHA stops is killed with its Train run, whose placement group Ray Train's cleaner then
    removes, and the cleaner asks the dashboard's state API whether the run's controller died."""
    import ray

    ray.shutdown()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=True,
        dashboard_port=free_port(),
        log_to_driver=False,
    )


@pytest.fixture
def ray_one_trial_wide():
    """Room for exactly one trial: its two workers at 0.5 CPU each. A placement group left behind
    by a stopped trial leaves the next one nothing."""
    start_ray_with_dashboard(num_cpus=1)
    yield
    import ray

    ray.shutdown()


# Slow (make test-all): the README chain runs jobs.tune (2 trials) in make test.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_search_names_a_best_checkpoint_and_stopped_trials_free_a_one_trial_cluster(
    prepared, workspace, ray_one_trial_wide
):
    """The digits tune section (4 trials, ASHA) on a cluster that fits one trial: every trial
    ASHA stops must give its workers' CPUs back, or the next trial never starts; the search
    names the best trial's checkpoint, an ordinary one that jobs.export reads."""
    from app.train.tuning import tune

    prepared("digits")
    config = workload_config(
        workspace,
        "digits",
        "train.epochs=4",
        "train.log_every_steps=1000",
        "train.run_name=digits-narrow",
        "tune.grace_period=1",
    )
    summary = tune(config)

    trials = summary["trials"]
    assert len(trials) == 4
    assert [t["error"] for t in trials] == [None] * 4
    assert all(t["best_value"] is not None for t in trials)
    # The case this guards: at least one trial was stopped early and later ones still ran.
    assert any(t["stopped_early"] for t in trials[:-1]), [t["epochs"] for t in trials]
    assert summary["metric"] == "val_accuracy"
    lrs = [t["overrides"]["train.lr"] for t in trials]
    assert len(set(lrs)) == 4 and all(0.0005 <= lr <= 0.01 for lr in lrs)
    assert all(1 <= t["epochs"] <= 4 for t in trials)
    best = summary["best"]
    assert best["value"] == max(t["best_value"] for t in trials)
    assert best["value"] > 0.8  # up to four epochs of the CNN on digits
    meta = checkpoint.read_meta(best["checkpoint"])
    assert best["run_name"].startswith("digits-narrow-")
    assert storage.exists(storage.join(best["checkpoint"], "model.safetensors"))
    assert meta.metrics["val_accuracy"] == pytest.approx(best["value"])
