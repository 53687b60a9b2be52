"""python -m jobs.export --config configs/digits.yaml --checkpoint URI
python -m jobs.export --verify ARTIFACT_URI      (integrity check alone: exit 0 intact, 1 if not)"""

import sys

from app.cli import emit, one_line_failures, parser, run_job, setup_logging


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--verify" in argv:
        verify_only(argv)
        return
    p = parser("export", "Export a checkpoint to a verified ONNX fp32 + int8 artifact.")
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint URI (the train summary's 'checkpoint')"
    )
    args = p.parse_args(argv)
    from app.export.exporter import export

    run_job(args, lambda config: export(config, args.checkpoint))


def verify_only(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m jobs.export --verify")
    p.add_argument("--verify", required=True, metavar="URI")
    p.add_argument("--summary-file")
    args = p.parse_args(argv)
    setup_logging()
    from app.runtime.artifact import verify

    with one_line_failures():  # an altered or missing file: one line naming it, exit 1
        emit(verify(args.verify), args.summary_file)


if __name__ == "__main__":
    main()
