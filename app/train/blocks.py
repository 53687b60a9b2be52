"""Where a plain `torch.nn` model keeps its repeated blocks: the children of a `blocks` or
`layers` container (`nn.ModuleList` / `nn.Sequential`) on the root. FSDP shards them,
activation checkpointing recomputes them, a pipeline splits them into stages."""

from __future__ import annotations

from torch import nn

BLOCK_CONTAINERS = ("blocks", "layers")


def block_container(model: nn.Module) -> str | None:
    """The name of the model's block container, None when it has none."""
    for name in BLOCK_CONTAINERS:
        container = getattr(model, name, None)
        if isinstance(container, nn.ModuleList | nn.Sequential) and len(container):
            return name
    return None


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks; none for a model without a container (one unit)."""
    name = block_container(model)
    return list(getattr(model, name)) if name else []
