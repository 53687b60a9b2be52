"""B27 fine-tuning speed of a Llama-style decoder: `python -m jobs.train` on Ray vs plain PyTorch DDP.

The model is SmolLM2-135M's shape as a Hugging Face `llama` folder (hidden 576, 30 blocks, 9
heads over 3 key/value heads, SwiGLU 1536, the 49,152-row embedding tied to the head; random
weights, written by tools/make_tiny_pretrained.py with a byte-level BPE tokenizer trained on the
standard library), fine-tuned with configs/gpt2-finetune.yaml on the stdlib corpus: each worker
4 sequences of 128 tokens a step (512 tokens). Both sides as a user runs them, side by side in
one run, as B13 (bench.b1_train.side_by_side): `jobs.train` on the benchmarks' private Ray
(DDP over 2 workers) and `python -m bench.ddp_train` (2 gloo processes) with the same step
function. Steady step time = steady epoch time (epochs 2..3, slowest rank) over its 4 steps,
median of 3 repeats. Goal: Ray / DDP <= 1.05.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.b1_train import side_by_side
from bench.b13_gpt2_train import FULL, STEPS
from bench.common import Bench, bench_main, median, private_ray, ratio

ID = "B27"
WHAT = "fine-tuning a SmolLM2-135M-shaped llama folder: python -m jobs.train (Ray) vs plain DDP"
GOAL = "<= 1.05"
SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}
SMOKE = {"hidden_size": 72, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 8192}


def llama_folder(work: Path, smoke: bool) -> str:
    """B27's folder (B29 serves the same one)."""
    from tools.make_tiny_pretrained import make_decoder

    folder = work / ("smollm2-smoke" if smoke else "smollm2-135m")
    if not (folder / "model.safetensors").exists():
        sizes = {**SMOLLM2, **(SMOKE if smoke else {})}
        make_decoder(str(folder), "llama", sizes=sizes, vocab=8192)
    return str(folder)


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    folder = llama_folder(work, smoke)
    overrides = [f"model.pretrained={folder}", *FULL, "data.val_fraction=0.2"]
    if smoke:
        overrides += ["train.epochs=2", "train.max_steps_per_epoch=2", "model.max_length=64"]
    steps = 2 if smoke else STEPS
    with private_ray() as ray_info:
        repeats = [
            side_by_side(
                work, "gpt2-finetune", overrides, "b27", r, ray_info["address"], 0 if smoke else 240
            )
            for r in range(1 if smoke else 3)
        ]
    step_s = {
        side: median([r[side]["epoch_seconds"] for r in repeats]) / steps for side in ("ray", "ddp")
    }
    value = ratio(step_s["ray"], step_s["ddp"])
    details = {
        "steady_step_s": step_s,
        "ratio_ray_vs_ddp": value,
        "model": {"folder": folder, "shape": "smoke" if smoke else SMOLLM2, "sequence": 128},
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
