"""B26 peak memory per rank of a whole sharded run: a GPT-2-shaped model of about 350M
parameters fine-tuned from a generated safetensors folder by 2 ranks under FSDP and pipeline
stages, against DDP and against the model's own training state.

The folder is GPT-2 medium's shape (24 blocks of width 1024, 16 heads, the 50,257-row
embedding tied to the output head; a 10M-parameter GPT-2 for the fixed overhead and with
--smoke), written by transformers' `save_pretrained` with random weights. Each of 2 ranks of plain
`torch.distributed` (gloo, `torch.multiprocessing.spawn`, one thread each) runs what a Ray Train
worker runs: DDP builds the model whole, loads the folder and wraps it (app.train.parallel);
FSDP and pipeline build it on the meta device and materialise only the rank's part, reading
only its slices of the folder (app.train.worker.sharded_model); then 3 AdamW steps on 2 rows of
32 tokens, then the consolidated `model.safetensors` (DDP: rank 0's `save_model`; sharded:
written tensor by tensor, app.train.consolidate). FSDP keeps the embedding table, tied to the
head, sharded by rows (app/train/vocab_parallel.py); `fsdp-gathered-vocab` lets FSDP2 gather it
whole like any parameter (`train.shard_vocab=false`); `fsdp-whole` is the path sharded runs took
before: every rank builds the whole model and loads every weight, then shards, and saves by
gathering a full state dict into a plain copy. The figure is each rank process's peak resident
memory over the whole run (VmHWM; the largest rank counts), with the peak after each
phase beside it. The model's training state is its fp32 weights + gradients + AdamW's two
moments (16 bytes a parameter); the fixed overhead is the same run's peak for the 10M model
(interpreter, torch, gloo, activations of the small model).
Goal: peak per rank <= 0.6x the whole model's training state + the fixed overhead (FSDP and
pipeline).
"""

from __future__ import annotations

import json
import math
import os
import time
import types
from pathlib import Path
from typing import Any

from bench.common import Bench, bench_main, free_port, ratio, wait_for_quiet

ID = "B26"
GOAL = "peak RSS per rank <= 0.6x the model's training state + a 10M model's peak (FSDP, pipeline)"
WHAT = "sharded run's peak memory per rank: 350M GPT-2 from a folder, 2 ranks"
WORLD, SEED, STEPS, ROWS, TOKENS = 2, 0, 3, 2, 32
MEDIUM = {"n_embd": 1024, "n_layer": 24, "n_head": 16}  # GPT-2 medium, 50,257-row vocabulary
SMALL = {"n_embd": 384, "n_layer": 4, "n_head": 6, "vocab_size": 8192}  # about 10M
STRATEGIES = ("ddp", "fsdp", "pipeline", "fsdp-gathered-vocab", "fsdp-whole")


def make_folder(folder: str, sizes: dict[str, int]) -> str:
    from tools.make_tiny_pretrained import make_gpt2

    return make_gpt2(folder, sizes=sizes)


def _peak() -> int:
    """This process's peak resident memory: its address space's high-water mark (VmHWM),
    which starts afresh at exec (`ru_maxrss` would carry the spawning parent's peak)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _worker(rank: int, port: int, strategy: str, folder: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from app.train.finetune import adamw

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    phases = {"started": _peak()}
    start = time.perf_counter()
    model, t, build = _model(strategy, folder)
    phases["built_and_loaded"] = _peak()
    optimizer = adamw(model, t)  # the training loop's own
    ids = torch.randint(0, 8192, (ROWS, TOKENS + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(STEPS):
        _step(model, strategy, ids, rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    phases["trained"] = _peak()
    _save(model, strategy, build, os.path.join(out, f"{strategy}-model.safetensors"), rank)
    phases["saved"] = _peak()
    record = {"rank": rank, "peak_rss": _peak(), "phases": phases}
    record["seconds"] = time.perf_counter() - start
    Path(out, f"{strategy}-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _model(strategy: str, folder: str):
    import torch

    from app.config import ModelConfig, TrainConfig
    from app.models import load_pretrained
    from app.models.families import family_of
    from app.models.init import initialise
    from app.pretrained import open_pretrained
    from app.tasks.lm.train import shifted, token_loss
    from app.train.parallel import parallelize
    from app.train.pipelining import Scoring
    from app.train.worker import sharded_model

    base = open_pretrained(folder)
    pre = types.SimpleNamespace(state={"pretrained": base.record()})
    family = family_of(base)  # GPT-2 here; any family's folder is measured the same way

    def build(meta: bool = False, base_weights: bool = False) -> torch.nn.Module:
        with torch.device("meta") if meta else torch.device("cpu"):
            model = family.build(base.config, pre, ModelConfig(dropout=0.0))
        if not meta:
            initialise(model, SEED)
            if base_weights:
                load_pretrained(model, pre)  # type: ignore[arg-type]
        return model

    kind = strategy.removesuffix("-whole").removesuffix("-gathered-vocab")
    pipeline = {"stages": WORLD, "schedule": "1f1b", "microbatches": ROWS}
    t = TrainConfig(
        strategy=kind, seed=SEED, num_workers=WORLD, batch_size=ROWS, pipeline=pipeline, lr=1e-5,
        shard_vocab=not strategy.endswith("-gathered-vocab"),
    )  # fmt: skip
    scoring = Scoring(shifted, token_loss)
    cpu = torch.device("cpu")
    if kind == "ddp" or strategy.endswith("-whole"):
        return parallelize(build(base_weights=True), t, cpu, scoring), t, build
    return sharded_model(build, t, cpu, scoring, pre), t, build  # type: ignore[arg-type]


def _step(model, strategy: str, ids, rank: int) -> None:
    """The task's loss and backward, as a Train worker runs them."""
    import torch

    from app.tasks.lm.train import next_token_loss

    if strategy == "pipeline":
        model.train_step({"input_ids": ids}, sync=True)
        return
    share = ids.chunk(WORLD)[rank]  # data parallel: each rank half the batch
    next_token_loss(model, {"input_ids": share}, torch.device("cpu"))[0].backward()


