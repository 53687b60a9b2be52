"""Initial weights drawn module by module, each from a generator seeded by the run's seed and the
module's name, so that any process can draw any one module's tensors alone: a sharded rank draws
one module at a time on the CPU and keeps its slice, and still starts from the weights a
single-process build of the same seed holds.

A module's own tensors (not its children's) are drawn the way PyTorch draws them at
construction: its `reset_parameters()`, then each ancestor's `init_module(name, module)` hook,
nearest first (a model's own scheme over its layers' defaults, as GPT-2's normal(0, 0.02) over
`nn.Linear`'s). Modules holding bare `nn.Parameter`s define `reset_parameters` for those alone.
A parameter shared by two modules (GPT-2's embedding and output head) is drawn once, by its
first owner in `named_modules()` order. No Ray and no sharding here: the caller says where each
drawn tensor goes (`Assign`: a copy, or a rank's slice of it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

# (the held tensor, the drawn full tensor) -> the held tensor filled with its part of it
Assign = Callable[[torch.Tensor, torch.Tensor], None]


def module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each tensor, grouped by tensor (one group a tensor, its first owner's name
    first); taken before materialising, which unties shared parameters."""
    groups: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, tensor in own_tensors(module):
            groups.setdefault(id(tensor), [])
            name = join(path, attr)
            if name not in groups[id(tensor)]:
                groups[id(tensor)].append(name)
    return list(groups.values())


def own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters and buffers (not its children's)."""
    for attr, tensor in (*module._parameters.items(), *module._buffers.items()):
        if tensor is not None:
            yield attr, tensor


def join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def uncovered(model: nn.Module) -> list[str]:
    """Tensors no rule draws: their module has no `reset_parameters` and no ancestor an
    `init_module` hook (a model built on the meta device could not start from them)."""
    hooked = {path for path, m in model.named_modules() if hasattr(m, "init_module")}
    missing = []
    for path, module in model.named_modules():
        if hasattr(module, "reset_parameters") or any(
            _is_ancestor(a, path) for a in hooked if a != path
        ):
            continue
        missing += [join(path, attr) for attr, _ in own_tensors(module)]
    return missing


@dataclass
class Drawn:
    """What `initialise` did: the largest module it drew whole (the scratch memory it took),
    and the held tensors no rule wrote (left as they were)."""

    scratch_bytes: int = 0
    undrawn: list[str] = field(default_factory=list)


def initialise(
    model: nn.Module, seed: int, ties: list[list[str]] | None = None, assign: Assign | None = None
) -> Drawn:
    """Draw the initial value of every tensor this process holds (not on the meta device), one
    module at a time. A tensor no rule writes keeps its value (a whole build's, from its
    constructor) and is listed as undrawn.

    `ties` (from `tied_names`, taken before materialising) names the copies of shared
    tensors; `assign` puts a drawn tensor into a held one (default: a plain copy)."""
    ties = ties if ties is not None else tied_names(model)
    copies = {group[0]: group for group in ties}
    assign = assign or _copy
    done = Drawn()
    for path, module in model.named_modules():
        targets = {
            attr: held
            for attr, _ in own_tensors(module)
            if (held := held_tensors(model, copies.get(join(path, attr), [])))
        }
        if not targets:
            continue
        drawn = draw(model, path, seed)
        done.scratch_bytes = max(
            done.scratch_bytes, sum(t.numel() * t.element_size() for t in drawn.values())
        )
        for attr, held in targets.items():
            if attr not in drawn:
                done.undrawn.append(join(path, attr))
                continue
            for tensor in held:
                assign(tensor, drawn[attr])
    return done


def draw(model: nn.Module, path: str, seed: int) -> dict[str, torch.Tensor]:
    """Module `path`'s own tensors, full size on the CPU, as its construction draws them: those
    its rules write whole (each starts as a marker no rule leaves: NaN, or an integer's least)."""
    module = model.get_submodule(path)
    twin = _twin(module)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(module_seed(seed, path))
        reset = getattr(twin, "reset_parameters", None)
        if callable(reset):
            reset()
        for ancestor, name in _ancestors(model, path):
            hook = getattr(ancestor, "init_module", None)
            if hook is not None:
                hook(name, twin)
    return {attr: t for attr, t in own_tensors(twin) if _written(t)}


def _marker(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _written(tensor: torch.Tensor) -> bool:
    """Whether a rule wrote every element (no marker left; a bool tensor cannot tell)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return not bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool:
        return True
    return not bool((tensor == _marker(tensor.dtype)).any())


def _twin(module: nn.Module) -> nn.Module:
    """A childless copy of `module` holding full-size, empty CPU copies of its own tensors (the
    global shape of a sharded one)."""
    twin = object.__new__(type(module))  # not copy.copy: FSDP2's classes rebuild in __new__
    twin.__dict__ = dict(module.__dict__)
    twin._parameters = {
        k: None if p is None else nn.Parameter(_marked(p), False)
        for k, p in module._parameters.items()
    }
    twin._buffers = {k: None if b is None else _marked(b) for k, b in module._buffers.items()}
    twin._modules = {}
    return twin


def _marked(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, _marker(like.dtype), dtype=like.dtype)


def _ancestors(model: nn.Module, path: str) -> Iterator[tuple[nn.Module, str]]:
    """Each ancestor of module `path`, nearest first, with the path's name under it."""
    parts = path.split(".") if path else []
    for cut in range(len(parts) - 1, -1, -1):
        yield model.get_submodule(".".join(parts[:cut])), ".".join(parts[cut:])


def _is_ancestor(ancestor: str, path: str) -> bool:
    return ancestor == "" or path.startswith(ancestor + ".")


def held_tensors(model: nn.Module, names: list[str]) -> list[torch.Tensor]:
    """The distinct tensors among `names` this process holds (not on the meta device)."""
    held: dict[int, torch.Tensor] = {}
    for name in names:
        tensor = lookup(model, name)
        if tensor is not None and not tensor.is_meta:
            held.setdefault(id(tensor), tensor)
    return list(held.values())


def lookup(model: nn.Module, name: str) -> torch.Tensor | None:
    """A parameter or buffer by its full name (None when its module has none of that name)."""
    path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:  # a module this process does not hold (another pipeline stage's)
        return None
    return dict(own_tensors(module)).get(attr)


def _copy(held: torch.Tensor, drawn: torch.Tensor) -> None:
    with torch.no_grad():
        held.copy_(drawn)
