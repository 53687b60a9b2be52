"""The export gate across seeds: every default pipeline must pass its own gate on every seed.

    python -m bench.gate_seeds [--workloads digits,tabular,text] [--seeds 0,1,2,3,4] [--work DIR]

For each workload and `train.seed`, trains the default config (the real `app.train.driver.train` on a
private local Ray) and exports it (the real `app.export.exporter.export`, gate included), then checks the
issue's bar: int8 accuracy >= fp32 accuracy - max(0.5 points, one validation sample), and for the
Linear-heavy models (tabular, text) int8 <= 0.3x the fp32 size. Trained runs are kept in the work
folder, so a second call re-exports the same checkpoints (to compare quantization settings).
Writes bench/results/gate_seeds.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS_DIR, setup_logging, write_result

SIZE_BOUND = {"tabular": 0.3, "text": 0.3}  # int8 / fp32 bytes; the CNN has no such bound
log = logging.getLogger("bench")


def run_config(work: Path, workload: str, seed: int):
    from app.config import load_config

    return load_config(
        REPO / "configs" / f"{workload}.yaml",
        [
            f"data.output={work / 'data' / workload}",
            f"train.storage_path={work / 'runs'}",
            f"export.registry={work / 'registry'}",
            f"train.seed={seed}",
            f"train.run_name={workload}-seed{seed}",
        ],
    )


def trained(work: Path, workload: str, seed: int) -> dict[str, Any]:
    """The train summary of this run, training it only if no earlier call did."""
    from app.train.driver import train

    cached = work / "summaries" / f"{workload}-seed{seed}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    summary = train(run_config(work, workload, seed))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(summary))
    return summary


def exported(work: Path, workload: str, seed: int, checkpoint: str) -> dict[str, Any]:
    from app.errors import GateError
    from app.export.exporter import export

    try:
        report, published = export(run_config(work, workload, seed), checkpoint)["report"], True
    except GateError as e:
        report, published = e.report, False
    return {"report": report, "published": published}


def verdict(workload: str, report: dict[str, Any]) -> dict[str, Any]:
    acc, rows = report["accuracy"], report["accuracy_rows"]
    allowed = max(0.5, 100.0 / rows)
    drop = 100 * (acc["onnx_fp32"] - acc["onnx_int8"])
    ratio = report["size_ratio_int8"]
    bound = SIZE_BOUND.get(workload)
    return {
        "fp32": acc["onnx_fp32"],
        "int8": acc["onnx_int8"],
        "drop_points": drop,
        "allowed_points": allowed,
        "size_ratio": ratio,
        "size_bound": bound,
        "excluded": report["quantization"].get("excluded_nodes", []),
        "met": drop <= allowed + 1e-9 and (bound is None or ratio <= bound),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="digits,tabular,text")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--work", default=str(REPO / "outputs" / "bench-gate-seeds"))
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    setup_logging()
    import ray

    from app.pipeline.stages import prepare

    work = Path(args.work)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs, start = [], time.perf_counter()
    for workload in args.workloads.split(","):
        config = run_config(work, workload, 0)
        if not (Path(config.data_output) / "manifest.json").exists():
            prepare(config)
        for seed in (int(s) for s in args.seeds.split(",")):
            summary = trained(work, workload, seed)
            result = exported(work, workload, seed, summary["checkpoint"])
            row = {"workload": workload, "seed": seed, "published": result["published"]}
            row.update(verdict(workload, result["report"]))
            log.info("gate_seeds: %s", json.dumps(row))
            runs.append(row)
    ray.shutdown()
    failed = [f"{r['workload']}/seed{r['seed']}" for r in runs if not r["met"]]
    write_result(
        "gate_seeds",
        metric="runs meeting the bar (int8 >= fp32 - max(0.5 pt, 1 val sample); size <= 0.3x)",
        value=len(runs) - len(failed),
        goal=f"{len(runs)} of {len(runs)}",
        met=not failed,
        details={"runs": runs, "failed": failed},
        out_dir=args.out,
        what="export gate across train.seed for the default digits, tabular, text pipelines",
        elapsed_s=time.perf_counter() - start,
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
