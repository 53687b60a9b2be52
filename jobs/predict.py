"""python -m jobs.predict --artifact URI --input URI --output URI [--id-column id] [--overwrite]
[--config C] [section.key=value ...]

Offline batch inference (app/predict/). Exit codes: 0 ok; 1 bad input (a missing column, an
unreadable file, malformed rows with predict.on_bad_rows=fail) or an artifact that fails its
integrity check; 2 bad config."""

from app.cli import JobParser, run_job


def main(argv: list[str] | None = None) -> None:
    p = JobParser(
        prog="python -m jobs.predict",
        description="Score a Parquet, CSV or JSONL input with an exported artifact.",
    )
    p.add_argument("--artifact", required=True, help="<registry>/<name>/<version> or .../latest")
    p.add_argument("--input", required=True, help="a .parquet/.csv/.jsonl file or a folder")
    p.add_argument("--output", required=True, help="folder for the predictions and manifest")
    p.add_argument("--id-column", default="id", help="input column copied to the output")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the predictions already in --output"
    )
    p.add_argument("--config", help="workload YAML for the predict: and serve: sections")
    p.add_argument("--summary-file", help="also write the JSON summary to this file")
    p.add_argument("overrides", nargs="*", help="dotted overrides: predict.key=value")
    args = p.parse_args(argv)
    from app.predict.driver import predict

    run_job(
        args,
        lambda config: predict(
            config, args.artifact, args.input, args.output, args.id_column, args.overwrite
        ),
    )


if __name__ == "__main__":
    main()
