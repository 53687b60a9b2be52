"""A sharded run's vocabulary: a causal LM's token embedding and LM head (one table when tied)
split by rows across the ranks and never gathered.

FSDP2 gathers a parameter whole wherever it is used, and a parameter two modules share (a head
tied to the embedding) can only belong to their common parent, the root, which holds it gathered
for the whole step with its whole gradient beside it: 151,936 x 896 fp32 is 0.5 GiB each for
Qwen2.5-0.5B. Here the table stays a DTensor sharded by rows, as FSDP2 shards (each rank
ceil(rows / ranks), the last fewer), which FSDP2 is told to leave alone: materialising,
pretrained loading, checkpoints, the optimizer and clipping treat it as one of FSDP2's own. What
crosses between ranks is activations instead, as in Megatron's vocab-parallel layers, over the
data-parallel ranks (each with its own tokens):

- the embedding gathers every rank's token ids; each rank looks up those in its rows (zeros for
  the rest) and a reduce-scatter sums the lookups back to the ranks they came from;
- the head and loss gather a chunk of trained positions' normed hidden states; each rank scores
  them against its rows and the cross entropy is assembled from all-reduced maxima, sums of
  exponentials and target logits; backward recomputes the chunk's logits instead of keeping them.

A rank's rows get every rank's tokens' gradients, divided by the ranks as FSDP2's reduce-scatter
averages the other parameters'. Plain `torch.distributed`, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from app.models.causal import IGNORE, LOSS_CHUNK_ELEMENTS, TokenLoss, causal_lm


@dataclass(frozen=True)
class Rows:
    """This rank's rows of a table of `total` rows, in the process group of `world` ranks."""

    start: int
    stop: int
    total: int
    world: int
    group: Any = None

    @classmethod
    def of(cls, total: int, group: Any = None) -> Rows:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        size = -(-total // world)  # torch.chunk's split, as FSDP2 shards
        start = min(rank * size, total)
        return cls(start, min(start + size, total), total, world, group)


def shard_vocab(model: nn.Module, mesh: Any) -> set[nn.Parameter]:
    """Replace a causal LM's embedding and head tables by DTensors sharded by rows over `mesh`
    (1-D), the embedding by a `VocabParallelEmbedding` and its loss by a `VocabParallelLoss`;
    returns the tables, which FSDP2 must ignore. Nothing for other models."""
    lm = causal_lm(model)
    embedding = getattr(model, "tokens", None)
    if lm is None or not isinstance(embedding, nn.Embedding):
        return set()
    rows = Rows.of(embedding.num_embeddings, mesh.get_group())
    tables = {id(p): p for p in (embedding.weight, lm.head_weight())}
    sharded = {key: _sharded(p, rows, mesh) for key, p in tables.items()}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in sharded:
                module._parameters[attr] = sharded[id(param)]
    model.tokens = VocabParallelEmbedding.like(embedding, rows)
    model.vocab_loss = VocabParallelLoss(rows)
    return set(sharded.values())


def _sharded(param: torch.Tensor, rows: Rows, mesh: Any) -> nn.Parameter:
    """The table as a DTensor holding this rank's rows (on the meta device while it is there)."""
    from torch.distributed.tensor import DTensor, Shard

    local = param.detach()[rows.start : rows.stop].clone()
    table = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(table, requires_grad=param.requires_grad)


def local_rows(table: torch.Tensor) -> torch.Tensor:
    return table.to_local() if hasattr(table, "to_local") else table


class VocabParallelEmbedding(nn.Embedding):
    """`nn.Embedding` over a table sharded by rows: every rank's ids looked up where they live."""

    rows: Rows

    @classmethod
    def like(cls, embedding: nn.Embedding, rows: Rows) -> VocabParallelEmbedding:
        module = cls.__new__(cls)
        module.__dict__ = dict(embedding.__dict__)
        module.rows = rows
        return module

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ranks may hold different numbers of ids (validation's last batches): each pads its
        own to the most with an id no rank holds."""
        ids = input_ids.flatten()
        most = _most(len(ids), ids.device, self.rows)
        ids = torch.cat([ids, ids.new_full((most - len(ids),), -1)])
        out = _Embed.apply(ids, local_rows(self.weight), self.rows)[: input_ids.numel()]
        return out.view(*input_ids.shape, self.embedding_dim)


class VocabParallelLoss(nn.Module):
    """The contract's loss (app/models/causal.py `VocabLoss`) over a head sharded by rows."""

    def __init__(self, rows: Rows):
        super().__init__()
        self.rows = rows

    def forward(
        self, hidden: torch.Tensor, norm: nn.Module, weight: torch.Tensor, targets: torch.Tensor
    ) -> TokenLoss:
        trained = targets.flatten() != IGNORE
        h, t = norm(hidden.flatten(0, 1)[trained]), targets.flatten()[trained]
        most = _most(len(t), h.device, self.rows)  # every rank runs the same chunks
        h = torch.cat([h, h.new_zeros(most - len(t), h.shape[1])])
        t = torch.cat([t, t.new_full((most - len(t),), IGNORE)])
        chunk = max(1, LOSS_CHUNK_ELEMENTS // self.rows.total)
        total = h.new_zeros((), dtype=torch.float32) + 0.0 * h.sum()  # all rows in the graph
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        for start in range(0, most, chunk):
            loss, hits = _chunk(
                h[start : start + chunk], t[start : start + chunk], weight, self.rows
            )
            total, correct = total + loss, correct + hits
        return TokenLoss(total, trained.sum(), correct)


def _chunk(
    h: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, rows: Rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's summed loss and hits on one chunk (the same size on every rank)."""
    every_h = _Gather.apply(h, rows)
    every_t = _gathered(t, rows)
    losses, hits = _CrossEntropy.apply(every_h, local_rows(weight), every_t, rows)
    mine = slice(dist.get_rank(rows.group) * len(t), (dist.get_rank(rows.group) + 1) * len(t))
    return losses[mine].sum(), hits[mine].sum()


def _most(count: int, device: torch.device, rows: Rows) -> int:
    """The largest `count` of the ranks."""
    most = torch.tensor([count], device=device)
    return int(_all_reduce(most, rows, dist.ReduceOp.MAX).item())


def _gathered(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    out = x.new_empty((rows.world * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=rows.group)
    return out


def _scattered(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Each rank's part of the sum over ranks of `x` ([world * n, ...] -> [n, ...])."""
    out = x.new_empty((x.shape[0] // rows.world, *x.shape[1:]))
    dist.reduce_scatter_single(out, x.contiguous(), group=rows.group)
    return out


class _Gather(torch.autograd.Function):
    """Every rank's rows stacked; backward sums each rank's gradient from every rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        ctx.rows = rows
        return _gathered(x, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scattered(grad, ctx.rows), None


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, table: torch.Tensor, rows: Rows) -> torch.Tensor:
        every = _gathered(ids, rows)
        mine = (every >= rows.start) & (every < rows.stop)
        looked = table.new_zeros(len(every), table.shape[1])
        looked[mine] = table[every[mine] - rows.start]
        ctx.save_for_backward(every, mine)
        ctx.rows, ctx.shape = rows, table.shape
        return _scattered(looked, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        every, mine = ctx.saved_tensors
        grads = _gathered(grad, ctx.rows)  # collective: every rank, frozen table or not
        if not ctx.needs_input_grad[1]:
            return None, None, None
        table_grad = grad.new_zeros(ctx.shape)
        table_grad.index_add_(0, every[mine] - ctx.rows.start, grads[mine])
        return None, table_grad / ctx.rows.world, None


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of every rank's hidden states `h` [n, dim] against the targets
    `t` [n] (IGNORE: 0), this rank holding `table`'s rows of the vocabulary; and top-1 hits.
    The logits are computed in autocast's dtype when it is on, in backward as in forward."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, table: torch.Tensor, t: torch.Tensor, rows: Rows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        logits = _logits(h, table, dtype)
        best, at = logits.max(dim=-1)
        top = _all_reduce(best.clone(), rows, dist.ReduceOp.MAX)
        sums = _all_reduce((logits - top[:, None]).exp().sum(-1), rows)
        target = _target_logits(logits, t, rows)
        losses = torch.where(t != IGNORE, sums.log() + top - target, torch.zeros_like(top))
        owner = torch.where(best == top, at + rows.start, torch.full_like(at, -1))
        hits = _all_reduce(((owner == t) & (t != IGNORE)).long(), rows, dist.ReduceOp.MAX)
        ctx.save_for_backward(h, table, t, top, sums)
        ctx.rows, ctx.dtype = rows, dtype
        return losses, hits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        h, table, t, top, sums = ctx.saved_tensors
        rows = ctx.rows
        # Each rank's loss is its own tokens': the gradient of every rank's tokens, summed.
        grad = _all_reduce(grad.contiguous(), rows) * (t != IGNORE)
        probs = (_logits(h, table, ctx.dtype) - top[:, None]).exp() / sums[:, None]
        mine = (t >= rows.start) & (t < rows.stop)
        probs[mine.nonzero()[:, 0], t[mine] - rows.start] -= 1.0
        scores = (probs * grad[:, None]).to(ctx.dtype)
        h_grad = (scores @ table.to(ctx.dtype)).to(h.dtype)
        table_grad = None
        if ctx.needs_input_grad[1]:
            table_grad = (scores.t() @ h.to(ctx.dtype)).to(table.dtype) / rows.world
        return h_grad, table_grad, None, None


def _logits(h: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(h.device.type, enabled=False):
        return F.linear(h.to(dtype), table.to(dtype)).float()


def _target_logits(logits: torch.Tensor, t: torch.Tensor, rows: Rows) -> torch.Tensor:
    mine = (t >= rows.start) & (t < rows.stop)
    picked = torch.zeros_like(logits[:, 0])
    picked[mine] = logits[mine.nonzero()[:, 0], t[mine] - rows.start]
    return _all_reduce(picked, rows)


def _all_reduce(x: torch.Tensor, rows: Rows, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(x, op=op, group=rows.group)
    return x
