"""A sharded rank's model without the whole of it: built on the meta device, sharded (FSDP) or cut
into stages (pipeline), then only what this rank owns is allocated, drawn and loaded.

- Allocation: FSDP2's own `to_empty` allocates each parameter's local shard; a pipeline rank
  allocates the tensors its stages hold (`materialise_held`), a shared one once.
- Initial values: app/models/init.py draws one module at a time, full size on the CPU, and this
  rank keeps its part (`assign_part`), so the weights equal a single-process build's of the seed.
- Pretrained weights (`load_parts`): each held tensor's part is read from the folder's
  safetensors files with `safe_open(...).get_slice`, never a whole file; a remote folder is
  downloaded once per machine (app/pretrained.py). A sharded checkpoint resumes through
  torch.distributed.checkpoint, which reads each rank's own byte ranges.

No Ray here: Ray Train workers and the plain `torch.distributed` benchmark (bench/b26) call it.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from app.errors import ConfigError
from app.models.init import Drawn, held_tensors, initialise, lookup, own_tensors, tied_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Materialised:
    """What a rank allocated: its tensors' bytes, and the largest module it drew whole (scratch,
    freed before the next)."""

    held_bytes: int
    scratch_bytes: int

    def __str__(self) -> str:
        return (
            f"{self.held_bytes / 2**20:.1f} MiB held (the largest module drawn whole: "
            f"{self.scratch_bytes / 2**20:.1f} MiB)"
        )


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


# glibc's M_MMAP_THRESHOLD (mallopt's parameter number) and its own default value.
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 128 * 1024


def return_freed_buffers() -> bool:
    """Make the process give large freed buffers back to the OS (glibc; elsewhere a no-op).

    glibc raises its mmap threshold (up to 32 MiB) each time a large buffer is freed, after
    which buffers under it come from the heap and stay in the process once freed: over FSDP's
    gathers, gradients and reduce-scatters that held x1.3 of a rank's steady memory, the whole
    run long (bench/b26). Fixed at glibc's own default, each goes back when freed; a CPU step
    costs about 15% more (fresh pages). Returns whether it took effect."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def materialise_sharded(
    model: nn.Module, ties: list[list[str]], device: torch.device, seed: int
) -> Materialised:
    """FSDP2: allocate every parameter's local shard (ties kept: FSDP2 holds a shared parameter
    once), then draw each module and keep this rank's rows."""
    model.to_empty(device=device)
    drawn = _all_drawn(initialise(model, seed, ties, assign=assign_part))
    return Materialised(held_bytes(model), drawn.scratch_bytes)


def materialise_held(
    model: nn.Module, names: set[str], device: torch.device, seed: int
) -> Materialised:
    """A pipeline rank: allocate the tensors named `names` (the whole model's names), a shared
    one once under all its names, and draw them; the rest stays on the meta device."""
    ties = tied_names(model)
    for group in ties:
        mine = [n for n in group if n in names]
        if not mine:
            continue
        first = lookup(model, mine[0])
        assert first is not None
        fresh: torch.Tensor = torch.empty_like(first, device=device)
        if isinstance(first, nn.Parameter):
            fresh = nn.Parameter(fresh, requires_grad=first.requires_grad)
        for name in mine:
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path)
            if attr in module._parameters:
                module._parameters[attr] = fresh  # type: ignore[assignment]
            else:
                module._buffers[attr] = fresh
    drawn = _all_drawn(initialise(model, seed, ties))
    return Materialised(held_bytes(model), drawn.scratch_bytes)


def _all_drawn(drawn: Drawn) -> Drawn:
    """A tensor allocated here and written by no rule would start as whatever memory held."""
    if drawn.undrawn:
        raise ConfigError(
            f"config error: train.strategy: nothing draws {drawn.undrawn[:3]} on a rank that "
            "builds its part of the model: give their module a reset_parameters() that sets them"
        )
    return drawn


def in_state_dict(model: nn.Module, name: str) -> bool:
    """Whether tensor `name` is saved and loaded (a non-persistent buffer is not)."""
    path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:  # a module this rank does not hold
        return True
    return attr not in module._non_persistent_buffers_set


def load_parts(model: nn.Module, pre: Any, ties: list[list[str]]) -> int:
    """Copy into each tensor this rank holds its part of the pretrained folders' weights, read
    as a slice of the file; returns the bytes read. A tensor the folders lack and that is not
    fresh (app/models: `is_fresh`) is a config error naming it; a buffer outside the state dict
    (rotary frequencies, derived from the config) keeps what its module drew."""
    from app.models import is_fresh, stored_weights

    stored, read = stored_weights(pre), 0
    for group in ties:
        if not in_state_dict(model, group[0]):
            continue
        held = held_tensors(model, group)
        source = next((stored[n] for n in group if n in stored), None)
        if not held:
            continue
        if source is None:
            if not all(is_fresh(n) for n in group):
                raise ConfigError(f"config error: model.pretrained: the weights lack {group[0]!r}")
            continue
        for tensor in held:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            part = source.read(shard_rows(tensor) if local is not tensor else None)
            if part.shape != local.shape:
                raise ConfigError(
                    f"config error: model.pretrained: {source.name} has shape "
                    f"{tuple(part.shape)} where {group[0]!r} takes {tuple(local.shape)}"
                )
            with torch.no_grad():
                local.copy_(part)
            read += part.numel() * part.element_size()
    return read


def held_bytes(model: nn.Module) -> int:
    """Bytes of the distinct tensors this rank holds (a DTensor's local shard)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for _, tensor in own_tensors(module):
            if not tensor.is_meta:
                seen.setdefault(id(tensor), tensor)
    return sum(local_bytes(t) for t in seen.values())


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for `tensor` (its shard, for a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def assign_part(held: torch.Tensor, full: torch.Tensor) -> None:
    """Fill `held` with its part of `full`: a DTensor its local shard, anything else all of it."""
    with torch.no_grad():
        if hasattr(held, "to_local"):
            rows = shard_rows(held)
            held.to_local().copy_(full[rows.start : rows.stop])
        else:
            held.copy_(full)


def shard_rows(tensor: Any) -> range:
    """The rows of the whole tensor a DTensor's local shard holds: FSDP2 shards dimension 0 of
    a 1-D mesh as `torch.chunk` does (each rank ceil(rows / ranks), the last ones fewer)."""
    from torch.distributed.tensor import Shard

    (placement,) = tensor.placements
    if not (isinstance(placement, Shard) and placement.dim == 0):
        raise ValueError(f"a parameter sharded as {placement}, not by rows")
    mesh, rows = tensor.device_mesh, tensor.shape[0]
    size = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * size, rows)
    held = range(start, min(start + size, rows))
    if len(held) != tensor.to_local().shape[0]:
        raise ValueError(f"a shard of {tensor.to_local().shape[0]} rows where {held} was expected")
    return held
