"""B28 loss memory at a 151,936-token vocabulary: the cross entropy computed in chunks inside the
model's forward vs over the full fp32 logits, peak resident memory of one training step.

The model is Qwen2.5-0.5B's shape cut to 2 blocks (width 896, 14 heads over 2 key/value heads,
SwiGLU 4,864, the 151,936-row embedding tied to the head: 150M parameters, random weights), the
project's LlamaLM, one process with 2 torch threads. One training step on 4 sequences of 1,024
tokens, every target trained (the worst case for the loss): forward, backward, AdamW. `chunked`
is what a training worker runs (app/tasks/lm/train.py `next_token_loss`: the model given the
targets computes the loss a chunk of tokens at a time, each chunk's logits recomputed in
backward); `full_logits` is the loss over the model's whole [4, 1024, 151936] logits, cast to
fp32, as the task computed it before. Each variant runs in a fresh process (its VmHWM, the
process's peak resident memory, is the figure), the two alternating, median of 3 each; the
step's own share (peak minus the resident memory before the step, the weights and AdamW's
state already allocated) is recorded beside it, with the step's time.
Goal: the chunked loss's peak <= 0.5x the full logits'.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Bench, bench_main, ratio, wait_for_quiet

ID = "B28"
GOAL = "peak RSS of a training step: chunked loss <= 0.5x full fp32 logits"
WHAT = "loss memory: chunked cross entropy in the forward vs full fp32 logits, 152k vocabulary"
FULL = {
    "vocab_size": 151936, "dim": 896, "layers": 2, "heads": 14, "kv_heads": 2, "head_dim": 64,
    "ff_dim": 4864, "rows": 4, "tokens": 1024,
}  # fmt: skip
SMOKE = {**FULL, "vocab_size": 8192, "dim": 128, "heads": 2, "ff_dim": 256, "tokens": 128}
VARIANTS = ("chunked", "full_logits")
REPEATS = 3


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field))
    return int(line.split()[1]) * 1024


def step(variant: str, size: dict[str, int]) -> dict[str, float]:
    """One training step in this process (a fresh one: run by `measure`)."""
    import torch

    from app.models.llama import DecoderArgs, LlamaLM
    from app.tasks.lm.train import next_token_loss, token_loss

    torch.set_num_threads(2)
    torch.manual_seed(0)
    args = {k: v for k, v in size.items() if k not in ("rows", "tokens")}
    model = LlamaLM(DecoderArgs(**args, max_positions=size["tokens"], tied=True))
    with torch.no_grad():  # a trained table's scale (the module's own draw is N(0, 1))
        model.tokens.weight.normal_(std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():  # AdamW's moments, as every step after the first holds them
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    ids = torch.randint(0, size["vocab_size"], (size["rows"], size["tokens"] + 1))
    before = _rss("VmRSS:")
    start = time.perf_counter()
    if variant == "chunked":
        loss, _ = next_token_loss(model, {"input_ids": ids}, torch.device("cpu"))
    else:
        loss = token_loss(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    return {
        "peak_rss": _rss("VmHWM:"),
        "before_step_rss": before,
        "step_bytes": _rss("VmHWM:") - before,
        "seconds": seconds,
        "loss": loss.item(),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def measure(variant: str, size: dict[str, int]) -> dict[str, float]:
    code = (
        "import json, sys; from bench.b28_loss_memory import step; "
        "print(json.dumps(step(sys.argv[1], json.loads(sys.argv[2]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, variant, json.dumps(size)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    size = SMOKE if smoke else FULL
    load = wait_for_quiet(0.0 if smoke else 120.0)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(1 if smoke else REPEATS):
        for variant in VARIANTS:  # alternating, each in a fresh process
            runs[variant].append(measure(variant, size))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    value = ratio(med["chunked"]["peak_rss"], med["full_logits"]["peak_rss"])
    gib = {v: med[v]["peak_rss"] / 2**30 for v in VARIANTS}
    step_gib = {v: med[v]["step_bytes"] / 2**30 for v in VARIANTS}
    summary = (
        f"{med['chunked']['parameters'] / 1e6:.0f}M parameters, vocabulary "
        f"{size['vocab_size']:,}, {size['rows']} x {size['tokens']} tokens: peak RSS chunked "
        f"{gib['chunked']:.2f} GiB vs full logits {gib['full_logits']:.2f} (x{value:.2f}); the "
        f"step's own {step_gib['chunked']:.2f} vs {step_gib['full_logits']:.2f} GiB; step "
        f"{med['chunked']['seconds']:.1f} s vs {med['full_logits']['seconds']:.1f} s"
    )
    details = {"size": size, "median": med, "runs": runs, "load_average_at_start": load}
    return bench.result("chunked_vs_full_peak_rss", value, bool(value <= 0.5), details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
