"""B13 fine-tuning speed at GPT-2 small's size: `python -m jobs.train` on Ray vs plain PyTorch DDP.

The model is GPT-2 small as a Hugging Face folder (124M parameters, random weights from the
default GPT2Config, written by tools/make_tiny_pretrained.py with a byte-level BPE tokenizer
trained on the standard library), fine-tuned with configs/gpt2-finetune.yaml on the stdlib corpus
at sequence length 128. Both sides run as a user runs them, side by side in one run (ABAB):
- Ray: `python -m jobs.train` joining the benchmarks' private Ray (`model.pretrained` loads the
  folder; DDP over 2 workers, checkpoints every epoch);
- plain DDP: `python -m bench.ddp_train` (2 gloo processes) with the same step function
  (app.train.loop.train_epoch and the LM task's loss).
Steady step time = the training loop's steady epoch time (epochs 2..N, slowest rank) over the
epoch's optimizer steps; median of 3 repeats. Goal: Ray / DDP <= 1.05.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.b1_train import side_by_side
from bench.common import (
    Bench,
    bench_main,
    median,
    private_ray,
    ratio,
)

WHAT = "fine-tuning GPT-2 small (124M): python -m jobs.train (Ray) vs plain PyTorch DDP"
STEPS = 4  # optimizer steps per epoch
FULL = [
    "data.path={stdlib}/email/**/*.py",
    "data.val_fraction=0.05",
    "model.max_length=128",
    "train.epochs=3",
    f"train.max_steps_per_epoch={STEPS}",
    "train.max_steps=null",
    "train.batch_size=4",
    "train.keep_checkpoints=1",
]
SMOKE_SIZES = {"n_positions": 128, "n_embd": 64, "n_layer": 2, "n_head": 2}


def gpt2_folder(work: Path, smoke: bool) -> str:
    from tools.make_tiny_pretrained import make_gpt2

    folder = work / ("gpt2-smoke" if smoke else "gpt2-small")
    if not (folder / "model.safetensors").exists():
        make_gpt2(str(folder), sizes=SMOKE_SIZES if smoke else {}, vocab=8192)
    return str(folder)


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench("B13", "<= 1.05", WHAT, out, smoke)
    folder = gpt2_folder(work, smoke)
    overrides = [f"model.pretrained={folder}", *FULL]
    if smoke:
        overrides += ["train.epochs=2", "train.max_steps_per_epoch=2", "model.max_length=64"]
    steps = 2 if smoke else STEPS
    quiet = 0.0 if smoke else 240.0
    with private_ray() as ray_info:
        repeats = [
            side_by_side(work, "gpt2-finetune", overrides, "b13", r, ray_info["address"], quiet)
            for r in range(1 if smoke else 3)
        ]
    step_s = {
        side: median([r[side]["epoch_seconds"] for r in repeats]) / steps for side in ("ray", "ddp")
    }
    value = ratio(step_s["ray"], step_s["ddp"])
    details = {
        "steady_step_s": step_s,
        "ratio_ray_vs_ddp": value,
        "model": {
            "folder": folder,
            "parameters": "124M" if not smoke else "smoke",
            "sequence": 128,
        },
        "repeats": repeats,
        "ray": ray_info,
        "method": (
            "Each side fine-tunes the same folder for 3 epochs of 4 optimizer steps (2 workers x "
            "4 sequences of 128 tokens, fp32, one torch thread each); steady step time = the "
            "median over repeats of the steady epoch loop time (first batch request to last "
            "optimizer step, slowest rank, epochs 2..3) / 4. Validation, checkpoints and "
            "start-up are outside the loop."
        ),
    }
    summary = f"step Ray {step_s['ray']:.2f}s vs DDP {step_s['ddp']:.2f}s (x{value:.3f})"
    return bench.result(
        "ray_vs_ddp_steady_step_time_ratio", value, bool(value <= 1.05), details, summary
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
