"""B12 torch.compile: steady training-step time compiled vs eager on CPU, and the compile cost.

The text workload's Transformer encoder (app.models.transformer at configs/text.yaml's size,
its dropout 0.1; and the same model without dropout) in one process with 1 torch thread, on a
fixed batch of 32 rows, wrapped by the project's own app.train.parallel.parallelize with
`train.compile` false and true (each block compiled in place, Inductor's C++ backend). One
step = forward, cross entropy, backward, AdamW step. The compiled model's first step carries
the compilation (Dynamo tracing, AOTAutograd, code generation; Inductor's on-disk cache makes
a repeat faster) and is reported apart; after warm-up, rounds of steps alternate eager and
compiled so that load from other processes hits both alike; median of the rounds. The headline
is the configured model (with dropout).
Goal: the compiled steady step is no slower than eager (speedup >= 1.0).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Bench, bench_main, ratio, wait_for_quiet

ID = "B12"
GOAL = "compiled steady step time <= eager's (speedup >= 1.0x) on CPU"
WHAT = "torch.compile: compiled vs eager training steps on CPU"


def make_model(compile: bool, dropout: float) -> tuple[Any, Any]:
    import torch

    from app.config import TrainConfig
    from app.models.transformer import TransformerClassifier
    from app.train.parallel import parallelize

    torch.manual_seed(0)
    plain = TransformerClassifier(
        1000, 4, dim=128, layers=2, heads=4, ff_dim=256, max_length=32, dropout=dropout
    )
    model = parallelize(plain, TrainConfig(compile=compile), torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step_fn(model: Any, optimizer: Any, batch: Any) -> Callable[[], float]:
    import torch.nn.functional as F

    inputs, labels = batch

    def step() -> float:
        start = time.perf_counter()
        F.cross_entropy(model(**inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def measure(dropout: float, batch: Any, smoke: bool) -> dict[str, Any]:
    eager = step_fn(*make_model(False, dropout), batch)
    compiled = step_fn(*make_model(True, dropout), batch)
    first = {"eager": eager(), "compiled": compiled()}  # the compiled one compiles here
    for _ in range(3):  # warm-up (allocator, a recompile for the optimizer's new state)
        eager(), compiled()
    rounds, steps = (2, 5) if smoke else (5, 40)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):
        times["eager"].append(statistics.median(eager() for _ in range(steps)))
        times["compiled"].append(statistics.median(compiled() for _ in range(steps)))
    steady = {name: statistics.median(values) for name, values in times.items()}
    return {
        "speedup": ratio(steady["eager"], steady["compiled"]),
        "steady_step_s": steady,
        "rounds_step_s": times,
        "first_step_s": first,
        "compile_s": first["compiled"] - steady["compiled"],
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    import torch

    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (32, 32), generator=g)
    batch = ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 4, (32,)))
    load = wait_for_quiet(0.0 if smoke else 120.0)
    variants = {"dropout_0.1": measure(0.1, batch, smoke), "dropout_0": measure(0.0, batch, smoke)}
    head, bare = variants["dropout_0.1"], variants["dropout_0"]
    ms = {k: 1000 * v for k, v in head["steady_step_s"].items()}
    summary = (
        f"Transformer step eager {ms['eager']:.1f} ms vs compiled {ms['compiled']:.1f} ms "
        f"(x{head['speedup']:.2f}; without dropout x{bare['speedup']:.2f}); "
        f"compile {head['compile_s']:.1f} s"
    )
    return bench.result(
        "compiled_vs_eager_steady_step_speedup",
        head["speedup"],
        bool(head["speedup"] >= 1.0),
        {
            "headline": "dropout_0.1",
            **variants,
            "torch_threads": 1,
            "batch_rows": 32,
            "load_average_at_start": load,
        },
        summary,
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
