"""Runs the project's Serve app in a Ray of its own, in a separate process, until stdin closes.

    python -m bench.serve_child --artifact URI --port P [--serve-json '{...}']

Serve's high-throughput mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1, RAY_SERVE_ENABLE_HA_PROXY=1) is read
by the Serve controller and proxies when they start, so it must be in the environment of the
process that starts Ray: B5 starts this module with those variables set. It prints
`READY {json}` once the app answers /v2/health/ready, then serves until its stdin reaches EOF.
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench.common import server_parser


def main(argv=None) -> None:
    p = server_parser(__doc__)
    p.add_argument("--name", default="digits", help="the model's name (the artifact's)")
    p.add_argument("--num-cpus", type=int, default=2, help="the private Ray's logical CPUs")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from app.serve.control.builders import run_local
    from bench.load import wait_ready

    start = time.perf_counter()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    ray_init_s = time.perf_counter() - start
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        run_local([{"name": args.name, "artifact": args.artifact}], json.loads(args.serve_json))
        ready_s = wait_ready(f"http://127.0.0.1:{args.port}")
        env = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
        info = {
            "ray_init_s": ray_init_s,
            "deploy_s": time.perf_counter() - start - ray_init_s,
            "ready_wait_s": ready_s,
            "env": env,
        }
        print("READY " + json.dumps(info), flush=True)
        sys.stdin.read()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
