"""Pipeline parallelism: a transformer's blocks split into stages across ranks, each rank
holding only its stages' parameters, on `torch.distributed.pipelining` (gloo on CPU, NCCL on
GPU). No Ray here: Ray Train workers and plain `torch.distributed` processes call the same
functions, as with app/train/parallel.py.

- A model family divides into a `Split` (app/train/splits.py): what the first stage holds and
  runs before the blocks, how one block runs, what the last stage runs after them.
- `block_ranges` places the blocks: evenly, or at the given split points.
- With more ranks than stages the ranks form a 2-D mesh (`Mesh`): `stages` ranks in a row run one
  pipeline, the ranks holding the same stage in every row average their gradients (data
  parallelism).
- A parameter two stages share (GPT-2's token embedding, which is also its output head) lives on
  both; each computes its own part of the gradient and the two are summed after each step, so
  the copies stay equal.
- Schedules: GPipe, 1F1B and interleaved 1F1B (`VIRTUAL_STAGES` stages a rank). Each
  microbatch's mean loss is weighed by the target elements it counts, over the batch's and
  the optimizer step's accumulated batches, so a step's loss and gradients are those of the
  whole batch through the unsplit model. A short batch (an epoch's last) is filled to the
  stages' shape with its last row, the added rows' targets `IGNORE`: every row counts once.
- `PipelinedModel` is what a Ray Train rank trains (`train.strategy: pipeline`): its stages'
  modules under the model's names, so optimizer groups, state dicts and sharded checkpoints
  name parameters as the unsplit model does (a run resumes at another stage count), plus the
  training step, a microbatch-free forward pass for validation and the global gradient norm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app.config import TrainConfig
from app.train.blocks import block_container
from app.train.materialise import materialise_held, on_meta
from app.train.splits import Split, State, split_of

log = logging.getLogger(__name__)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# Interleaved 1F1B holds this many stages a rank (stage r, r + ranks, ...): its bubble shrinks
# with each, and each adds a send per microbatch.
VIRTUAL_STAGES = 2
# (output, target) -> the mean loss over the target elements that are not IGNORE
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
IGNORE = -100  # a padded row's target: F.cross_entropy's default ignore_index skips it
Batch = dict[str, torch.Tensor]
# A batch's inputs to the first stage, by the model's argument names, and the last's target.
Scored = tuple[Batch, torch.Tensor]


@dataclass(frozen=True)
class Scoring:
    """What a task gives a pipeline: a batch's inputs and target (`inputs`), and the loss
    between the last stage's output and the target."""

    inputs: Callable[[Batch], Scored]
    loss: LossFn


