"""The training step of each model family in each precision, in one process, without Ray.

    python -m bench.gpu_check [--steps 50] [--batch 256] [--out bench/results]

On CUDA: fp32, bf16 and fp16 + GradScaler; on CPU: fp32 and bf16. For each model family it
prints the median step time, the speedup over fp32 and the loss after N steps against fp32's
(same initial weights, same batches), and writes `<out>/gpu_check_<device>.json`.

It also records the serving batching ceiling (bench.b5b_batching's reference models
in ONNX Runtime alone, ms/row at batch 1 vs batch 16): on CUDA with the CUDA execution provider
and fp32 models, where batching is expected to pay several-fold; on CPU with int8, as B5b.
`--no-serving` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.models.cnn import ResNetCNN
from app.models.mlp import MLP
from app.models.transformer import TransformerClassifier

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


def families(
    scale: int,
) -> dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], Batch]]]:
    """name -> (model builder, batch maker); `scale` widens models for a GPU."""
    classes = 10

    def image_batch(n: int, g: torch.Generator) -> Batch:
        x = torch.randn(n, 3, 32, 32, generator=g)
        return {"x": x}, (x.mean(dim=(1, 2, 3)) * 40).long().clamp(-5, 4) + 5

    def table_batch(n: int, g: torch.Generator) -> Batch:
        x = torch.randn(n, 64, generator=g)
        return {"x": x}, (x[:, :8].sum(1) > 0).long()

    def text_batch(n: int, g: torch.Generator) -> Batch:
        ids = torch.randint(2, 1000, (n, 64), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids[:, 0] % 4

    return {
        "cnn": (lambda: ResNetCNN(3, classes, widths=[32 * scale, 64 * scale]), image_batch),
        "mlp": (lambda: MLP(64, 2, hidden=[512 * scale, 256 * scale]), table_batch),
        "transformer": (
            lambda: TransformerClassifier(
                1000,
                4,
                dim=128 * scale,
                layers=4,
                heads=4,
                ff_dim=512 * scale,
                max_length=64,
                dropout=0.0,
            ),
            text_batch,
        ),
    }


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(
        device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16
    )


def run(
    family: str, precision: str, device: torch.device, steps: int, batch: int, scale: int
) -> dict[str, Any]:
    build, make_batch = families(scale)[family]
    torch.manual_seed(0)
    model = build().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(batch, g) for _ in range(8)]  # reused in turn: the same data for all
    times, loss = [], torch.tensor(0.0)
    for step in range(steps):
        inputs, labels = batches[step % len(batches)]
        inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        labels = labels.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast(device, precision):
            loss = F.cross_entropy(model(**inputs).float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steady = times[min(5, len(times) - 1) :]
    median = statistics.median(steady)
    return {
        "step_ms": 1000 * median,
        "samples_per_s": batch / median,
        "final_loss": float(loss.item()),
    }


def serving_ceiling(device: torch.device, smoke: bool) -> dict[str, Any]:
    """ONNX Runtime ms/row at batch 1 vs 16 per reference model: CUDA provider and fp32 on a
    GPU, CPU provider and int8 otherwise (falls back to CPU when CUDA's provider is missing)."""
    import onnxruntime as ort

    from bench.b5b_batching import ceilings

    cuda = device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else None
    models, _ = ceilings(smoke, int8=not cuda, providers=providers, quiet_s=0)
    for name, row in models.items():
        print(
            f"serving {name:18s} {row['ms_per_row_batch_1']:.4f} -> "
            f"{row['ms_per_row_batch_16']:.4f} ms/row (ceiling x{row['ceiling']:.2f})",
            flush=True,
        )
    return {
        "provider": "CUDAExecutionProvider" if cuda else "CPUExecutionProvider",
        "variant": "fp32" if cuda else "int8",
        "models": models,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--scale", type=int, default=0, help="model width multiplier (default: 4 on CUDA, 1 on CPU)"
    )
    p.add_argument("--families", default="cnn,mlp,transformer")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--no-serving", action="store_true", help="skip the batching ceiling")
    p.add_argument("--serving-smoke", action="store_true", help="a short batching ceiling")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = args.scale or (4 if device.type == "cuda" else 1)
    precisions = ["fp32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"]
    results: dict[str, Any] = {}
    for family in args.families.split(","):
        results[family] = {
            prec: run(family, prec, device, args.steps, args.batch, scale) for prec in precisions
        }
        base = results[family]["fp32"]
        for prec in precisions:
            r = results[family][prec]
            r["speedup_vs_fp32"] = base["step_ms"] / r["step_ms"]
            r["loss_rel_diff_vs_fp32"] = abs(r["final_loss"] - base["final_loss"]) / max(
                abs(base["final_loss"]), 1e-9
            )
            print(
                f"{family:12s} {prec:5s} step {r['step_ms']:8.2f} ms  x{r['speedup_vs_fp32']:.2f} vs fp32  "
                f"loss {r['final_loss']:.4f} (rel diff {r['loss_rel_diff_vs_fp32']:.3f})",
                flush=True,
            )
    serving = None if args.no_serving else serving_ceiling(device, args.serving_smoke)
    report = {
        "id": "gpu_check",
        "device": torch.cuda.get_device_name(0)
        if device.type == "cuda"
        else platform.machine(),  # platform.processor() would run `uname -p`
        "torch": torch.__version__,
        "steps": args.steps,
        "batch": args.batch,
        "scale": scale,
        "results": results,
        "serving_batching_ceiling": serving,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_check_{device.type}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
