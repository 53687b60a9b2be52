"""B14 GPT-2 small int8 vs fp32 ONNX: size, decode speed, and the gate's quality figures.

The GPT-2-small folder of B13 (124M parameters) is first fine-tuned briefly on the stdlib corpus
with `python -m jobs.train` (random weights make perplexity meaningless), then exported with the
project's export (`app.export.exporter.export`: the KV-cache graph, weight-only int8 of every
MatMul and the token embedding, the perplexity and greedy-agreement gate). Decode speed: tokens/s
of a 32-token greedy continuation, batch 1, one ONNX Runtime thread, on the published artifact's
two variants; median of 3. Goals: int8 size <= 0.3x fp32, decode tokens/s >= 1.5x.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.b1_train import launch
from bench.b13_gpt2_train import gpt2_folder
from bench.common import Bench, bench_config, bench_main, ensure_prepared, private_ray

WHAT = "GPT-2 small (124M) int8 vs fp32 ONNX: size, decode tokens/s, perplexity, greedy agreement"
TRAIN = [
    "data.val_fraction=0.01",
    "model.max_length=128",
    "train.epochs=1",
    "train.max_steps=80",
    "train.batch_size=4",
    "train.lr=6e-4",
    "train.warmup_steps=8",
    "train.keep_checkpoints=1",
]
SMOKE = ["data.path={stdlib}/email/**/*.py", "data.val_fraction=0.1", "train.max_steps=4"]


def train_checkpoint(work: Path, overrides: list[str], address: str) -> dict[str, Any]:
    config = bench_config(work, "gpt2-finetune", *overrides, tag="b14")
    ensure_prepared(config)
    summary = work / "b14-train.json"
    if summary.exists():  # a kept --work: the fine-tune is done, measure its export again
        done = json.loads(summary.read_text())
        if Path(done["checkpoint"], "model.safetensors").exists():
            return {"config": config, "train": done | {"reused": True}}
    cmd = [
        sys.executable,
        "-m",
        "jobs.train",
        "--config",
        "configs/gpt2-finetune.yaml",
        f"data.output={config.data_output}",
        f"train.storage_path={config.storage_path}",
        *overrides,
        f"train.run_name=b14-{int(time.time())}",
        "--summary-file",
        str(summary),
    ]
    out = launch(cmd, summary, dict(os.environ, RAY_ADDRESS=address))
    return {"config": config, "train": out}


def export_report(config, checkpoint: str) -> dict[str, Any]:
    from app.errors import GateError
    from app.export.exporter import export

    try:
        exported = export(config, checkpoint)
        return {"artifact": exported["artifact"], "report": exported["report"], "gate": "passed"}
    except GateError as e:  # the figures are what B14 records, passed or not
        return {"artifact": None, "report": e.report, "gate": str(e)}


def decode_tokens_per_second(artifact: str, tokens: int = 32, repeats: int = 3) -> dict[str, float]:
    import numpy as np

    from app.runtime.artifact import open_artifact
    from app.runtime.kv import KVDecoder

    loaded = open_artifact(artifact)
    prompt = loaded.preprocessor.tokenizer.encode("import os\n\ndef main():\n").ids
    out = {}
    for variant in ("fp32", "int8"):
        decoder = KVDecoder(loaded.session(variant, threads=1))
        rates = []
        for _ in range(repeats):
            logits, cache = decoder.step(np.asarray([prompt]), decoder.empty_cache())
            start = time.perf_counter()
            for _ in range(tokens):
                token = int(logits[0, -1].argmax())
                logits, cache = decoder.step(np.asarray([[token]]), cache)
            rates.append(tokens / (time.perf_counter() - start))
        out[variant] = statistics.median(rates)
    return out


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench("B14", "int8 size <= 0.3x and decode tokens/s >= 1.5x fp32", WHAT, out, smoke)
    folder = gpt2_folder(work, smoke)
    overrides = [f"model.pretrained={folder}", *TRAIN, *(SMOKE if smoke else [])]
    with private_ray() as ray_info:
        trained = train_checkpoint(work, overrides, ray_info["address"])
    checkpoint = trained["train"]["checkpoint"]
    exported = export_report(trained["config"], checkpoint)
    report = exported["report"]
    speed = decode_tokens_per_second(exported["artifact"]) if exported["artifact"] else {}
    size_ratio = report["size_ratio_int8"]
    speedup = speed["int8"] / speed["fp32"] if speed else None
    details = {
        "size_bytes": report["size_bytes"],
        "size_ratio_int8": size_ratio,
        "decode_tokens_per_second": speed,
        "decode_speedup_int8": speedup,
        "latency_ms_per_token_export_report": report.get("latency_ms_per_token"),
        "perplexity": report["perplexity"],
        "perplexity_increase": report["perplexity_increase"],
        "greedy": report["greedy"],
        "gate": exported["gate"],
        "train": {
            k: trained["train"].get(k) for k in ("metrics", "step_seconds", "wall_s", "checkpoint")
        },
        "ray": ray_info,
        "method": (
            "jobs.train (80 steps, 2 workers x 4 sequences of 128 tokens, lr 6e-4) from the "
            "random-weight GPT-2-small folder, then the project's export; decode = 32 greedy "
            "tokens after a 10-token prompt on the artifact's fp32 and int8 sessions (KV cache, "
            "batch 1, one thread), median of 3."
        ),
    }
    met = bool(size_ratio <= 0.3 and speedup is not None and speedup >= 1.5)
    summary = (
        f"size x{size_ratio:.3f}, decode {speed.get('int8', 0):.1f} vs {speed.get('fp32', 0):.1f} "
        f"tokens/s (x{speedup or 0:.2f}), perplexity {report['perplexity']['int8']:.2f} vs "
        f"{report['perplexity']['fp32']:.2f}, greedy agreement "
        f"{report['greedy']['token_agreement']:.3f}"
    )
    return bench.result("int8_size_ratio_and_decode_speedup", size_ratio, met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
