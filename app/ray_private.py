"""Every use of Ray's private APIs, in one place, each checked against RAY_VERSION
(tests/unit/test_ray_private.py fails when the installed Ray differs: re-check each then).

Each is here because no public API gives the same: say which in its docstring.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import traceback
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)
RAY_VERSION = "2.60.0"
UNKNOWN_HOST = "<unknown>"


async def serve_http_host() -> str:
    """The host Serve's HTTP proxies listen on, as the running Serve controller has it.

    Serve keeps the http_options it started with (later deploys cannot change them), so this is
    the one source of truth; no public API reads it. If it cannot be read: UNKNOWN_HOST, which
    the API-key rule treats as public (fail closed).
    """
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        options = await controller.get_http_config.remote()
        return str(options.host)
    except Exception as e:  # noqa: BLE001 - any failure means "unknown", handled as public
        log.warning("could not read Serve's HTTP host (%s); requiring an API key", e)
        return UNKNOWN_HOST


def dashboard_url() -> str | None:
    """host:port of the connected cluster's dashboard (the Serve REST API lives there); the
    public `ray.init(...).dashboard_url` is only returned to the process that connected."""
    import ray

    return ray._private.worker.get_dashboard_url() or None


def init_local_ray(system_config: dict, **kwargs: object) -> None:
    """A local Ray with `_system_config` (no public way to set a raylet option in-process)."""
    import ray

    ray.init(_system_config=system_config, **kwargs)  # type: ignore[arg-type]


def lean_torch_trainer(pg_cleaner: bool) -> type:
    """TorchTrainer without the actors a run does not need, each a fresh process started just
    as the workers start (no public option turns them off):
    - the DatasetManager, which Ray Train starts for every run to split its `datasets`: our runs
      pass none (each worker reads or streams its own share);
    - unless `pg_cleaner`, the PlacementGroupCleaner, a detached actor that removes the worker
      group's placement group if the controller dies while the job lives on. A job's own driver
      ends with its run and Ray then removes the job's placement groups; a Tune trial stopped
      early is killed while the search goes on, so Tune runs keep the cleaner.
    """
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )
    from ray.train.v2.torch.torch_trainer import TorchTrainer  # what ray.train.torch gives in V2

    dropped: tuple[type, ...] = (DatasetsCallback,)
    if not pg_cleaner:
        dropped += (PlacementGroupCleanerCallback,)

    class LeanTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if not isinstance(c, dropped)]

    return LeanTorchTrainer


def quiet_train_logs() -> None:
    """Ray Train logs every report's full metrics dict and checkpoint path at INFO, per rank,
    per epoch; our job log keeps one line per epoch instead. Its loggers are named after the
    modules' file paths, not their dotted names."""
    from ray.train.v2._internal.execution import context, storage

    for module in (context, storage):
        for name in (module.__name__, getattr(module, "__file__", "")):
            logging.getLogger(name).setLevel(logging.WARNING)


def quiet_data_progress() -> None:
    """Ray Data's per-execution summary lines, and the notice that progress bars are off."""
    logging.getLogger("ray.data._internal.execution.streaming_executor").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def data_tasks_running(executor: object) -> bool:
    """Whether a Ray Data streaming executor has a task running (its operator topology is
    private; an executor without one counts as idle)."""
    topology = getattr(executor, "_topology", None) or {}
    return any(op.num_active_tasks() for op in topology)


def wait_for_job_actors(class_name: str, timeout_s: float = 30.0) -> list[str]:
    """Wait until no actor of `class_name` created by this job is alive; returns the ids of any
    still alive at the timeout.

    Ray ends an actor whose handles are gone (Ray Train's TrainController, once `fit` returns)
    in the background, so a `ray.shutdown()` right after could leave its process behind. The
    public state API (`ray.util.state.list_actors`) needs the dashboard, which local Rays here
    run without; the GCS actor table (`ray._private.state.actors`) does not.
    """
    import time

    import ray
    from ray._private.state import actors

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [
            actor_id
            for actor_id, info in actors(job_id=job, actor_state_name="ALIVE").items()
            if info["ActorClassName"] == class_name
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@contextlib.contextmanager
def train_controller_released(wait: bool, timeout_s: float = 30.0) -> Iterator[None]:
    """Around `TorchTrainer.fit()`: on the way out, drop the references Ray Train leaves to its
    TrainController's handle, and (`wait`) return only once the actor has ended.

    The controller never exits by itself: Ray ends it when its last handle goes, and `fit`
    leaves two (Ray 2.60, `DataParallelTrainer._initialize_and_run_controller`): the SIGINT
    handler it registers, a closure over the handle, and on failure the frames of the raised
    error's traceback. No public API releases either.
    """
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    except BaseException as e:
        _clear_frames(e)
        raise
    finally:
        if main:
            signal.signal(signal.SIGINT, handler)
        left = wait_for_job_actors("TrainController", timeout_s) if wait else []
        if left:
            log.warning("the run's TrainController %s still alive after %.0f s", left, timeout_s)


def _clear_frames(error: BaseException | None) -> None:
    """Let go of the locals of the finished frames under `error` and the errors it chains."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def batching_outside_serve() -> None:
    """Let `serve.batch` run outside a Serve replica (a replica class used in-process: tests,
    bench.plain_server). Its queue checks `max_ongoing_requests` against the batch size when it
    starts, for a warning, by asking for the replica context, which raises outside Serve
    (Ray 2.60, `batching._BatchQueue`); there the check is skipped, inside it runs as before.
    No public API turns the check off."""
    from ray.serve import batching
    from ray.serve.exceptions import RayServeException

    queue: Any = batching._BatchQueue
    check = queue._warn_if_max_batch_size_exceeds_max_ongoing_requests
    if getattr(check, "outside_serve", False):
        return

    def checked(self: Any) -> None:
        from ray import serve

        try:
            serve.get_replica_context()
        except RayServeException:
            return
        check(self)

    checked.outside_serve = True  # type: ignore[attr-defined]
    queue._warn_if_max_batch_size_exceeds_max_ongoing_requests = checked
