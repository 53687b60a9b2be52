"""python -m jobs.evaluate --config configs/digits.yaml --checkpoint URI"""

from app.cli import parser, run_job
from app.evaluate.held_out import evaluate


def main(argv: list[str] | None = None) -> None:
    p = parser("evaluate", "Score a checkpoint on the held-out split.")
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint URI (the train summary's 'checkpoint')"
    )
    args = p.parse_args(argv)
    run_job(args, lambda config: evaluate(config, args.checkpoint))


if __name__ == "__main__":
    main()
