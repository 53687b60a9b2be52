"""B15 generation at engine speed: continuous batching vs Hugging Face transformers, over HTTP,
on the same weights.

Two models: configs/lm.yaml's GPT (trained briefly by jobs.train, int8 served) and a
GPT-2-small-shaped one (B13's random-weight folder, 8192-token vocabulary, fine-tuned a few
steps by jobs.train on 512-token sequences, int8 served). Each is served two ways, one after
the other, one replica on the machine's 2 cores:
(a) this server as cluster/start.sh runs it (bench.serve_child: HAProxy in front of the
replica) with its decode loop (every running stream advanced by one shared ONNX Runtime call a
step);
(b) bench.hf_peer: transformers `generate` with a `TextIteratorStreamer` per request behind a
plain FastAPI app, on the checkpoint's weights written as a GPT-2 folder (logits checked equal).
For each count of concurrent clients, each streams `/v1/completions` back to back for a 20 s
window (a fixed prompt, sampled at temperature 1, a seed per request; bench.sse_load, one
asyncio client on raw sockets): output tokens per second over all clients (from each answer's
usage), time to the first token (p50, p99) and time per output token after it (p50), from the
chunks' arrival. lm: 32-token prompt, 96 tokens, 1/4/16/64 streams; GPT-2-shaped: 128-token
prompt, 128 tokens, 1/4/16 streams. Each window records the CPU each process used.
(c) lm's decode loop alone in this process under the same load (`engine`: 16 closed-loop
streams, the replica's config), median of three 10 s windows.
Goals (lm, the decode loop, 16 streams): tokens/s at least 4x its own single stream and 2x (b);
TTFT p50 at most 3x the single stream's; (a) at least 0.8x (c).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.b1_train import launch
from bench.b5_serve import _stop, start_ht_child, wait_child_ready
from bench.common import (
    REPO,
    Bench,
    bench_config,
    bench_main,
    ensure_prepared,
    free_port,
    private_ray,
    process_cores,
    process_seconds,
)
from bench.sse_load import load

ID = "B15"
WHAT = "generation: continuous batching vs transformers (HTTP, streamed)"
GOAL = (
    "lm at 16 streams: tokens/s >= 4x its own 1-stream figure and >= 2x transformers, "
    "TTFT p50 <= 3x 1-stream's; served >= 0.8x its decode loop in-process under the same load"
)
SIDES = ("loop", "transformers")
# About 32 tokens of the kind of text the model was trained on.
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    path = os.path.join(argv[1], 'data')\n"


@dataclass
class Workload:
    name: str
    artifact: str
    folder: str  # the same weights as a GPT-2 folder, for transformers
    prompt: str
    max_tokens: int
    streams: tuple[int, ...]


def side(model: Workload, how: str, work: Path, seconds: float) -> dict[int, dict]:
    """One way of serving `model`, up once for every stream count."""
    port = free_port()
    log = work / "logs" / f"b15_{model.name}_{how}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="b15-")
    child = _start(model, how, port, scratch, log, work)
    body = {
        "model": model.name,
        "prompt": model.prompt,
        "max_tokens": model.max_tokens,
        "temperature": 1.0,
        "stream": True,
    }
    try:
        load("127.0.0.1", port, "/v1/completions", body, 2, 2.0)  # warm-up
        out = {}
        for n in model.streams:
            before, start = process_seconds(), time.perf_counter()
            out[n] = load("127.0.0.1", port, "/v1/completions", body, n, seconds)
            out[n]["process_cores"] = process_cores(before, time.perf_counter() - start)
        return out
    finally:
        _stop(child)
        shutil.rmtree(scratch, ignore_errors=True)


def engine(model: Workload, work: Path, streams: int, seconds: float) -> dict[str, Any]:
    """The served side's own engine in this process: the replica's decode loop (its variant,
    ONNX Runtime threads and stream interval from the same config) under the same load as the
    HTTP clients make, `streams` closed-loop generations of the same prompt at temperature 1,
    each with its own seed. Closed-loop clients over HTTP end at scattered times, so here the
    first generations are staggered (client i's first is i/streams of the length): a batch of
    streams that all start and end together would step narrower caches than the served one."""
    from app.runtime.artifact import open_artifact
    from app.runtime.decode_loop import DecodeLoop
    from app.runtime.decoding import Generator, SamplingParams

    cfg = bench_config(work, "lm", tag="b15").serve
    artifact = open_artifact(model.artifact)
    threads = max(1, math.floor(cfg.replica_cpus))
    generator = Generator.from_artifact(artifact, artifact.choose_variant(cfg.variant), threads)
    prompt = generator.encode(model.prompt)

    async def clients() -> int:
        loop = DecodeLoop(generator, stream_interval_s=cfg.generation.stream_interval_ms / 1000)
        end, seeds, tokens = time.perf_counter() + seconds, itertools.count(), 0

        async def client(i: int) -> None:
            nonlocal tokens
            length = max(1, model.max_tokens * (i + 1) // streams)
            while time.perf_counter() < end:
                params = SamplingParams(max_tokens=length, temperature=1.0, seed=next(seeds))
                generation = loop.submit(prompt, params)
                async for _ in generation:
                    pass
                tokens += generation.completion_tokens
                length = model.max_tokens

        await asyncio.gather(*(client(i) for i in range(streams)))
        loop.close()
        return tokens

    start, cpu = time.perf_counter(), time.process_time()
    tokens = asyncio.run(clients())
    seconds = time.perf_counter() - start
    return {
        "streams": streams,
        "tokens_per_s": tokens / seconds,
        "cores": round((time.process_time() - cpu) / seconds, 3),
    }


def _start(model: Workload, how: str, port: int, scratch: str, log: Path, work: Path):
    if how == "transformers":
        cmd = [sys.executable, "-m", "bench.hf_peer", "--folder", model.folder, "--port", str(port)]
        with open(log, "wb") as err:
            child = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stderr=err)
        _wait_http(port, child, log)
        return child
    overrides = (
        f"serve.generation.max_streams={max(model.streams)}",
        # Serve's own cap on a replica's requests: a stream holds one slot from its start to
        # its end, so it must admit every stream measured (else they queue in front of it).
        f"serve.max_ongoing_requests={max(model.streams)}",
        f"serve.batching.max_batch_size={min(16, max(model.streams))}",
        f"serve.generation.max_tokens={model.max_tokens}",
        "serve.autoscaling.min_replicas=1",
        "serve.autoscaling.max_replicas=1",
    )
    cfg = bench_config(work, "lm", *overrides, tag="b15").serve.model_dump(mode="json")
    child = start_ht_child(model.artifact, cfg, port, scratch, log, name=model.name)
    wait_child_ready(child, 300, log)
    return child


def _wait_http(port: int, child: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{log} : exited {child.returncode}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the peer on {port} never became ready ({log})")


def trained(work: Path, tag: str, workload: str, overrides: list[str]) -> tuple[str, str]:
    """`configs/<workload>.yaml` trained briefly by jobs.train on a private Ray and exported with
    a loose gate (B15 measures speed: the model only has to be a real export); its artifact
    and checkpoint, made once per --work."""
    from app.export.exporter import export

    overrides = [*overrides, f"export.name={tag}", "export.max_perplexity_increase=100"]
    overrides += ["export.min_greedy_agreement=0"] if workload != "lm" else []
    config = bench_config(work, workload, *overrides, tag=f"b15-{tag}")
    done = work / f"b15-{tag}.json"
    if done.exists():
        kept = json.loads(done.read_text())
        return kept["artifact"], kept["checkpoint"]
    ensure_prepared(config)
    summary = work / f"b15-{tag}-train.json"
    cmd = [sys.executable, "-m", "jobs.train", "--config", f"configs/{workload}.yaml"]
    cmd += [f"data.output={config.data_output}", f"train.storage_path={config.storage_path}"]
    cmd += [*overrides, f"train.run_name=b15-{int(time.time())}", "--summary-file", str(summary)]
    with private_ray() as ray_info:
        checkpoint = launch(cmd, summary, dict(os.environ, RAY_ADDRESS=ray_info["address"]))
    artifact = export(config, checkpoint["checkpoint"])["artifact"]
    done.write_text(json.dumps({"artifact": artifact, "checkpoint": checkpoint["checkpoint"]}))
    return artifact, checkpoint["checkpoint"]


def workloads(work: Path, smoke: bool) -> list[Workload]:
    from bench.b13_gpt2_train import gpt2_folder as random_gpt2
    from bench.hf_peer import gpt2_folder

    steps = 4 if smoke else 40
    lm = trained(work, "lm", "lm", ["train.epochs=1", f"train.max_steps_per_epoch={steps}"])
    gpt2_overrides = [
        f"model.pretrained={random_gpt2(work, smoke)}",
        f"model.max_length={128 if smoke else 512}",
        "train.max_steps=4",
        "train.num_workers=1",
        "data.val_fraction=0.01",
        *(["data.path={stdlib}/email/**/*.py", "data.val_fraction=0.1"] if smoke else []),
    ]
    gpt2 = trained(work, "gpt2", "gpt2-finetune", gpt2_overrides)
    models = []
    for name, (artifact, checkpoint), prompt, tokens, streams in (
        ("lm", lm, PROMPT, 96, (1, 4) if smoke else (1, 4, 16, 64)),
        (
            "gpt2",
            gpt2,
            PROMPT if smoke else PROMPT * 4,
            32 if smoke else 128,
            (1, 4) if smoke else (1, 4, 16),
        ),
    ):
        folder = work / f"b15-{name}-hf"
        if not (folder / "model.safetensors").exists():
            gpt2_folder(checkpoint, str(folder))
        models.append(Workload(name, artifact, str(folder), prompt, tokens, streams))
    return models


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    seconds = 4.0 if smoke else 20.0
    results: dict[str, dict[str, dict[int, dict]]] = {}
    models = workloads(work, smoke)
    for model in models:
        # Each side runs whole (alternating would restart the server every window).
        results[model.name] = {how: side(model, how, work, seconds) for how in SIDES}
    lm = results["lm"]
    loop, peer, top = lm["loop"], lm["transformers"], 16 if not smoke else 4
    lm_model = next(m for m in models if m.name == "lm")
    engines = [engine(lm_model, work, top, seconds / 2) for _ in range(1 if smoke else 3)]
    in_process = statistics.median(e["tokens_per_s"] for e in engines)
    scaling = loop[top]["tokens_per_s"] / loop[1]["tokens_per_s"]
    vs_peer = loop[top]["tokens_per_s"] / peer[top]["tokens_per_s"]
    ttft_growth = loop[top]["ttft_p50_ms"] / loop[1]["ttft_p50_ms"]
    vs_engine = loop[top]["tokens_per_s"] / in_process
    met = bool(scaling >= 4 and vs_peer >= 2 and ttft_growth <= 3 and vs_engine >= 0.8)
    lines = []
    for name, sides in results.items():
        for n in sides["loop"]:
            figures = ", ".join(
                f"{how} {sides[how][n]['tokens_per_s']:.0f} tok/s "
                f"(TTFT p50 {sides[how][n]['ttft_p50_ms']:.0f} ms)"
                for how in SIDES
            )
            lines.append(f"{name} {n} streams: {figures}")
    summary = (
        "; ".join(lines) + f"; lm at {top}: x{scaling:.2f} its 1-stream tokens/s, "
        f"x{vs_peer:.2f} transformers, TTFT x{ttft_growth:.2f}; served x{vs_engine:.2f} "
        f"its decode loop in-process ({in_process:.0f} tok/s)"
    )
    details = {
        "results": results,
        "window_s": seconds,
        "lm_scaling_at_16": scaling,
        "lm_vs_transformers_at_16": vs_peer,
        "lm_ttft_growth_at_16": ttft_growth,
        "lm_in_process_at_16": engines,
        "lm_served_vs_in_process_at_16": vs_engine,
    }
    return bench.result("tokens_per_s_at_16_vs_1_stream", scaling, met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
