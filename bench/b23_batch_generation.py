"""B23 offline batch generation: jobs.predict on a language model vs the decode loop alone and the served endpoint, on one artifact.

B15's lm (configs/lm.yaml trained briefly by jobs.train, int8) completes the same rows three
ways, one after the other on the machine's 2 cores: (a) the decode loop alone in this process
(16 streams at a time, the rows' prompts already tokenized: the engine's own figure); (b)
`jobs.predict` (app.predict.driver.predict on a private Ray: read, one actor of one CPU,
`predict.generation.max_streams=16`, write) whose steady tokens/s leave out its start-up,
measured by a one-row run; (c) the endpoint at 16 closed-loop streaming clients (B15's set-up,
bench.sse_load). Every row samples at temperature 1 with a seed of its own, 96 tokens.
Goals: (b) >= 0.9x (a), and >= 1.5x (c).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.b15_generation import PROMPT, Workload, side, trained
from bench.common import Bench, bench_main, private_ray

ID = "B23"
WHAT = "offline batch generation: jobs.predict vs the decode loop alone and the endpoint"
GOAL = "jobs.predict steady tokens/s >= 0.9x the decode loop alone, >= 1.5x served at 16 streams"
STREAMS, TOKENS = 16, 96


def prompts(rows: int) -> list[str]:
    return [f"{PROMPT}    x{i} = {i}\n" for i in range(rows)]


def loop_alone(artifact: str, texts: list[str]) -> float:
    """(a): tokens/s of the decode loop with STREAMS rows at a time, in this process."""
    from app.runtime.artifact import open_artifact
    from app.runtime.decode_loop import DecodeLoop
    from app.runtime.decoding import Generator, SamplingParams

    generator = Generator.from_artifact(open_artifact(artifact), "int8", 1)
    ids = [generator.encode(t) for t in texts]
    loop = DecodeLoop(generator)

    async def run() -> int:
        slots = asyncio.Semaphore(STREAMS)

        async def one(i: int) -> int:
            async with slots:
                params = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=i)
                stream = loop.submit(ids[i], params)
                async for _ in stream:
                    pass
                return stream.completion_tokens

        return sum(await asyncio.gather(*(one(i) for i in range(len(ids)))))

    start = time.perf_counter()
    tokens = asyncio.run(run())
    elapsed = time.perf_counter() - start
    loop.close()
    return tokens / elapsed


def batch_job(artifact: str, texts: list[str], work: Path) -> dict[str, float]:
    """(b): jobs.predict's tokens/s over the whole run and with its start-up (a one-row run's
    time) left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.config import load_config
    from app.predict.driver import predict
    from app.predict.write import verify_output

    config = load_config(
        None,
        [
            f"predict.generation.sampling={{max_tokens: {TOKENS}, temperature: 1.0}}",
            f"predict.generation.max_streams={STREAMS}",
            "predict.max_actors=1",
            "predict.actor_cpus=1",
            "predict.batch_size=256",
        ],
    )
    folder = Path(tempfile.mkdtemp(prefix="b23-", dir=work))

    def run(rows: list[str], name: str) -> tuple[float, int]:
        table = pa.table(
            {"id": list(range(len(rows))), "prompt": rows, "seed": list(range(len(rows)))}
        )
        pq.write_table(table, folder / f"{name}.parquet")
        start = time.perf_counter()
        out = str(folder / f"out-{name}")
        predict(config, artifact, str(folder / f"{name}.parquet"), out)
        elapsed = time.perf_counter() - start
        parts = [pq.read_table(f"{out}/{f.file}") for f in verify_output(out).files]
        return elapsed, sum(sum(p["completion_tokens"].to_pylist()) for p in parts)

    with private_ray():
        startup, _ = run(texts[:1], "one")
        elapsed, tokens = run(texts, "all")
    return {
        "tokens": tokens,
        "elapsed_s": elapsed,
        "startup_s": startup,
        "tokens_per_s": tokens / elapsed,
        "steady_tokens_per_s": tokens / max(elapsed - startup, 1e-9),
    }


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench(ID, GOAL, WHAT, out, smoke, doc=__doc__)
    steps = 4 if smoke else 40
    artifact, _ = trained(
        work, "lm", "lm", ["train.epochs=1", f"train.max_steps_per_epoch={steps}"]
    )
    texts = prompts(64 if smoke else 512)
    engine = statistics.median(loop_alone(artifact, texts) for _ in range(1 if smoke else 3))
    job = batch_job(artifact, texts, work)
    model = Workload("lm", artifact, "", PROMPT, TOKENS, (STREAMS,))
    served = side(model, "loop", work, 4.0 if smoke else 20.0)[STREAMS]["tokens_per_s"]
    vs_engine = job["steady_tokens_per_s"] / engine
    vs_served = job["steady_tokens_per_s"] / served
    met = bool(vs_engine >= 0.9 and vs_served >= 1.5)
    summary = (
        f"{len(texts)} rows x {TOKENS} tokens: jobs.predict {job['steady_tokens_per_s']:.0f} "
        f"tok/s steady ({job['tokens_per_s']:.0f} with its {job['startup_s']:.1f} s start-up), "
        f"decode loop alone {engine:.0f}, served at {STREAMS} streams {served:.0f}: "
        f"x{vs_engine:.2f} the loop, x{vs_served:.2f} served"
    )
    details = {"job": job, "loop_tokens_per_s": engine, "served_tokens_per_s": served}
    return bench.result("steady_vs_loop", vs_engine, met, details, summary)


if __name__ == "__main__":
    bench_main(run, __doc__)()
