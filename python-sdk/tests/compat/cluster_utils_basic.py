"""ray.cluster_utils.Cluster: a head and two worker nodes on this machine, tasks placed
by each node's custom resource, a node removed (its resources leave the cluster) and
another added; connect() without a head refused."""

import time

import ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
a = cluster.add_node(num_cpus=2, resources={"a": 1})
b = cluster.add_node(num_cpus=2, resources={"b": 1})
cluster.wait_for_nodes()
ray.init(address=cluster.address)


def summary():
    res = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n["Alive"]]
    return res.get("CPU"), {k: res[k] for k in sorted(res) if k in ("a", "b", "c")}, len(alive)


def settled(expected, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline and summary() != expected:
        time.sleep(0.2)
    return summary()


@ray.remote(num_cpus=0)
def where():
    return ray.get_runtime_context().get_node_id()


print("started", summary())
print("nodes listed", len(cluster.list_all_nodes()), cluster.list_all_nodes()[0] is cluster.head_node)
print("on a", ray.get(where.options(resources={"a": 1}).remote()) == a.node_id)
print("on b", ray.get(where.options(resources={"b": 1}).remote()) == b.node_id)

cluster.remove_node(b)
cluster.wait_for_nodes()
print("b removed", settled((3.0, {"a": 1.0}, 2)))

c = cluster.add_node(num_cpus=1, resources={"c": 2})
cluster.wait_for_nodes()
print("c added", settled((4.0, {"a": 1.0, "c": 2.0}, 3)))
print("on c", ray.get(where.options(resources={"c": 1}).remote()) == c.node_id)

try:
    Cluster(connect=True)
except RuntimeError as e:
    print("RuntimeError:", e)

ray.shutdown()
cluster.shutdown()
print("done")
