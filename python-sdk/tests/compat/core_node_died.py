"""A task running on a node that dies, with no retries left, fails with NodeDiedError
(Ray's owner asks the node's raylet why the worker broke; no answer means the node
died). With retries left it runs again on a live node. A task whose worker alone dies
(its node lives) still fails with WorkerCrashedError."""

import os
import time

import ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
victim = cluster.add_node(num_cpus=1, resources={"victim": 1})
cluster.add_node(num_cpus=1, resources={"spare": 1})
cluster.wait_for_nodes()
ray.init(address=cluster.address)


@ray.remote
class Flag:
    def __init__(self):
        self.started = set()

    def start(self, name):
        self.started.add(name)

    def started_(self, name):
        return name in self.started


flag = Flag.options(num_cpus=0).remote()


@ray.remote(num_cpus=0)
def hang(name, flag):
    ray.get(flag.start.remote(name))
    time.sleep(600)


@ray.remote(num_cpus=0)
def die(flag):
    ray.get(flag.start.remote("die"))
    os._exit(1)


def wait_started(name):
    deadline = time.time() + 60
    while time.time() < deadline and not ray.get(flag.started_.remote(name)):
        time.sleep(0.1)


# A worker dies alone: WorkerCrashedError.
try:
    ray.get(die.options(max_retries=0, resources={"victim": 0.1}).remote(flag), timeout=120)
except ray.exceptions.NodeDiedError:
    print("worker death: NodeDiedError")
except ray.exceptions.WorkerCrashedError:
    print("worker death: WorkerCrashedError")

ref = hang.options(max_retries=0, resources={"victim": 0.1}).remote("hang", flag)
wait_started("hang")
cluster.remove_node(victim, allow_graceful=False)
try:
    ray.get(ref, timeout=120)
except ray.exceptions.NodeDiedError as e:
    msg = str(e)
    print("node death: NodeDiedError", isinstance(e, ray.exceptions.RayError))
    print("names the node:", victim.node_id in msg)
    print("says:", msg.split(". ")[0])
except ray.exceptions.RayError as e:
    print("node death:", type(e).__name__)

ray.shutdown()
cluster.shutdown()
print("done")
