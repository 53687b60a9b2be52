"""python -m jobs.index --config configs/retrieval.yaml --embeddings URI [section.key=value ...]

A vector index of a retrieval model's embeddings (jobs.predict's output on that model),
published as `<export.registry>/<model>/index/<version>` (app/tasks/index/build.py)."""

from app.cli import parser, run_job


def main(argv: list[str] | None = None) -> None:
    p = parser("index", "Build a versioned vector index from embeddings.")
    p.add_argument("--embeddings", required=True, help="a jobs.predict output of a retrieval model")
    args = p.parse_args(argv)
    from app.tasks.index.build import build_index

    run_job(args, lambda config: build_index(config, args.embeddings))


if __name__ == "__main__":
    main()
