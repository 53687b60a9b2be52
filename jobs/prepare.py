"""python -m jobs.prepare --config configs/digits.yaml [section.key=value ...]"""

from app.cli import parser, run_job
from app.pipeline.stages import prepare


def main(argv: list[str] | None = None) -> None:
    p = parser("prepare", "Turn a data source into Parquet shards plus a manifest.")
    run_job(p.parse_args(argv), prepare)


if __name__ == "__main__":
    main()
