"""B29 served decode of a Llama-style decoder: `/v1/chat/completions` at 16 concurrent streams vs
transformers `generate` over the same 16 prompts in one batched call.

The model is B27's SmolLM2-135M-shaped `llama` folder (bench.b27_llama_train), its weights as
they are (random): a checkpoint of them exported by `jobs.export`'s path (KV-cache ONNX, int8
weight-only, the gate) and served int8 as cluster/start.sh serves (bench.serve_child: its own
Ray, HAProxy in front of one replica with the machine's 2 cores, the decode loop batching the
streams continuously). 16 clients each send one chat request (a different user message,
rendered by the folder's chat template, 64 tokens at temperature 0, not streamed) at the same
moment: tokens/s = the completion tokens of all answers / the wall time until the last. The
peer: transformers' `generate` (fp32, the folder's weights, 2 torch threads, greedy) over the
same 16 rendered prompts left-padded into one batch, exactly 64 new tokens each. A single
stream's tokens/s is recorded beside both. Median of 3 rounds each. Goal: served >= 1.0x
transformers at 16 streams.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.b5_serve import _stop, start_ht_child, wait_child_ready
from bench.b27_llama_train import llama_folder
from bench.common import Bench, bench_config, bench_main, ensure_prepared, free_port, ratio

ID = "B29"
WHAT = "served decode: /v1/chat/completions (int8, 16 streams) vs transformers generate (fp32, batched)"
GOAL = "served tokens/s >= 1.0x transformers' at 16 streams"
STREAMS, TOKENS, ROUNDS = 16, 64, 3
TOPICS = [
    "files", "sockets", "threads", "dates", "paths", "strings", "numbers", "lists",
    "queues", "locks", "logging", "parsing", "tests", "classes", "imports", "errors",
]  # fmt: skip


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short Python function about {TOPICS[i]}."}]


def artifact(work: Path, folder: str, smoke: bool) -> tuple[str, dict[str, Any]]:
    """The folder's weights as a checkpoint, exported (set-up, not measured)."""
    import torch

    from app.config import dump
    from app.export.exporter import export
    from app.models import build_model, load_pretrained
    from app.train.checkpoint import save
    from app.train.preprocessing import fit_preprocessor

    config = bench_config(
        work,
        "gpt2-finetune",
        f"model.pretrained={folder}",
        "data.path={stdlib}/email/*.py",
        "data.val_fraction=0.2",
        "model.max_length=128",
        "export.name=smollm2",
        "export.perplexity_rows=8",
        "export.greedy_prompts=2",
        # Random weights give near-flat logits, where int8 flips fp32's greedy pick often; the
        # benchmark measures speed, so the gate's quality bar is off (perplexity's still holds).
        "export.min_greedy_agreement=0",
        tag=f"b29-{Path(folder).name}",  # the smoke folder's artifact is not the full one's
    )
    registry = Path(config.export.registry) / "smollm2" / "1"
    if registry.exists():
        return str(registry), config.serve.model_dump(mode="json")
    ensure_prepared(config)
    pre = fit_preprocessor(config)
    model = build_model(config.model, pre)
    load_pretrained(model, pre)
    checkpoint = str(Path(config.export.registry).parent / "checkpoint")
    meta = {"config": dump(config), "epoch": 1, "step": 0, "metrics": {}}
    save(checkpoint, model, {}, {**meta, "preprocessor": pre.to_json()})
    del model
    torch.set_num_threads(2)
    return export(config, checkpoint)["artifact"], config.serve.model_dump(mode="json")


def served(url: str, streams: int) -> dict[str, float]:
    import requests

    def ask(i: int) -> int:
        body = {"model": "smollm2", "messages": messages(i), "max_tokens": TOKENS, "temperature": 0}
        r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(streams) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(ask, range(streams)))
        seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def peer(folder: str, streams: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [
        tokenizer.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False)
        for i in range(streams)
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        seconds = time.perf_counter() - start
    tokens = streams * (out.shape[1] - batch.input_ids.shape[1])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def median_round(rounds: list[dict[str, float]]) -> dict[str, Any]:
    value = statistics.median(r["tokens_per_s"] for r in rounds)
    return {"tokens_per_s": value, "rounds": rounds}


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    folder = llama_folder(work, smoke)
    uri, serve_cfg = artifact(work, folder, smoke)
    rounds = 1 if smoke else ROUNDS
    cfg = {**serve_cfg, "variant": "int8", "replica_cpus": 2.0}
    cfg["generation"] = {**cfg.get("generation", {}), "max_streams": STREAMS}
    cfg["autoscaling"] = {**cfg.get("autoscaling", {}), "min_replicas": 1, "max_replicas": 1}
    port, scratch = free_port(), work / "b29-serve"
    scratch.mkdir(parents=True, exist_ok=True)
    log = scratch / "serve.log"
    # Logical CPUs: the replica's two (its ONNX Runtime threads) and the routing app's share.
    child = start_ht_child(uri, cfg, port, str(scratch), log, name="smollm2", cpus=3)
    try:
        wait_child_ready(child, 600, log)
        url = f"http://127.0.0.1:{port}"
        served(url, 1)  # warm-up: the first request builds the session's plans
        results = {
            "served_16": median_round([served(url, STREAMS) for _ in range(rounds)]),
            "served_1": median_round([served(url, 1) for _ in range(rounds)]),
        }
    finally:
        _stop(child)
    results["transformers_16"] = median_round([peer(folder, STREAMS) for _ in range(rounds)])
    results["transformers_1"] = median_round([peer(folder, 1) for _ in range(rounds)])
    value = ratio(results["served_16"]["tokens_per_s"], results["transformers_16"]["tokens_per_s"])
    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    summary = (
        f"16 streams: served {tps['served_16']:.0f} tok/s vs transformers {tps['transformers_16']:.0f}"
        f" (x{value:.2f}); 1 stream: served {tps['served_1']:.0f} vs {tps['transformers_1']:.0f}"
    )
    details = {"tokens_per_s": tps, "results": results, "artifact": uri, "folder": folder}
    details["serve_config"] = json.loads(json.dumps(cfg))
    return bench.result(
        "served_vs_transformers_tokens_per_s_16", value, bool(value >= 1.0), details, summary
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
