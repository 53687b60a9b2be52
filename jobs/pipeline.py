"""python -m jobs.pipeline --config configs/digits.yaml [section.key=value ...]

All stages, then one sample request. Needs a running cluster for the deploy stage."""

from app.cli import parser, run_job
from app.pipeline.stages import pipeline


def main(argv: list[str] | None = None) -> None:
    args = parser(
        "pipeline", "Prepare, train, evaluate, export and deploy, then send one request."
    ).parse_args(argv)
    run_job(args, pipeline)


if __name__ == "__main__":
    main()
