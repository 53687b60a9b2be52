"""B18 retrieval training speed: `python -m jobs.train` on Ray vs plain PyTorch DDP, with
configs/retrieval.yaml (the dual encoder from scratch, gathered InfoNCE over both ranks).

Both sides run as a user runs them, side by side in one run (ABAB, bench.b1_train's harness):
- Ray: `python -m jobs.train` joining the benchmarks' private Ray (Ray Data feeding 2 workers,
  checkpoints every epoch);
- plain DDP: `python -m bench.ddp_train` (2 gloo processes, a DataLoader each) with the same
  step function (app.train.loop.train_epoch and the retrieval task's gathered loss), the same
  data and seed.
Steady step time = the training loop's steady epoch time (epochs 2..N, slowest rank) over the
epoch's optimizer steps; median of 3 repeats; the last epoch's val recall (rsum: R@1+5+10 both
ways) beside it, which must agree within noise. Goal: Ray / DDP <= 1.05.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.b1_train import side_by_side
from bench.common import Bench, bench_main, median, private_ray, ratio

WHAT = "retrieval training: python -m jobs.train (Ray) vs plain PyTorch DDP, same step function"
FULL = ["train.epochs=4", "train.keep_checkpoints=1"]
SMOKE = ["train.epochs=2", "data.num_rows=300"]


def run(smoke: bool, out: str, work: Path) -> dict[str, Any]:
    bench = Bench("B18", "<= 1.05", WHAT, out, smoke, doc=__doc__)
    overrides = SMOKE if smoke else FULL
    quiet = 0.0 if smoke else 240.0
    with private_ray() as ray_info:
        repeats = [
            side_by_side(work, "retrieval", overrides, "b18", r, ray_info["address"], quiet)
            for r in range(1 if smoke else 3)
        ]
    epoch_s = {side: median([r[side]["epoch_seconds"] for r in repeats]) for side in ("ray", "ddp")}
    rsum = {
        side: median([r[side]["metrics"]["val_rsum"] for r in repeats]) for side in ("ray", "ddp")
    }
    value = ratio(epoch_s["ray"], epoch_s["ddp"])
    details = {
        "steady_epoch_s": epoch_s,
        "val_rsum": rsum,
        "val_rsum_runs": {
            s: [r[s]["metrics"]["val_rsum"] for r in repeats] for s in ("ray", "ddp")
        },
        "ratio_ray_vs_ddp": value,
        "repeats": repeats,
        "ray": ray_info,
    }
    summary = (
        f"steady epoch Ray {epoch_s['ray']:.2f}s vs DDP {epoch_s['ddp']:.2f}s (x{value:.3f}); "
        f"val rsum Ray {rsum['ray']:.1f} vs DDP {rsum['ddp']:.1f} (of 600)"
    )
    return bench.result(
        "ray_vs_ddp_steady_epoch_ratio", value, bool(value <= 1.05), details, summary
    )


if __name__ == "__main__":
    bench_main(run, __doc__)()
