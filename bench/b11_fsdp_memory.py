"""B11 sharded training memory: parameter + gradient + optimizer-state bytes per rank, FSDP vs DDP.

The same Transformer encoder (app.models.transformer, a few million parameters; the text
workload's size with --smoke) trained for a few AdamW steps by 2 ranks of plain
`torch.distributed` (gloo, `torch.multiprocessing.spawn`), wrapped by the project's own
app.train.parallel.parallelize with `train.strategy` ddp and then fsdp. Each rank counts its local
bytes (DTensor shards under FSDP) of parameters, gradients and optimizer state right after an
optimizer step (app.train.parallel.MemoryMeter, what the training log reports); the largest rank
counts. Steady step times are recorded beside (gloo on CPU: FSDP's all-gathers and
reduce-scatters cost more than DDP's one all-reduce; the point of FSDP is the memory).
Goal: FSDP's bytes per rank <= 0.55x DDP's with 2 ranks (ideal 0.5x; shards are padded).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Bench, bench_main, free_port, rank_bytes, ratio, wait_for_quiet

ID = "B11"
GOAL = "FSDP parameter + gradient + optimizer bytes per rank <= 0.55x DDP's (2 ranks)"
WHAT = "sharded training memory: FSDP vs DDP bytes per rank, 2 gloo ranks"
WORLD = 2
# TransformerClassifier's sizes, and the training steps measured.
FULL = {"dim": 256, "layers": 4, "heads": 4, "ff_dim": 1024, "vocab_size": 8000, "steps": 8}
SMOKE = {"dim": 128, "layers": 2, "heads": 4, "ff_dim": 256, "vocab_size": 1000, "steps": 3}


def build(size: dict[str, int]):
    from app.models.transformer import TransformerClassifier

    sizes = {k: v for k, v in size.items() if k != "steps"}
    return TransformerClassifier(num_classes=4, max_length=32, dropout=0.0, **sizes)


def _worker(rank: int, port: int, strategy: str, size: dict[str, int], out: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from app.config import TrainConfig
    from app.train.parallel import MemoryMeter, parallelize

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = parallelize(build(size), TrainConfig(strategy=strategy), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = MemoryMeter(model, optimizer)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, size["vocab_size"], (16, 32), generator=g)
    mask, labels = torch.ones_like(ids), torch.randint(0, 4, (16,), generator=g)
    times = []
    for _ in range(size["steps"]):
        start = time.perf_counter()
        F.cross_entropy(model(input_ids=ids, attention_mask=mask), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    record = {"rank": rank, **meter.peak, "steady_step_s": statistics.median(times[1:])}
    Path(out, f"{strategy}-rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def measure(strategy: str, size: dict[str, int], work: Path) -> dict[str, Any]:
    return rank_bytes(_worker, (free_port(), strategy, size, str(work)), WORLD, work, strategy)


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    size = SMOKE if smoke else FULL
    parameters = sum(p.numel() for p in build(size).parameters())
    load = wait_for_quiet(0.0 if smoke else 120.0)
    results = {strategy: measure(strategy, size, work) for strategy in ("ddp", "fsdp")}
    value = ratio(
        results["fsdp"]["bytes_per_rank"]["total"], results["ddp"]["bytes_per_rank"]["total"]
    )
    mib = {s: r["bytes_per_rank"]["total"] / 2**20 for s, r in results.items()}
    summary = (
        f"{parameters / 1e6:.1f}M-parameter Transformer, {WORLD} ranks: "
        f"DDP {mib['ddp']:.1f} MiB, FSDP {mib['fsdp']:.1f} MiB per rank (x{value:.3f})"
    )
    return bench.result(
        "fsdp_vs_ddp_bytes_per_rank",
        value,
        bool(value <= 0.55),
        {
            "parameters": parameters,
            "model": size,
            "world_size": WORLD,
            "load_average_at_start": load,
            **results,
        },
        summary,
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
