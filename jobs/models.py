"""python -m jobs.models [--config C] [section.key=value ...] list | undeploy NAME [NAME ...] | prune --keep N [--force]

The registry's models and versions (with their gate reports and which version is live) and their
vector indexes, taking a model off Serve without touching the others, and deleting old versions
of models and indexes (never `latest` or the live one or any a running application pins, nor an
encoder a remaining index needs; without a cluster only with --force). Without
--config the defaults apply (registry outputs/registry)."""

from __future__ import annotations

import argparse
import sys

from app.cli import emit, one_line_failures, setup_logging
from app.config import load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.models", description=__doc__.splitlines()[2])
    p.add_argument("--config", help="workload YAML whose export.registry and serve.app_name to use")
    p.add_argument("--summary-file", help="also write the JSON summary to this file")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="models, versions, gate reports, latest and live version")
    undeploy = actions.add_parser("undeploy", help="take models off Serve (one config update)")
    undeploy.add_argument("names", nargs="+", metavar="name")
    prune = actions.add_parser("prune", help="delete old versions, keeping the newest N")
    prune.add_argument("--keep", type=int, required=True)
    prune.add_argument("--model", help="only this model (default: every model)")
    prune.add_argument(
        "--force",
        action="store_true",
        help="prune without a running cluster (nothing then tells which versions are served)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Overrides (section.key=value) may stand anywhere before or after the action.
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = build_parser().parse_args([a for a in argv if a not in overrides])
    setup_logging()
    from app.serve.control import lifecycle

    with one_line_failures():
        config = load_config(args.config, overrides)
        if args.action == "list":
            summary = lifecycle.list_models(config)
        elif args.action == "undeploy":
            summary = lifecycle.undeploy(config, args.names)
        else:
            summary = lifecycle.prune(config, args.keep, args.model, args.force)
        emit(summary, args.summary_file)


if __name__ == "__main__":
    main()
