"""Plain PyTorch DDP training of a workload: the baseline that B1 and B9 hold Ray against.

    python -m bench.ddp_train --config configs/digits.yaml [overrides] --summary-file F
        [--loader-workers 1]

What a user without Ray would write: fit the preprocessor on the driver (as app.train.driver does),
`torch.multiprocessing.spawn` one gloo process per `train.num_workers`, each reading its equal
share of the prepared shards through a torch DataLoader with its own worker process(es)
(bench.torch_data), and running the project's own Ray-free epoch (app.train.loop.train_epoch /
app.tasks.classify.train.validate_classifier), so only the data path and Ray differ from `python -m jobs.train`. No
checkpoints (the Ray side uploads them asynchronously, outside the timed loop). The summary has
the train summary's timing keys: `epoch_seconds` (steady median), `epoch_seconds_history`,
`data_wait_fraction`, `first_step_at`, `metrics.val_accuracy`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

from bench.common import free_port, train_files


def _worker(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from app.config import validate
    from app.data import kinds
    from app.registry import task_for_dataset
    from app.train.loop import epoch_batches, order_seed, train_epoch
    from app.train.parts import LOSS, VALIDATE
    from bench.common import inprocess_state
    from bench.torch_data import TorchShard

    config = validate(spec["config"])
    t = config.train
    torch.set_num_threads(t.torch_threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pre = kinds.from_json(spec["preprocessor"])
    task = task_for_dataset(pre.kind)  # the run's loss and validation, as the Ray workers'
    validate_task = functools.partial(task.part(VALIDATE), reference=spec["reference_metrics"])
    state = inprocess_state(config, pre, spec["train_rows"], world)
    torch.manual_seed(t.seed + rank)
    state.model = torch.nn.parallel.DistributedDataParallel(state.model)
    device = torch.device("cpu")
    loaders = spec["loader_workers"]
    train = TorchShard(spec["train_files"], pre, rank, world, loaders, t.shuffle_buffer)
    val = TorchShard(spec["val_files"], pre, rank, world, loaders)
    epochs = []
    for epoch in range(1, t.epochs + 1):
        seed = order_seed(t.seed, epoch, rank)  # as app.train.worker.train_loop
        batches = epoch_batches(train, t.batch_size, seed, config, state.step)
        stats = train_epoch(state, batches, device, 0, task.part(LOSS))
        stats.update(validate_task(state.model, val.batches(t.batch_size * 4), device, "fp32"))
        state.end_epoch(epoch)
        epochs.append(stats)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"epochs": epochs, "first": state.first_step_at}))
    dist.destroy_process_group()


def reference_metrics(config, manifest, pre) -> dict[str, float]:
    from app.registry import task_for_dataset
    from app.train.parts import REFERENCE

    task = task_for_dataset(pre.kind)
    return task.part(REFERENCE)(config, manifest, pre) if task.has(REFERENCE) else {}


def run(config, loader_workers: int, out: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from app.config import dump
    from app.data.prepare import read_manifest
    from app.train.loop import steady_median
    from app.train.preprocessing import fit_preprocessor

    manifest = read_manifest(config.data_output)
    pre = fit_preprocessor(config, manifest)
    spec = {
        "config": dump(config),
        "preprocessor": pre.to_json(),
        "reference_metrics": reference_metrics(config, manifest, pre),
        "train_rows": manifest["rows"]["train"],
        "train_files": train_files(config, manifest, "train"),
        "val_files": train_files(config, manifest, "val"),
        "loader_workers": loader_workers,
        "out": out,
    }
    world = config.train.num_workers
    mp.spawn(_worker, args=(world, free_port(), spec), nprocs=world, join=True)
    result = json.loads(Path(out).read_text())
    seconds = [e["epoch_seconds"] for e in result["epochs"]]
    waits = [e["data_wait_fraction"] for e in result["epochs"]]
    return {
        "stage": "ddp_train",
        "num_workers": world,
        "epoch_seconds": steady_median(seconds),
        "epoch_seconds_history": seconds,
        "data_wait_fraction": steady_median(waits),
        "data_wait_history": waits,
        "first_step_at": result["first"],
        "metrics": {k: v for k, v in result["epochs"][-1].items() if k.startswith("val_")},
    }


def main(argv=None) -> None:
    from app.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--summary-file", required=True)
    p.add_argument("--loader-workers", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    config = load_config(args.config, args.overrides)
    summary = run(config, args.loader_workers, args.summary_file + ".epochs")
    Path(args.summary_file).write_text(json.dumps(summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
