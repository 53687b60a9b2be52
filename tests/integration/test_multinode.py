"""Multi-node: a head with 0 CPUs and two 2-CPU worker nodes; SPREAD puts one rank on each."""

from __future__ import annotations

import pytest

from app.train.driver import train
from tests.integration.conftest import multinode_cluster, workload_config

# Slow (make test-all): tests/integration/test_elastic.py spreads a run over two nodes too.
pytestmark = [pytest.mark.integration, pytest.mark.slow]
OWN_RAY = True  # starts its own Ray (tests/integration/conftest.py: _private_ray_only)


def test_workers_spread_over_two_nodes(prepared, workspace):
    import ray

    prepared("digits")
    ray.shutdown()  # this test needs its own multi-node cluster; later tests re-init a local one
    cluster = multinode_cluster()
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        config = workload_config(
            workspace,
            "digits",
            "train.epochs=2",
            "train.placement_strategy=SPREAD",
            "train.run_name=digits-multinode",
        )
        summary = train(config)
        assert summary["final_epoch"] == 2
        assert summary["metrics"]["val_accuracy"] > 0.5
        workers = summary["worker_nodes"]
        assert len(workers) == 2 and len(set(workers)) == 2
        assert set(workers) <= {n.node_id for n in nodes}
    finally:
        ray.shutdown()
        cluster.shutdown()
