"""B30 chat fine-tuning step: packed vs unpacked rows of the same conversations, `python -m
jobs.train --config configs/chat-sft.yaml` on Ray, steady step time and held-out loss.

The model is B27's SmolLM2-135M-shaped `llama` folder (bench.b27_llama_train; random weights).
The data is 1,200 generated conversations (a system message in some, one or two user turns,
answers of 4 to 300 words drawn from a log-normal, words from a fixed list), rows of 512 tokens
(the few longer conversations cut to a row, `data.truncate`).
`packed` (`data.pack=true`, the default) puts several conversations in a row; `unpacked`
(`data.pack=false`) one a row, padded, each batch cut after its longest row (no padding
computed past it, as a collator that pads to the longest would). Both train on the same conversations per step: the
unpacked batch is the packed one times the conversations a packed row holds on average, so a
step sees the same conversations' tokens either way. Each run: 2 workers, 2 epochs of 4
optimizer steps, fp32, activation checkpointing on (the unpacked batch of seven rows of up to
512 tokens keeps some 10 GiB of activations a worker without it, and two workers do not fit
24 GiB beside each other); steady step time = the second epoch's loop time / 4 (slowest rank, the
train summary's); the held-out figure is `val_loss` after the run (assistant tokens only: the
same validation conversations either way). Median of 3 repeats, the two alternating after quiet
windows. Goal: packed >= 1.5x unpacked's steps per second at equal validation loss (within 2%).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.b1_train import launch
from bench.b27_llama_train import llama_folder
from bench.common import (
    Bench,
    bench_config,
    bench_main,
    ensure_prepared,
    median,
    private_ray,
    ratio,
    wait_for_quiet,
)

ID = "B30"
GOAL = "packed >= 1.5x unpacked steps/s, same conversations a step, val loss within 2%"
WHAT = "chat SFT step: packed vs unpacked rows of the same conversations (jobs.train on Ray)"
CONVERSATIONS, WIDTH, STEPS, PACKED_BATCH = 1200, 512, 4, 2
WORD_LIST = (
    "the a model data train test value list file path line word token answer question time "
    "first last next small large fast slow open close read write start stop run call return "
    "error result number string name type class function method field table row column key"
)
WORDS = WORD_LIST.split()


def conversations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, words)))

    def answer() -> str:
        return text(int(min(300, max(4, rng.lognormvariate(math.log(40), 0.9)))))

    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": text(8)}] if rng.random() < 0.3 else []
        for _ in range(1 if rng.random() < 0.7 else 2):
            messages += [
                {"role": "user", "content": text(rng.randint(5, 40))},
                {"role": "assistant", "content": answer()},
            ]
        out.append({"messages": messages})
    return out


def chat_file(work: Path, count: int) -> str:
    path = work / f"b30-chats-{count}.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(c) + "\n" for c in conversations(count)))
    return str(path)


def prepared(work: Path, overrides: list[str], packing: str) -> tuple[list[str], Any]:
    """The run's overrides with its own data folder, and its prepared manifest."""
    tag = f"b30-{packing}"
    config = bench_config(work, "chat-sft", *overrides, f"data.pack={packing == 'packed'}", tag=tag)
    manifest = ensure_prepared(config)
    paths = [f"data.output={config.data_output}", f"train.storage_path={config.storage_path}"]
    return [*overrides, f"data.pack={packing == 'packed'}", *paths], manifest


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    folder = llama_folder(work, smoke)
    count = 200 if smoke else CONVERSATIONS
    width = 128 if smoke else WIDTH
    overrides = [
        f"model.pretrained={folder}",
        f"data.path={chat_file(work, count)}",
        f"model.max_length={width}",
        "data.val_fraction=0.1",
        "data.truncate=true",  # the longest answers are cut to a row, the same cut either way
        "train.epochs=2",
        f"train.max_steps_per_epoch={STEPS}",
        "train.lr=3e-4",
        "train.log_every_steps=0",
        "train.keep_checkpoints=1",
        "train.activation_checkpointing=true",
    ]
    args, manifests = {}, {}
    for packing in ("packed", "unpacked"):
        args[packing], manifests[packing] = prepared(work, overrides, packing)
    per_row = manifests["unpacked"].rows["train"] / manifests["packed"].rows["train"]
    batch = {"packed": PACKED_BATCH, "unpacked": max(1, round(PACKED_BATCH * per_row))}
    runs: dict[str, list[dict[str, Any]]] = {"packed": [], "unpacked": []}
    with private_ray() as ray_info:
        for repeat in range(1 if smoke else 3):
            for packing in runs:
                wait_for_quiet(0 if smoke else 120)
                summary = work / f"b30-{packing}-{repeat}.json"
                name = f"train.run_name=b30-{packing}-{repeat}-{int(time.time())}"
                cmd = [
                    sys.executable, "-m", "jobs.train", "--config", "configs/chat-sft.yaml",
                    *args[packing], f"train.batch_size={batch[packing]}", name,
                    "--summary-file", str(summary),
                ]  # fmt: skip
                env = dict(os.environ, RAY_ADDRESS=ray_info["address"], PYTHONUNBUFFERED="1")
                runs[packing].append(launch(cmd, summary, env))
    step_s = {
        p: median([r["epoch_seconds_history"][-1] / STEPS for r in rs]) for p, rs in runs.items()
    }
    val = {p: median([r["metrics"]["val_loss"] for r in rs]) for p, rs in runs.items()}
    speedup = ratio(step_s["unpacked"], step_s["packed"])
    loss_gap = abs(val["packed"] - val["unpacked"]) / val["unpacked"]
    summary_text = (
        f"{per_row:.2f} conversations a packed row of {width}; a step of "
        f"{PACKED_BATCH * 2} packed vs {batch['unpacked'] * 2} unpacked rows: {step_s['packed']:.2f}"
        f" s vs {step_s['unpacked']:.2f} s (x{speedup:.2f}); val loss {val['packed']:.4f} vs "
        f"{val['unpacked']:.4f} ({100 * loss_gap:.1f}% apart)"
    )
    details = {
        "conversations": count,
        "row_tokens": width,
        "rows": {p: m.rows for p, m in manifests.items()},
        "conversations_per_packed_row": per_row,
        "batch_per_worker": batch,
        "steady_step_s": step_s,
        "val_loss": val,
        "loss_gap": loss_gap,
        "runs": runs,
        "ray": ray_info,
        "folder": folder,
    }
    met = speedup >= 1.5 and loss_gap <= 0.02
    return bench.result("packed_vs_unpacked_steps_per_s", speedup, met, details, summary_text)


if __name__ == "__main__":
    bench_main(run, __doc__)()
