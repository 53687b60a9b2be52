"""Per-batch helpers every task's loss and validation share: autocast for the run's precision
and sums (or maxima) across ranks. Plain torch, no Ray."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

# (model, batch, device) -> (mean loss of the batch, rows in it)
LossFn = Callable[[nn.Module, dict[str, torch.Tensor], torch.device], tuple[torch.Tensor, int]]


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def all_reduce(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Sum (or max) `values` over ranks; the values themselves without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()