def block_ranges(blocks: int, stages: int, split_points: Sequence[int] = ()) -> list[range]:
    """The blocks each stage runs: `stages` contiguous ranges, even (the first stages take
    one more when they do not divide), or starting at each of `split_points`."""
    if not 2 <= stages <= blocks:
        raise ValueError(f"train.pipeline: {stages} stages for a model of {blocks} blocks")
    if split_points:
        points = list(split_points)
        inside = points and points[0] > 0 and points[-1] < blocks
        if len(points) != stages - 1 or points != sorted(set(points)) or not inside:
            raise ValueError(
                f"train.pipeline.split_points={points}: {stages - 1} increasing block indices "
                f"between 1 and {blocks - 1} (the first block of each stage after the first)"
            )
        bounds = [0, *points, blocks]
    else:
        size, extra = divmod(blocks, stages)
        bounds = [0]
        for i in range(stages):
            bounds.append(bounds[-1] + size + (i < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class Stage(nn.Module):
    """The part of a model one stage runs. Its parameters keep the model's names (the blocks
    under their own indices), so the stages' state dicts together are the model's."""

    def __init__(
        self, model: nn.Module, split: Split, container: str, blocks: range, first: bool, last: bool
    ):
        super().__init__()
        self.split, self.first, self.last = split, first, last
        for name in (split.first if first else ()) + (split.last if last else ()):
            setattr(self, name, getattr(model, name))
        every = getattr(model, container)  # the model's blocks, under the model's name
        setattr(self, container, nn.ModuleDict({str(i): every[i] for i in blocks}))
        self._blocks = list(getattr(self, container).values())

    def forward(self, *args: torch.Tensor, **inputs: torch.Tensor) -> Any:
        """The first stage takes the model's inputs by name, the others the state before them
        (positional, as the schedule sends it); the last returns the model's output."""
        state: State = self.split.embed(self, **inputs) if self.first else args
        for block in self._blocks:
            state = self.split.block(block, state)
        if self.last:
            return self.split.finish(self, state)
        return state[0] if len(state) == 1 else state


def _block_container(model: nn.Module) -> str:
    name = block_container(model)
    if name is None:
        raise ValueError(f"train.strategy=pipeline: {type(model).__name__} has no blocks to split")
    return name


def check_split(model: nn.Module, t: TrainConfig) -> None:
    """Raise ValueError (one line) unless `t.pipeline` can split `model` (the meta model the
    driver builds, before any worker starts)."""
    split_of(model)
    blocks = len(getattr(model, _block_container(model)))
    block_ranges(
        blocks, stage_count(t.pipeline.stages, t.pipeline.schedule), t.pipeline.split_points
    )


def stage_count(ranks: int, schedule: str) -> int:
    """Stages the model splits into: one a rank, `VIRTUAL_STAGES` a rank when interleaved."""
    return ranks * (VIRTUAL_STAGES if schedule == "interleaved_1f1b" else 1)


@dataclass(frozen=True)
class Mesh:
    """Ranks as rows of `stages`: row k runs pipeline k (ranks k*stages .. k*stages+stages-1);
    the ranks holding one stage in every row are its data-parallel group."""

    stages: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        if self.world % self.stages:
            raise ValueError(
                f"train.pipeline.stages={self.stages}: the {self.world} workers must be a "
                "multiple of the stages"
            )

    @property
    def stage_rank(self) -> int:
        return self.rank % self.stages

    @property
    def rows(self) -> int:
        return self.world // self.stages

    @property
    def row(self) -> int:
        return self.rank // self.stages

    def pipeline_ranks(self, row: int) -> list[int]:
        return [row * self.stages + s for s in range(self.stages)]

    def data_ranks(self, stage_rank: int) -> list[int]:
        return [r * self.stages + stage_rank for r in range(self.rows)]


class Pipeline:
    """This rank's stages of a model, the schedule that runs them, and the gradient sums a step
    needs. A model built on the meta device has only this rank's stages allocated and drawn
    (from `seed`, as a whole build draws them: app/train/materialise.py); of one built whole,
    every rank keeps its stages' parts (the rest is freed once the caller drops the model)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        schedule: str,
        microbatches: int,
        loss_fn: LossFn,
        device: torch.device,
        split_points: Sequence[int] = (),
        accumulation: int = 1,
        rows: int | None = None,
        seed: int = 0,
    ):
        from torch.distributed.pipelining import PipelineStage

        if schedule not in SCHEDULES:
            raise ValueError(f"train.pipeline.schedule={schedule!r}: one of {', '.join(SCHEDULES)}")
        split, self.mesh, self.device = split_of(model), mesh, device
        self.count = count = stage_count(mesh.stages, schedule)
        container = _block_container(model)
        ranges = block_ranges(len(getattr(model, container)), count, split_points)
        self.groups = _groups(mesh)
        self.indices = indices = list(range(mesh.stage_rank, count, mesh.stages))
        self.tied = _tied_names(model, split)  # before materialising unties them

        def stages() -> list[Stage]:
            return [
                Stage(model, split, container, ranges[i], i == 0, i == count - 1) for i in indices
            ]

        self.stages = stages()
        if on_meta(model):  # built on the meta device: allocate and draw this rank's stages only
            held = {
                name
                for stage in self.stages
                for name, _ in (
                    *stage.named_parameters(remove_duplicate=False),
                    *stage.named_buffers(remove_duplicate=False),  # non-persistent ones too
                )
            }
            made = materialise_held(model, held, device, seed)
            log.info("materialised this rank's stages: %s", made)
            self.stages = stages()  # over the allocated tensors
        self.stages = [stage.to(device) for stage in self.stages]
        pipes = [
            PipelineStage(stage, i, count, device, group=self.groups.pipeline)
            for stage, i in zip(self.stages, indices, strict=True)
        ]
        # A microbatch's mean loss weighs by the target elements it counts over the batch's
        # (times the `accumulation` batches of an optimizer step), so a step's loss is the
        # batch's mean however padding falls; the schedule leaves the gradients as they are:
        # its own division by the microbatches would also divide what an earlier batch left.
        self.rows, self.accumulation, self.counted = rows, accumulation, 1

        def share(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            counted = int((target != IGNORE).sum())
            if not counted:  # padding only: no loss, and still a graph to run backward through
                return output.sum() * 0.0
            return loss_fn(output, target) * (counted / self.counted)

        self.schedule = _schedule(schedule, pipes, microbatches, share)

    @property
    def holds_input(self) -> bool:
        return self.mesh.stage_rank == 0

    @property
    def holds_output(self) -> bool:
        return self.mesh.stage_rank == self.mesh.stages - 1

    def parameters(self) -> list[nn.Parameter]:
        return [p for stage in self.stages for p in stage.parameters()]

    def step(self, inputs: Batch, targets: torch.Tensor, sync: bool = True) -> torch.Tensor | None:
        """Forward and backward of one batch over every stage (gradients accumulate in this
        rank's parameters; with `sync`, the last batch of an optimizer step, they are summed
        over tied copies and averaged over the data-parallel rows). Returns the batch's mean
        loss on the rank holding the last stage, None elsewhere."""
        inputs, targets = self._padded(inputs, targets)
        self.counted = int((targets != IGNORE).sum()) * self.accumulation
        losses: list[torch.Tensor] = []
        named = self._on_device(inputs) if self.holds_input else {}
        target = targets.to(self.device) if self.holds_output else None
        self.schedule.step(target=target, losses=losses, return_outputs=False, **named)
        if sync:
            self._sum_tied()
            self._average_rows()
        if not losses:
            return None
        return torch.stack(losses).sum().detach() * self.accumulation

    def _padded(self, inputs: Batch, targets: torch.Tensor) -> tuple[Batch, torch.Tensor]:
        """A short batch (an epoch's last) filled to the stages' shape, the first batch's or
        `rows`: its last row repeated, the added rows' targets IGNORE, so that every row
        counts and only once."""
        self.rows = rows = self.rows or len(targets)
        missing = rows - len(targets)
        if missing < 0:
            raise ValueError(f"a batch of {len(targets)} rows; the pipeline's stages take {rows}")
        if not missing:
            return inputs, targets
        filled = {
            k: torch.cat([v, v[-1:].expand(missing, *v.shape[1:])]) for k, v in inputs.items()
        }
        ignored = torch.full((missing, *targets.shape[1:]), IGNORE, dtype=targets.dtype)
        return filled, torch.cat([targets, ignored.to(targets.device)])

    @torch.no_grad()
    def forward(self, inputs: Batch) -> torch.Tensor | None:
        """One batch through every stage in order, without microbatches (validation: any
        batch size). Every rank of a row calls it with the same batch; the output is on the
        rank holding the last stage, None elsewhere."""
        ranks = self.mesh.pipeline_ranks(self.mesh.row)
        named = self._on_device(inputs)
        out: Any = None
        for index, stage in zip(self.indices, self.stages, strict=True):
            if index == 0:
                out = stage(**named)
            else:
                out = stage(*_receive(ranks[(index - 1) % self.mesh.stages], self.device))
            if index < self.count - 1:
                _send(
                    out if isinstance(out, tuple) else (out,), ranks[(index + 1) % self.mesh.stages]
                )
        return out if self.holds_output else None

    def _on_device(self, inputs: Batch) -> Batch:
        return {k: v.to(self.device) for k, v in inputs.items()}

    def row_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss, on every rank of its row (for progress lines and totals)."""
        value = torch.zeros((), device=self.device) if loss is None else loss.float()
        last = self.mesh.pipeline_ranks(self.mesh.row)[-1]
        dist.broadcast(value, src=last, group=self.groups.pipeline)
        return value

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every stage's gradients so that the model's global gradient norm is at most
        `max_norm` (a tied parameter counted once); returns the norm before clipping."""
        twins = {n for names in self.tied for n in names} if not self.holds_input else set()
        grads = [
            p.grad
            for n, p in self.named_parameters().items()
            if p.grad is not None and n not in twins
        ]
        square = torch.zeros((), device=self.device)
        for grad in grads:
            square += grad.detach().float().pow(2).sum()
        dist.all_reduce(square, group=self.groups.pipeline)
        norm = square.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in self.parameters():
            if param.grad is not None:
                param.grad.mul_(scale.to(param.grad.dtype))
        return norm

    def _sum_tied(self) -> None:
        if self.groups.tied is None:
            return
        held = dict(self.named_parameters())
        for names in self.tied:
            param = next(held[n] for n in names if n in held)
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.groups.tied)

    def _average_rows(self) -> None:
        if self.groups.data is None:
            return
        for param in self.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.groups.data)
                param.grad /= self.mesh.rows

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for stage in self.stages for n, p in stage.named_parameters()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of the model's state dict, under the model's names."""
        return {k: v for stage in self.stages for k, v in stage.state_dict().items()}


class PipelinedModel(nn.Module):
    """What one rank trains under `train.strategy: pipeline`: its stages' modules registered
    under the model's own names, the schedule's training step, and validation's forward pass
    (the output on the rank holding the last stage, None elsewhere)."""

    def __init__(self, pipeline: Pipeline, inputs: Callable[[Batch], Scored]):
        super().__init__()
        for stage in pipeline.stages:
            for name, param in stage.named_parameters(recurse=False):  # ViT's class token
                self.register_parameter(name, param)
            for name, child in stage.named_children():
                held = self._modules.get(name)
                if isinstance(child, nn.ModuleDict):  # blocks: a fresh dict over every stage's
                    before = dict(held.items()) if isinstance(held, nn.ModuleDict) else {}
                    child = nn.ModuleDict({**before, **child})
                setattr(self, name, child)
        self.pipeline, self.inputs = pipeline, inputs

    @property
    def holds_output(self) -> bool:
        return self.pipeline.holds_output

    def train_step(self, batch: Batch, sync: bool) -> tuple[torch.Tensor, int]:
        """Forward and backward of a batch; its mean loss (on every rank of the row) and rows."""
        inputs, targets = self.inputs(batch)
        loss = self.pipeline.step(inputs, targets, sync)
        return self.pipeline.row_loss(loss), len(targets)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor | None:
        """Validation's pass: the model's inputs, by its own forward's argument names."""
        return self.pipeline.forward(inputs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.pipeline.clip_grad_norm_(max_norm)


def pipelined(
    model: nn.Module, t: TrainConfig, device: torch.device, scoring: Scoring
) -> PipelinedModel:
    """This rank's `PipelinedModel` of `model` under `t.pipeline` (a collective: every rank of
    the default process group calls it); gradients accumulated over an optimizer step's
    `t.grad_accum_steps` batches are their mean's."""
    p = t.pipeline
    mesh = Mesh(p.stages, dist.get_world_size(), dist.get_rank())
    pipeline = Pipeline(
        model,
        mesh,
        p.schedule,
        p.microbatches,
        scoring.loss,
        device,
        p.split_points,
        accumulation=t.grad_accum_steps,
        rows=t.batch_size,
        seed=t.seed,
    )
    return PipelinedModel(pipeline, scoring.inputs)


# A stage's state crosses in validation's forward pass as a count, then per tensor a header
# (dtype, rank, shape) and the tensor: the receiver knows none of them beforehand.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)
_HEADER = 8


def _send(state: State, dst: int) -> None:
    device = state[0].device
    dist.send(torch.tensor([len(state)], device=device), dst)
    for x in state:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
        header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
        header[2 : 2 + x.dim()] = torch.tensor(x.shape)
        dist.send(header, dst)
        dist.send(x.contiguous(), dst)


def _receive(src: int, device: torch.device) -> State:
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src)
    state = []
    for _ in range(int(count)):
        header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, src)
        dtype, dims = _DTYPES[int(header[0])], int(header[1])
        x = torch.empty(header[2 : 2 + dims].tolist(), dtype=dtype, device=device)
        dist.recv(x, src)
        state.append(x)
    return tuple(state)


@dataclass(frozen=True)
class _Groups:
    pipeline: Any  # this rank's row
    data: Any  # this rank's stage in every row (None with one row)
    tied: Any  # this row's first and last rank (None when nothing is tied)


def _groups(mesh: Mesh) -> _Groups:
    """Every process group of the mesh, created on every rank in the same order (a collective)."""
    pipeline = data = tied = None
    for row in range(mesh.rows):
        ranks = mesh.pipeline_ranks(row)
        group = dist.new_group(ranks)
        ends = dist.new_group([ranks[0], ranks[-1]])
        if row == mesh.row:
            pipeline = group
            tied = ends if mesh.stage_rank in (0, mesh.stages - 1) else None
    for stage_rank in range(mesh.stages):
        group = dist.new_group(mesh.data_ranks(stage_rank))
        if stage_rank == mesh.stage_rank and mesh.rows > 1:
            data = group
    return _Groups(pipeline, data, tied)


def _tied_names(model: nn.Module, split: Split) -> list[tuple[str, ...]]:
    """Names of each parameter the first and the last stage both hold (all its names)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    def held(attrs: tuple[str, ...]) -> set[int]:
        held: set[int] = set()
        for value in (getattr(model, a) for a in attrs):
            if isinstance(value, nn.Parameter):  # a bare parameter (ViT's class token)
                held.add(id(value))
            elif value is not None:  # a module; None: an optional part the model lacks
                held.update(id(p) for p in value.parameters())
        return held

    shared = held(split.first) & held(split.last)
    return [tuple(names[i]) for i in shared]


def _schedule(name: str, stages: list[Any], microbatches: int, loss_fn: LossFn) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return single(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