def _save(model, strategy: str, build, path: str, rank: int) -> None:
    from safetensors.torch import save_model

    from app.train.checkpoint import unwrap
    from app.train.consolidate import write_consolidated

    if strategy == "ddp":
        if rank == 0:
            save_model(unwrap(model), path)
    elif strategy == "fsdp-whole":  # as sharded runs saved before: a full gather, a plain copy
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)
        if rank == 0:
            plain = build()
            plain.load_state_dict(full)
            save_model(plain, path)
    else:
        write_consolidated(path if rank == 0 else None, model)


def measure(strategy: str, folder: str, work: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), strategy, folder, str(work)), nprocs=WORLD, join=True)
    ranks = [json.loads((work / f"{strategy}-rank{r}.json").read_text()) for r in range(WORLD)]
    (work / f"{strategy}-model.safetensors").unlink(missing_ok=True)
    return {"peak_rss": max(r["peak_rss"] for r in ranks), "ranks": ranks}


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    sizes = {"overhead": SMALL} if smoke else {"overhead": SMALL, "model": MEDIUM}
    folders = {k: make_folder(str(work / k), s) for k, s in sizes.items()}
    load = wait_for_quiet(0.0 if smoke else 120.0)
    results: dict[str, dict[str, Any]] = {}
    for key, folder in folders.items():
        results[key] = {s: measure(s, folder, work) for s in STRATEGIES}
    measured = results.get("model", results["overhead"])
    parameters = _parameters(folders.get("model", folders["overhead"]))
    state = 16 * parameters
    allowed = {s: 0.6 * state + results["overhead"][s]["peak_rss"] for s in STRATEGIES}
    value = max(ratio(measured[s]["peak_rss"], allowed[s]) for s in ("fsdp", "pipeline"))
    gib = {s: measured[s]["peak_rss"] / 2**30 for s in STRATEGIES}
    summary = (
        f"{parameters / 1e6:.0f}M-parameter GPT-2 from a folder, {WORLD} ranks, peak RSS per "
        f"rank: DDP {gib['ddp']:.2f} GiB, FSDP {gib['fsdp']:.2f}, pipeline {gib['pipeline']:.2f} "
        f"(FSDP gathering the vocabulary table {gib['fsdp-gathered-vocab']:.2f}, building and "
        f"loading the whole model {gib['fsdp-whole']:.2f}); training "
        f"state {state / 2**30:.2f} GiB; x{value:.2f} of the allowance"
    )
    details = {
        "parameters": parameters,
        "training_state_bytes": state,
        "allowance_bytes": allowed,
        "model": MEDIUM,
        "overhead_model": SMALL,
        "rows_tokens_steps": (ROWS, TOKENS, STEPS),
        "world_size": WORLD,
        "load_average_at_start": load,
        **results,
    }
    return bench.result("peak_rss_vs_allowance", value, bool(value <= 1.0), details, summary)


def _parameters(folder: str) -> int:
    from app.pretrained import safetensors_shapes

    shapes = safetensors_shapes(os.path.join(folder, "model.safetensors"), ValueError)
    return sum(math.prod(shape) for shape in shapes.values())


if __name__ == "__main__":
    bench_main(run, __doc__)()
