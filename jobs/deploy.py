"""python -m jobs.deploy --config configs/digits.yaml --artifact URI

Needs a running cluster (make cluster-up); without one it exits 2 and says how to start one."""

from app.cli import parser, run_job
from app.serve.control.deploy import deploy


def main(argv: list[str] | None = None) -> None:
    p = parser("deploy", "Deploy (or update, or roll back) a model in the Serve application.")
    p.add_argument(
        "--artifact",
        required=True,
        help="artifact URI: a version folder or <registry>/<name>/latest",
    )
    args = p.parse_args(argv)
    run_job(args, lambda config: deploy(config, args.artifact))


if __name__ == "__main__":
    main()
