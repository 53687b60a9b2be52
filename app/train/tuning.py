"""Tune: a hyperparameter search over the same training run, with Ray Tune and ASHA.

Each trial is one ordinary training run (app.train.driver.train: the same TorchTrainer, data path,
checkpoints and summary) with the trial's values applied as config overrides and its own run
name, `<search name>-<trial id>`, under `train.storage_path`. The Tune trial itself only drives
that run (Ray's pattern for Train inside Tune), so it asks for no CPU; Tune's reporter callback
forwards each epoch's report, and ASHA stops trials that trail after `tune.grace_period` epochs.

The summary names the best trial's overrides and its best checkpoint, which `jobs.export` takes
as is.
"""

from __future__ import annotations

import copy
import logging
import math
from datetime import datetime
from typing import Any

from app.config import Config, SearchDimension, TuneSection, dump, validate
from app.data.prepare import read_manifest
from app.errors import ConfigError, UserError
from app.registry import check_metric, run_task

log = logging.getLogger(__name__)
CHECKPOINT_KEY = "checkpoint_path"  # where ray.tune.integration.ray_train puts it


def tune(config: Config) -> dict[str, Any]:
    import ray.tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from app.ray_runtime import connect_ray

    spec = require_tune(config)
    name = config.train.run_name or f"{config.workload}-tune-{datetime.now():%Y%m%d-%H%M%S}"
    base = search_base(config, spec)
    task = run_task(config.train.task, read_manifest(config.data_output).kind)
    for i in range(spec.num_trials):  # every sample must make a valid config: fail before Ray
        check_metric(trial_config(base, sample_corner(spec, i), f"{name}-check"), task)
    connect_ray()
    tuner = ray.tune.Tuner(
        # The trial only drives a Train run whose workers hold the resources. No CPU: even a
        # sliver would leave Ray Data's file listing (one whole CPU) unschedulable beside the
        # workers on a small cluster. Tune refuses an empty request, hence one byte of memory.
        ray.tune.with_resources(
            ray.tune.with_parameters(run_trial, base=base, search=name),
            {"cpu": 0, "memory": 1},
        ),
        param_space={key: dimension(d) for key, d in spec.space.items()},
        tune_config=ray.tune.TuneConfig(
            metric=spec.metric,
            mode=spec.mode,
            num_samples=spec.num_trials,
            # The limit goes on the generator: TuneConfig's max_concurrent_trials is ignored
            # (with a warning) once a BasicVariantGenerator is given, and two Train runs at
            # once on a small cluster wait on each other's CPUs.
            search_alg=BasicVariantGenerator(
                random_state=spec.seed, max_concurrent=spec.max_concurrent_trials
            ),
            scheduler=ASHAScheduler(
                time_attr="training_iteration",
                max_t=config.train.epochs,
                grace_period=min(spec.grace_period, config.train.epochs),
                reduction_factor=spec.reduction_factor,
                # A trial that reaches the last epoch ends by itself (its run returns and
                # releases its workers) instead of being stopped there by the scheduler.
                stop_last_trials=False,
            ),
        ),
        # Tune's own tables are off (verbose=0): one line per finished trial instead.
        run_config=ray.tune.RunConfig(
            name=name,
            storage_path=config.storage_path,
            verbose=0,
            callbacks=[trial_log(spec)],
        ),
    )
    log.info("tune: %s, %d trials of %s", name, spec.num_trials, sorted(spec.space))
    grid = tuner.fit()
    return summarize(config, spec, name, grid)


def search_base(config: Config, spec: TuneSection) -> dict[str, Any]:
    """The config every trial starts from. Each run keeps its checkpoints ranked by the searched
    metric, so the best epoch Tune saw is one the run kept (train.keep_checkpoints deletes the
    others), and the metric must be one the task reports."""
    base = dump(config)
    base["train"]["checkpoint_metric"] = spec.metric
    base["train"]["checkpoint_mode"] = spec.mode
    return base


