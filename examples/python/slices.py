"""The Python SDK on a cluster with a simulated TPU slice (run by scripts/demo.sh).

Joins the cluster `tpuray start` left on this machine, runs tasks and an actor, then
reserves every host of one v6e-16 slice with `slice_placement_group` and runs one task per
host inside it: each sees its own TPU_WORKER_ID and the chips the node agent handed it.
"""

import os

import tpuray as ray
from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tpuray.util.tpu import slice_placement_group

ray.init()


@ray.remote
def square(x):
    return x * x


@ray.remote
class Counter:
    def __init__(self):
        self.n = 0

    def incr(self):
        self.n += 1
        return self.n


print("squares:", ray.get([square.remote(i) for i in range(8)]))
c = Counter.remote()
print("counter:", ray.get([c.incr.remote() for _ in range(3)]))

slice_pg = slice_placement_group("4x4", "v6e")
ray.get(slice_pg.placement_group.ready(), timeout=60)
print(f"reserved a {slice_pg.accelerator_type} slice: {slice_pg.num_hosts} hosts x {slice_pg.chips_per_host} chips")


@ray.remote(num_cpus=0, resources={"TPU": 4})
def host_info():
    ctx = ray.get_runtime_context()
    return (
        os.environ.get("TPU_WORKER_ID"),
        os.environ.get("TPU_NAME"),
        ctx.get_accelerator_ids()["TPU"],
        ctx.get_node_id()[:8],
    )


refs = [
    host_info.options(scheduling_strategy=PlacementGroupSchedulingStrategy(slice_pg.placement_group, i)).remote()
    for i in range(slice_pg.num_hosts)
]
for i, (worker, name, chips, node) in enumerate(ray.get(refs)):
    print(f"bundle {i}: slice {name} TPU_WORKER_ID={worker} chips={chips} node={node}")
slice_pg.shutdown()
print("slice released")
ray.shutdown()
