"""B22 pipeline parallelism: parameter + gradient + optimizer bytes per rank and step time,
2 pipeline stages vs DDP and FSDP, and the pipeline's measured idle share against its bubble.

A GPT-2-small-shaped model (app.models.gpt: 12 blocks of width 768, 12 heads, an 8,192-token
vocabulary, the output head tied to the token embedding; a small GPT with --smoke) trained for
a few AdamW steps by 2 ranks of plain `torch.distributed` (gloo, `torch.multiprocessing.spawn`),
one thread each, on the same next-token batch: DDP and FSDP through the project's
app.train.parallel.parallelize, the pipeline through app.train.pipelining.Pipeline (2 stages, 1F1B,
4 microbatches). Each rank counts its local bytes of parameters, gradients and optimizer state
after a step (the tied embedding counts on both stages that hold it); the largest rank counts.
Step times are medians of the steps after the first. The pipeline's idle share: one minus the
time its rank computes (its stages' forward and backward over each microbatch, timed alone)
over the step, against the schedule's bubble (p-1)/(m+p-1) for p stages and m microbatches.
Goal: the pipeline's bytes per rank <= 0.6x DDP's.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Bench, bench_main, free_port, rank_bytes, ratio, wait_for_quiet

ID = "B22"
GOAL = "pipeline (2 stages) parameter + gradient + optimizer bytes per rank <= 0.6x DDP's"
WHAT = "pipeline parallelism: bytes per rank and step time vs DDP and FSDP, idle share, 2 ranks"
WORLD, MICROBATCHES, SCHEDULE = 2, 4, "1f1b"
FULL = {"vocab_size": 8192, "block_size": 128, "dim": 768, "layers": 12, "heads": 12}
SMOKE = {"vocab_size": 512, "block_size": 32, "dim": 64, "layers": 4, "heads": 2}
BATCH = {"full": (8, 64, 4), "smoke": (8, 16, 2)}  # rows, tokens, steps


def build(size: dict[str, int]):
    from app.models.gpt import GPT

    return GPT(dropout=0.0, **size)


def _worker(rank: int, port: int, strategy: str, size: dict, batch: tuple, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows, tokens, steps = batch
    ids = torch.randint(0, size["vocab_size"], (rows, tokens + 1), generator=_seeded(0))
    step, parameters, extra = _trainer(strategy, size, ids, rank)
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        optimizer.step()
        times.append(time.perf_counter() - start)
        held = _bytes(parameters, optimizer)  # before zero_grad: gradients still held
        optimizer.zero_grad(set_to_none=True)
    record = {"rank": rank, **held, "steady_step_s": statistics.median(times[1:]), **extra()}
    Path(out, f"{strategy}-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _seeded(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _trainer(strategy: str, size: dict, ids, rank: int):
    """(step, parameters, extra record fields) for one strategy on this rank."""
    import torch

    from app.config import TrainConfig
    from app.tasks.lm.train import next_token_loss, token_loss
    from app.train.parallel import parallelize
    from app.train.pipelining import Mesh, Pipeline

    if strategy != "pipeline":
        model = parallelize(build(size), TrainConfig(strategy=strategy), torch.device("cpu"))
        share = ids.chunk(WORLD)[rank]  # data parallel: each rank half the batch

        def step() -> None:  # the task's loss, as a Train worker computes it
            next_token_loss(model, {"input_ids": share}, torch.device("cpu"))[0].backward()

        return step, list(model.parameters()), dict

    pipe = Pipeline(
        build(size),
        Mesh(WORLD, WORLD, rank),
        SCHEDULE,
        MICROBATCHES,
        token_loss,
        torch.device("cpu"),
    )
    return (
        lambda: pipe.step({"input_ids": ids[:, :-1]}, ids[:, 1:]),
        pipe.parameters(),
        lambda: {"compute_s": _compute_seconds(pipe, ids, size)},
    )


def _compute_seconds(pipe, ids, size: dict) -> float:
    """This rank's stages' forward and backward over every microbatch, with no communication
    (median of 3): what the rank would spend on a step if it never waited."""
    import torch

    micro = ids[:, :-1].chunk(MICROBATCHES)
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for x in micro:
            for stage in pipe.stages:
                inputs = x if stage.first else torch.randn(*x.shape, size["dim"])
                inputs.requires_grad_(not stage.first)
                out = stage(input_ids=inputs) if stage.first else stage(inputs)
                out.float().sum().backward()
        runs.append(time.perf_counter() - start)
    for param in pipe.parameters():
        param.grad = None
    return statistics.median(runs)


def _bytes(parameters, optimizer) -> dict[str, int]:
    from app.train.materialise import local_bytes

    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    held = {
        "params": sum(local_bytes(p) for p in parameters),
        "grads": sum(local_bytes(p.grad) for p in parameters if p.grad is not None),
        "optimizer": sum(local_bytes(v) for v in state),
    }
    return held | {"total": sum(held.values())}


def measure(strategy: str, size: dict, batch: tuple, work: Path) -> dict[str, Any]:
    args = (free_port(), strategy, size, batch, str(work))
    return rank_bytes(_worker, args, WORLD, work, strategy)


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    size, batch = (SMOKE, BATCH["smoke"]) if smoke else (FULL, BATCH["full"])
    parameters = sum(p.numel() for p in build(size).parameters())
    load = wait_for_quiet(0.0 if smoke else 120.0)
    results = {s: measure(s, size, batch, work) for s in ("ddp", "fsdp", "pipeline")}
    total = {s: r["bytes_per_rank"]["total"] for s, r in results.items()}
    value = ratio(total["pipeline"], total["ddp"])
    pipe = results["pipeline"]
    idle = max(1 - r["compute_s"] / r["steady_step_s"] for r in pipe["ranks"])
    bubble = (WORLD - 1) / (MICROBATCHES + WORLD - 1)
    step = {s: r["steady_step_s"] for s, r in results.items()}
    summary = (
        f"{parameters / 1e6:.1f}M-parameter GPT, {WORLD} ranks, bytes per rank: DDP "
        f"{total['ddp'] / 2**20:.0f} MiB, FSDP {total['fsdp'] / 2**20:.0f}, pipeline "
        f"{total['pipeline'] / 2**20:.0f} (x{value:.3f} DDP's); step: DDP {step['ddp']:.2f} s, "
        f"FSDP {step['fsdp']:.2f} s, pipeline {step['pipeline']:.2f} s; pipeline idle "
        f"{idle:.2f} of a step (bubble {bubble:.2f})"
    )
    details = {
        "parameters": parameters,
        "model": size,
        "rows_tokens_steps": batch,
        "schedule": SCHEDULE,
        "microbatches": MICROBATCHES,
        "world_size": WORLD,
        "load_average_at_start": load,
        "pipeline_idle_share": idle,
        "bubble_share": bubble,
        "pipeline_step_vs_fsdp": ratio(step["pipeline"], step["fsdp"]),
        **results,
    }
    return bench.result(
        "pipeline_vs_ddp_bytes_per_rank", value, bool(value <= 0.6), details, summary
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
