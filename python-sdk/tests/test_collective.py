"""``tpuray.util.collective`` on a real two-node cluster (``tpuray start`` head + a
second node, loopback): four actors, two on each node, all-reduce random tensors over
gloo and get exactly the sum computed locally; the group meets through the head's KV
(no fixed port), and the rendezvous key is gone once the group is up. The one-node
behaviour of every call is the compatibility recording ``compat/collective_gloo``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import CliCluster

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    c = CliCluster(tmp_path_factory.mktemp("collective"))
    try:
        c.head(num_cpus=2).node("--num-cpus", "2")
        yield c
    finally:
        c.stop()


DRIVER = """
    import json
    import numpy as np
    import torch
    import tpuray as ray
    import tpuray.util.collective as col
    from tpuray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init({address!r})

    @ray.remote(num_cpus=1)
    class Member:
        def __init__(self, rank, data, noise):
            self.rank = rank
            self.data = data
            self.noise = noise

        def node(self):
            return ray.get_runtime_context().get_node_id()

        def sum_all(self):
            t = torch.from_numpy(self.data.copy())
            col.allreduce(t, "two-nodes")
            a = self.noise.copy()
            col.allreduce(a, "two-nodes", op=col.ReduceOp.MAX)
            return t.numpy(), a

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    rng = np.random.default_rng(7)
    # Integer-valued floats: every order of summation gives exactly the same tensor.
    data = [rng.integers(-1000, 1000, size=(3, 5)).astype(np.float32) for _ in range(4)]
    noise = [rng.standard_normal((4,)) for _ in range(4)]
    members = [
        Member.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[r // 2], soft=False))
        .remote(r, data[r], noise[r])
        for r in range(4)
    ]
    placed = ray.get([m.node.remote() for m in members])
    col.create_collective_group(members, 4, list(range(4)), backend="gloo", group_name="two-nodes")
    results = ray.get([m.sum_all.remote() for m in members], timeout=120)
    local_sum = np.sum(np.stack(data), axis=0)
    local_max = np.max(np.stack(noise), axis=0)
    key = ray._tpuray.kv_get("collective", b"rendezvous/two-nodes")
    print("JSON " + json.dumps({{
        "nodes": len(nodes),
        "placed_on_distinct_nodes": len(set(placed)),
        "sum_equal": [bool(np.array_equal(s, local_sum)) for s, _ in results],
        "max_equal": [bool(np.array_equal(m, local_max)) for _, m in results],
        "rendezvous_key_left": key is not None,
    }}))
"""


def test_allreduce_over_four_actors_on_two_nodes_is_the_local_sum_coll_1(two_nodes, tmp_path):
    """COLL-1: the group meets through the KV; the key is gone once it is up."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(address=two_nodes.address)))
    r = subprocess.run([sys.executable, str(script)], env=two_nodes.env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    out = next(json.loads(l[5:]) for l in r.stdout.splitlines() if l.startswith("JSON "))
    assert out["nodes"] == 2
    assert out["placed_on_distinct_nodes"] == 2
    assert out["sum_equal"] == [True] * 4, out
    assert out["max_equal"] == [True] * 4, out
    assert not out["rendezvous_key_left"]
