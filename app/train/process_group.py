"""Ray Train's torch.distributed set-up, from a module that does not import torch.

Ray Train's controller actor unpickles the trainer's backend config, and Ray's `TorchConfig`
lives in a module that imports torch at the top: the controller process, which never runs a
tensor, spent ~1.3 s of CPU importing torch at every run's start, on the path to the first step
(B9). `ProcessGroupConfig` sets up the same process group with Ray's own worker-side functions
(`ray.train.torch.config`), imported only on the workers, which import torch anyway.

Covered: gloo (CPU) and nccl (GPU) with `env://` initialisation, as `TorchTrainer` sets them
up; not covered: TPU slices (this project does not train on TPUs).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, cast

from ray.train.backend import Backend, BackendConfig

log = logging.getLogger(__name__)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """What `TorchTrainer(torch_config=...)` takes: `backend` gloo or nccl, `timeout_s` for the
    process group's collectives."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type:
        return ProcessGroupBackend

    @property
    def train_func_context(self) -> type:
        return DeviceContext

    @property
    def framework(self) -> Any:
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class DeviceContext:
    """Around the train function on each worker: selects the worker's CUDA device, as
    TorchTrainer does."""

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        TorchConfigContextManager().__enter__()

    def __exit__(self, *exc: object) -> None:
        pass


class ProcessGroupBackend(Backend):
    """Controller side: rank 0's address to every worker, then each worker joins the group."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        import ray
        from ray.train._internal.utils import get_address_and_port

        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_set_distributed_env)  # LOCAL_RANK and the rest, before init
        world, config = len(worker_group), cast(ProcessGroupConfig, backend_config)
        joins = [
            worker_group.execute_single_async(
                i,
                _join_process_group,
                backend=config.backend,
                world_rank=i,
                world_size=world,
                timeout_s=config.timeout_s,
            )
            for i in range(world)
        ]
        ray.get(joins)

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        timeout = float(
            os.environ.get(
                TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            )
        )
        leaving = worker_group.execute_async(
            _leave_process_group, destroy_process_group=len(worker_group) > 1
        )
        try:
            ray.get(leaving, timeout=timeout)
        except GetTimeoutError:
            log.warning("torch process group shutdown timed out after %.0f s", timeout)


# --- run on the workers -----------------------------------------------------------------------


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_distributed_env() -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def _join_process_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(
        backend=backend,
        world_rank=world_rank,
        world_size=world_size,
        init_method="env://",
        timeout_s=timeout_s,
    )


def _leave_process_group(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)
