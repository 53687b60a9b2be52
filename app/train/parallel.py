"""How a plain `torch.nn` model is parallelised across ranks: DDP or FSDP2, activation
checkpointing, `torch.compile`, and the per-rank memory those choices leave.

The model code (app/models) knows nothing of this: `parallelize` takes the module a builder
returned and wraps it in place, the way torchtitan keeps "what the model is" apart from "how it
is spread over devices". No Ray here: Ray Train workers (app/train/driver.py) and the plain
`torch.distributed` benchmarks (bench/b11_fsdp_memory.py) call the same functions.

- `train.strategy: ddp`: every rank holds the whole model, gradients are all-reduced
  (`DistributedDataParallel`; no wrapper at world size 1).
- `train.strategy: fsdp`: `fully_shard` (FSDP2) on each block, then on the root; parameters,
  gradients and optimizer state are sharded (DTensors), a block's full parameters exist only
  while it runs. Mixed precision from `train.precision` (`MixedPrecisionPolicy`).
- `train.strategy: pipeline`: the blocks split into stages, one a rank (app/train/pipelining.py);
  each rank trains a `PipelinedModel`, its stages under the model's names.
- Blocks: the children of a `blocks` or `layers` container (app/train/blocks.py); a model
  without one is one unit (its root alone).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from app.config import TrainConfig
from app.models.init import tied_names
from app.train.blocks import find_blocks
from app.train.materialise import local_bytes, materialise_sharded, on_meta
from app.train.pipelining import PipelinedModel, Scoring, pipelined

log = logging.getLogger(__name__)


def parallelize(
    model: nn.Module,
    t: TrainConfig,
    device: torch.device,
    scoring: Scoring | None = None,
) -> nn.Module:
    """Move `model` to `device` and wrap it for `t.strategy`; returns the module to train
    (a pipeline's stages score batches with the task's `scoring`).

    Order as PyTorch recommends for FSDP2: activation checkpointing inside each block first,
    then sharding, then compilation (FSDP2's hooks are excluded from Dynamo's graphs, so the
    compiled blocks keep their parameter names and checkpoints do not change).
    """
    meta = on_meta(model)  # sharded strategies: each rank materialises its part (below)
    ties = tied_names(model) if meta else []
    blocks = find_blocks(model)
    units = blocks or [model]
    if t.activation_checkpointing:
        for unit in units:
            checkpoint_activations(unit)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and the device mesh use the current device
    if t.strategy == "pipeline":
        assert scoring is not None, "a pipeline needs the task's scoring"
        return pipelined(model, t, device, scoring)
    if not meta:
        model.to(device)
    if t.strategy == "fsdp":
        shard(model, blocks, device, t.precision, t.shard_vocab)
        if meta:
            made = materialise_sharded(model, ties, device, t.seed)
            log.info("materialised this rank's shards: %s", made)
    elif meta:
        raise ValueError(f"train.strategy={t.strategy} holds the whole model: build it whole")
    if t.compile:
        for unit in units:
            unit.compile()  # in place: same module, same state-dict keys
    if t.strategy == "ddp" and world_size() > 1:
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model


def checkpoint_activations(module: nn.Module) -> None:
    """Keep only the module's inputs in forward and recompute its activations in backward.

    In place (the module's forward is replaced), so its type and parameter names stay those of
    the model code and every checkpoint format is unchanged. Non-reentrant checkpointing: it
    composes with FSDP2's hooks, keyword arguments and `torch.compile`.
    """
    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed  # type: ignore[method-assign]


def precision_policy(precision: str):
    """FSDP2 mixed precision: parameters are cast to bf16/fp16 for compute when gathered;
    gradients are reduced in fp32 (a sum over ranks in 16 bits loses what the AdamW update
    needs) and the sharded master weights and optimizer state stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard(
    model: nn.Module,
    blocks: list[nn.Module],
    device: torch.device,
    precision: str,
    vocab_rows: bool = True,
) -> None:
    """FSDP2: `fully_shard` each block, then the root (which takes every parameter left:
    embeddings, norms, the head), except, with `vocab_rows`, a causal LM's embedding and head
    tables, which are sharded by rows and never gathered (app/train/vocab_parallel.py). A model built on the meta
    device is sharded as it is and each rank then materialises its own shards
    (app/train/materialise.py); one built whole holds the same weights on every rank (one
    seed), so each keeps its slice and nothing is broadcast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from app.train.vocab_parallel import shard_vocab

    mesh = init_device_mesh(device.type, (world_size(),))
    policy = precision_policy(precision)
    tables = shard_vocab(model, mesh) if vocab_rows and world_size() > 1 else set()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=tables)


def is_sharded(model: nn.Module) -> bool:
    """Whether this rank holds only part of the model (FSDP or a pipeline): its checkpoints
    are sharded."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule | PipelinedModel)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> None:
    """Scale the gradients so that their global norm is at most `max_norm` (a pipeline's
    norm spans its stages)."""
    if isinstance(model, PipelinedModel):
        model.clip_grad_norm_(max_norm)
    else:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --- memory -----------------------------------------------------------------------------------


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes (local shards only)."""
    params = list(model.parameters())
    optim = sum(
        local_bytes(v)
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optim,
    }


class MemoryMeter:
    """Peak parameter + gradient + optimizer-state bytes of this rank.

    Measured right after an optimizer step (a step post-hook): gradients still exist and the
    optimizer state is allocated, the most these three hold at once. Their sizes do not change
    after the first step, so later steps are not measured.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.peak: dict[str, int] = {}
        optimizer.register_step_post_hook(self._measure)

    def _measure(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not self.peak:
            self.peak = state_bytes(self.model, optimizer)
            self.peak["total"] = sum(self.peak.values())
