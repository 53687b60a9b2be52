"""python -m jobs.tune --config configs/digits.yaml [section.key=value ...]

A hyperparameter search over the config's `tune:` space (Ray Tune, ASHA early stopping); the
summary names the best trial's overrides and checkpoint (`jobs.export --checkpoint` takes it)."""

from app.cli import parser, run_job
from app.train.tuning import tune


def main(argv: list[str] | None = None) -> None:
    p = parser("tune", "Search hyperparameters; each trial is a full training run.")
    run_job(p.parse_args(argv), tune)


if __name__ == "__main__":
    main()
