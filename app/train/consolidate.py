"""The consolidated `model.safetensors` of a sharded run (FSDP, pipeline), written tensor by
tensor: the writing rank receives one whole tensor at a time and writes it before the next, so
no process ever holds the whole model, let alone two copies of it.

The file is what `safetensors.torch.save_model` writes for the unsplit model: every tensor under
the model's name, a shared one (GPT-2's embedding and head) once under the first of its names in
sorted order, the others listed in the metadata. Its header, written first, is made from the
tensors' shapes alone. Written under a temporary name and renamed whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app.models.init import tied_names
from app.train.pipelining import PipelinedModel

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class Gathered:
    """What the writer gets: the tensors' specs and dropped copies first, then each whole
    tensor in turn (a collective step on every rank taking part)."""

    specs: list[Spec]
    dropped: dict[str, str]
    tensors: Iterator[torch.Tensor]


def write_consolidated(path: str | None, model: nn.Module) -> None:
    """A collective of the ranks holding parts of the model (FSDP: all; a pipeline: its first
    row): the rank given a `path` writes the file, the others send it their tensors."""
    if isinstance(model, PipelinedModel):
        gathered = _pipeline_tensors(model)
    else:
        gathered = _fsdp_tensors(model)
    if path is None:
        for _ in gathered.tensors:  # every rank takes part in each gather
            pass
        return
    write_safetensors(path, gathered.specs, gathered.tensors, gathered.dropped)


def write_safetensors(
    path: str, specs: list[Spec], tensors: Iterator[torch.Tensor], metadata: dict[str, str]
) -> None:
    """A safetensors file of `specs`, the tensors coming one at a time in their order."""
    header: dict[str, object] = {}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.partial"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for spec, tensor in zip(specs, tensors, strict=True):
                if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                    raise ValueError(f"{spec.name}: got {tuple(tensor.shape)} {tensor.dtype}")
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(data.numpy().data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def kept_names(names: list[str], ties: list[list[str]]) -> tuple[list[str], dict[str, str]]:
    """The names written (sorted) and each dropped copy's kept name: of a shared tensor's names,
    the first in sorted order is kept, as safetensors' `save_model` keeps it."""
    present, dropped = set(names), {}
    for group in ties:
        copies = sorted(n for n in group if n in present)
        for name in copies[1:]:
            dropped[name] = copies[0]
    return sorted(present - set(dropped)), dropped


def _fsdp_tensors(model: nn.Module) -> Gathered:
    """Each whole tensor in turn, all-gathered on every rank."""
    state = model.state_dict()  # FSDP2: DTensors under the model's names
    names, dropped = kept_names(list(state), tied_names(model))

    def tensors() -> Iterator[torch.Tensor]:
        for name in names:
            tensor = state[name]
            yield tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    return Gathered(
        [Spec(n, tuple(state[n].shape), state[n].dtype) for n in names], dropped, tensors()
    )


def _pipeline_tensors(model: PipelinedModel) -> Gathered:
    """Each whole tensor in turn on the writer (the first rank of the first row), sent by the
    stage holding it; the other rows take no part."""
    pipe = model.pipeline
    if pipe.mesh.row != 0:
        return Gathered([], {}, iter(()))
    mine = model.state_dict()
    ranks = pipe.mesh.pipeline_ranks(0)
    listings: list[Any] = [None] * len(ranks)
    listing = [(n, tuple(t.shape), t.dtype) for n, t in mine.items()]
    dist.all_gather_object(listings, listing, group=pipe.groups.pipeline)
    owner: dict[str, tuple[int, Spec]] = {}
    for rank, held in zip(ranks, listings, strict=True):
        for name, shape, dtype in held:
            owner.setdefault(name, (rank, Spec(name, shape, dtype)))
    names, dropped = kept_names(list(owner), [list(group) for group in pipe.tied])
    me, dst = dist.get_rank(), ranks[0]

    def tensors() -> Iterator[torch.Tensor]:
        for name in names:
            src, spec = owner[name]
            if src == me == dst:
                yield mine[name]
            elif src == me:
                dist.send(mine[name].detach().contiguous(), dst)
            elif me == dst:
                tensor = torch.empty(spec.shape, dtype=spec.dtype, device=pipe.device)
                dist.recv(tensor, src)
                yield tensor

    return Gathered([owner[n][1] for n in names], dropped, tensors())
