"""B3 precision: bf16 (torch.autocast) vs fp32 training-step throughput and final accuracy on CPU.

Throughput: one process, 1 torch thread, the project's step code (app.train.loop.autocast, the
TrainState optimizer and app.train.loop.optimizer_step) on a fixed real batch of each reference
workload (digits CNN, tabular MLP, text Transformer); fp32 and bf16 rounds alternate so that load
from other processes hits both alike; median of rounds. Accuracy: digits trained in-process with
each precision, same seed and epochs (bench.common.train_inprocess), validation accuracy at the end.

The goal (bf16 >= 1.5x fp32 on the digits CNN at its configured batch size) applies only where
the CPU has native bf16 (avx512_bf16 or AMX); elsewhere `met` is null.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    Bench,
    bench_config,
    bench_main,
    ensure_prepared,
    has_native_bf16,
    inprocess_state,
    median,
    ratio,
    train_inprocess,
)

ID = "B3"
WHAT = "precision: bf16 autocast vs fp32 training steps on CPU (throughput, accuracy)"
GOAL = "bf16 >= 1.5x fp32 steps/s where the CPU has avx512_bf16/AMX"
WORKLOADS = ("digits", "tabular", "text")


def fixed_batch(config, pre, batch_size: int) -> tuple[dict[str, Any], Any]:
    import torch

    from app.evaluate.held_out import labeled_batches

    inputs, labels = next(iter(labeled_batches(config, pre, "train", batch_rows=batch_size)))
    inputs = {
        k: torch.from_numpy(np.resize(v, (batch_size, *v.shape[1:]))) for k, v in inputs.items()
    }
    return inputs, torch.from_numpy(np.resize(labels, (batch_size,)))


def step_rate(config, pre, rows: int, batch, precision: str, seconds: float) -> float:
    """Training steps per second of app.train.driver's step code for one precision."""
    import torch
    import torch.nn.functional as F

    from app.train.loop import optimizer_step
    from app.train.steps import autocast

    config.train.precision = precision
    state = inprocess_state(config, pre, rows)
    state.model.train()
    device = torch.device("cpu")
    inputs, labels = batch

    def step() -> None:
        with autocast(device, precision):
            loss = F.cross_entropy(state.model(**inputs), labels)
        state.scaler.scale(loss).backward()
        optimizer_step(state)

    for _ in range(3):
        step()
    steps, start = 0, time.perf_counter()
    while steps < 5 or time.perf_counter() - start < seconds:
        step()
        steps += 1
    return steps / (time.perf_counter() - start)


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    import torch

    from app.train.preprocessing import fit_preprocessor

    bench = Bench(ID, GOAL, WHAT, out, smoke)
    torch.set_num_threads(1)
    rounds, seconds = (1, 0.3) if smoke else (3, 1.5)
    throughput: dict[str, Any] = {}
    for workload in WORKLOADS:
        config = bench_config(work, workload)
        manifest = ensure_prepared(config)
        pre = fit_preprocessor(config, manifest)
        sizes = [config.train.batch_size] if smoke else [config.train.batch_size, 256]
        for bs in sizes:
            batch = fixed_batch(config, pre, bs)
            rates: dict[str, list[float]] = {"fp32": [], "bf16": []}
            for _ in range(rounds):
                for precision in ("fp32", "bf16"):
                    rates[precision].append(
                        step_rate(config, pre, manifest["rows"]["train"], batch, precision, seconds)
                    )
            fp32, bf16 = median(rates["fp32"]), median(rates["bf16"])
            throughput[f"{workload}_batch{bs}"] = {
                "model": config.model.builder,
                "fp32_steps_per_s": fp32,
                "bf16_steps_per_s": bf16,
                "bf16_speedup": ratio(bf16, fp32),
                "rounds": rates,
            }
    epochs = 1 if smoke else 8
    accuracy = {}
    for precision in ("fp32", "bf16"):
        config = bench_config(work, "digits", f"train.epochs={epochs}")
        start = time.perf_counter()
        result = train_inprocess(config, precision=precision)
        accuracy[precision] = {
            "val_accuracy": result["metrics"]["val_accuracy"],
            "epochs": epochs,
            "train_s": time.perf_counter() - start,
        }
    drop = 100 * (accuracy["fp32"]["val_accuracy"] - accuracy["bf16"]["val_accuracy"])
    native = has_native_bf16()
    head_key = f"digits_batch{bench_config(work, 'digits').train.batch_size}"
    headline = throughput[head_key]["bf16_speedup"]
    met = bool(headline >= 1.5) if native else None
    details = {
        "native_bf16": native,
        "torch_threads": 1,
        "headline": head_key,
        "throughput": throughput,
        "accuracy": accuracy,
        "accuracy_drop_points": drop,
        "method": (
            "steps/s of forward+backward+AdamW step (app.train.driver code) on a fixed real batch; "
            f"{rounds} alternating rounds of >= {seconds}s per precision, median. bf16 = "
            "torch.autocast(cpu, bfloat16): matmuls/convs in bf16, weights and optimizer in fp32. "
            "Small models at batch 32 are bound by per-op overhead and the casts autocast adds, "
            "not by matmul throughput, so native bf16 units help only where compute dominates."
        ),
    }
    others = ", ".join(
        f"{k} x{v['bf16_speedup']:.2f}" for k, v in throughput.items() if k != head_key
    )
    summary = (
        f"bf16/fp32 steps/s digits CNN x{headline:.2f} ({others}); digits accuracy fp32 "
        f"{100 * accuracy['fp32']['val_accuracy']:.1f}% vs bf16 {100 * accuracy['bf16']['val_accuracy']:.1f}%"
    )
    return bench.result("bf16_vs_fp32_train_steps_per_s", headline, met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
