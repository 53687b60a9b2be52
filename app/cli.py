"""What every job entry point shares: arguments, exit codes, the summary line, Ray connection.

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
from app.errors import ConfigError, NoClusterError, UserError

# For the Ray clusters this project starts in-process (cluster/start.sh exports the same as
# RAY_idle_worker_killing_time_threshold_ms): idle workers live 30 s instead of 1 s once a node
# runs more workers than CPUs, as every training run does, so Ray Data's task processes last
# from one epoch to the next instead of starting afresh every epoch.
LOCAL_RAY_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 30_000}


def init_private_ray(num_cpus: int = 2) -> None:
    """A new Ray of this process's own, never a running one (tests and benchmarks): no
    dashboard, workers' output kept out of this process's."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )


def parser(stage: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m jobs.{stage}", description=description)
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


def disconnect_ray() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def connect_ray(require_cluster: bool = False) -> None:
    """Join RAY_ADDRESS or a running local cluster; else start a local Ray for this process.

    Jobs that leave something running (deploy) pass require_cluster and fail with exit 2 instead.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        if address == "auto" and not local_cluster_answers():
            raise ConnectionError("no local cluster answers")
        ray.init(address=address, log_to_driver=True)
        return
    except (ConnectionError, RuntimeError) as e:
        if require_cluster:
            raise NoClusterError(
                "no running Ray cluster found "
                f"({str(e).splitlines()[0][:120]}); start one with `make cluster-up` "
                "(cluster/start.sh) or `ray start --head`, or set RAY_ADDRESS"
            ) from None
    ray.init(_system_config=LOCAL_RAY_SYSTEM_CONFIG)


def local_cluster_answers(timeout_s: float = 1.0) -> bool:
    """Whether the cluster Ray's address file names (what address="auto" joins) is listening.

    A cluster that died without `ray stop` leaves that file behind, and joining it would wait
    on a dead GCS for half a minute before failing; a closed port answers at once.
    """
    import socket

    current = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")
    try:
        with open(current) as f:
            host, _, port = f.read().strip().rpartition(":")
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
