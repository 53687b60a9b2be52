"""python -m jobs.train --config configs/digits.yaml [section.key=value ...]"""

from app.cli import parser, run_job
from app.train.driver import train


def main(argv: list[str] | None = None) -> None:
    args = parser("train", "Train data-parallel on Ray with TorchTrainer.").parse_args(argv)
    run_job(args, train)


if __name__ == "__main__":
    main()
