"""What every job entry point shares: arguments, exit codes, the summary line.

Exit codes: 0 ok, 1 bad input or a failed run, 2 bad config/usage or no cluster, 3 the export gate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from app.config import Config, load_config
from app.errors import ConfigError, UserError
from app.ray_runtime import disconnect_ray


class JobParser(argparse.ArgumentParser):
    """A job's arguments, with `section.key=value` overrides anywhere on the command line,
    before or after options (argparse's intermixed parsing)."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        return self.parse_intermixed_args(args, namespace)


def parser(stage: str, description: str) -> argparse.ArgumentParser:
    p = JobParser(prog=f"python -m jobs.{stage}", description=description)
    p.add_argument("--config", required=True, help="workload YAML, e.g. configs/digits.yaml")
    p.add_argument("--summary-file", help="also write the JSON summary to this file")
    p.add_argument("overrides", nargs="*", help="dotted overrides: section.key=value")
    return p


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("RAYTORCH_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def fail(message: str, code: int) -> NoReturn:
    print(message.splitlines()[0] if message else "failed", file=sys.stderr)
    sys.exit(code)


def run_job(args: argparse.Namespace, body: Callable[[Config], dict[str, Any]]) -> None:
    """Load the config, run `body`, print its summary as the last stdout line."""
    setup_logging()
    with one_line_failures():
        config = load_config(args.config, args.overrides)
        summary = body(config)
        emit(summary, args.summary_file)


@contextlib.contextmanager
def one_line_failures() -> Iterator[None]:
    """Every failure the user can act on ends the job with one line and its documented code:
    a bad config 2, bad input or a failed run 1 (2 without a cluster, 3 at the export gate),
    and an OSError 1 (disk full, permission denied, a folder that is a file; connection errors
    are OSErrors too), naming the path. Anything else is a bug and keeps its traceback."""
    try:
        yield
    except ConfigError as e:
        fail(str(e), 2)
    except UserError as e:
        fail(f"error: {e}", e.exit_code)
    except OSError as e:
        fail(f"error: {os_error_line(e)}", 1)


def os_error_line(error: OSError) -> str:
    """`path: reason` for a disk, permission or filesystem error (pyarrow's carry no path
    attribute, but their message names it)."""
    reason = error.strerror or (str(error).strip().splitlines() or [type(error).__name__])[0]
    if error.filename is None:
        return reason
    where = str(error.filename)
    if error.filename2 is not None:
        where += f" -> {error.filename2}"
    return f"{where}: {reason}"


def emit(summary: dict[str, Any], summary_file: str | None) -> None:
    line = json.dumps(summary, sort_keys=True, default=str)
    if summary_file:
        from app import storage

        storage.write_bytes(
            summary_file if "://" in summary_file else os.path.abspath(summary_file),
            (line + "\n").encode(),
        )
    # Ray forwards workers' output to this process asynchronously: disconnect first, so that
    # nothing can land on stdout after the summary, which must stay the last line.
    disconnect_ray()
    sys.stderr.flush()
    print(line, flush=True)