def trial_log(spec: TuneSection):
    """A Tune callback writing one log line per finished trial (its values, best metric, epochs).
    Built here because `ray.tune` is imported only when a search runs."""
    from ray.tune import Callback

    class TrialLog(Callback):
        def __init__(self) -> None:
            self.done = 0

        def on_trial_complete(self, iteration, trials, trial, **info) -> None:
            self.done += 1
            result = trial.last_result or {}
            values = ", ".join(f"{k}={_short(v)}" for k, v in (trial.config or {}).items())
            log.info(
                "tune: trial %d/%d (%s): %s %s after %s epochs",
                self.done,
                spec.num_trials,
                values,
                spec.metric,
                _short(result.get(spec.metric)),
                result.get("training_iteration", "?"),
            )

    return TrialLog()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def require_tune(config: Config) -> TuneSection:
    if config.tune is None:
        raise ConfigError(
            "tune: this config has no `tune:` section (the search space, e.g. "
            "`tune: {space: {train.lr: {loguniform: [0.0005, 0.01]}}}`)"
        )
    return config.tune


def dimension(d: SearchDimension):
    import ray.tune

    if d.choice is not None:
        return ray.tune.choice(d.choice)
    if d.uniform is not None:
        return ray.tune.uniform(*d.uniform)
    assert d.loguniform is not None
    return ray.tune.loguniform(*d.loguniform)


def sample_corner(spec: TuneSection, i: int) -> dict[str, Any]:
    """A deterministic sample (bounds and choices in turn) used to validate the space up front."""
    sample = {}
    for key, d in spec.space.items():
        if d.choice is not None:
            sample[key] = d.choice[i % len(d.choice)]
        else:
            bounds = d.uniform or d.loguniform
            assert bounds is not None
            sample[key] = bounds[i % 2]
    return sample


def trial_config(base: dict[str, Any], overrides: dict[str, Any], run_name: str) -> Config:
    """The base config with the trial's values put at their dotted keys and its own run name."""
    raw = copy.deepcopy(base)
    raw.pop("tune", None)
    for key, value in overrides.items():
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    raw.setdefault("train", {})["run_name"] = run_name
    try:
        return validate(raw)
    except ConfigError as e:
        raise ConfigError(f"tune.space gives a bad config: {e}") from None


def run_trial(params: dict[str, Any], base: dict[str, Any], search: str) -> None:
    """One trial: a whole training run; its epochs reach Tune through the reporter callback."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from app.train.driver import train

    config = trial_config(base, params, f"{search}-{ray.tune.get_context().get_trial_id()}")
    train(config, callbacks=[TuneReportCallback()], job_outlives_run=True)


def summarize(config: Config, spec: TuneSection, name: str, grid) -> dict[str, Any]:
    from app.train.driver import checkpoint_uri

    trials = [trial_entry(config, spec, result) for result in grid]
    finished = [t for t in trials if t["best_value"] is not None]
    if not finished:
        errors = [t["error"] for t in trials if t.get("error")]
        raise UserError(
            f"tune {name}: no trial reported {spec.metric}: {errors[:1] or 'no trials'}"
        )
    best = (max if spec.mode == "max" else min)(finished, key=lambda t: t["best_value"])
    return {
        "stage": "tune",
        "name": name,
        "metric": spec.metric,
        "mode": spec.mode,
        "best": {
            "overrides": best["overrides"],
            "value": best["best_value"],
            "run_name": best["run_name"],
            "checkpoint": checkpoint_uri(config, best["checkpoint"])
            if best["checkpoint"]
            else None,
        },
        "trials": trials,
        "storage": f"{config.storage_path}/{name}",
    }


def trial_entry(config: Config, spec: TuneSection, result) -> dict[str, Any]:
    """A trial's overrides, epochs run, and its best epoch's value and checkpoint."""
    history = result.metrics_dataframe
    entry: dict[str, Any] = {
        "overrides": {k: v for k, v in (result.config or {}).items()},
        "epochs": 0 if history is None else len(history),
        "best_value": None,
        "checkpoint": None,
        "run_name": None,
        "error": str(result.error).splitlines()[0][:300] if result.error else None,
    }
    if history is None or spec.metric not in history or not len(history):
        return entry
    rows = history.dropna(subset=[spec.metric])
    rows = rows[[not _missing(p) for p in rows.get(CHECKPOINT_KEY, [None] * len(rows))]]
    if not len(rows):
        return entry
    row = rows.loc[rows[spec.metric].idxmax() if spec.mode == "max" else rows[spec.metric].idxmin()]
    entry["best_value"] = float(row[spec.metric])
    entry["checkpoint"] = str(row[CHECKPOINT_KEY])
    entry["run_name"] = f"{entry['checkpoint'].rstrip('/').split('/')[-2]}"
    entry["stopped_early"] = entry["epochs"] < config.train.epochs
    return entry


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
