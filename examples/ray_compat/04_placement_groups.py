"""Placement groups: reserve bundles, run tasks and actors inside, remove."""
import tpuray as ray
from tpuray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init(num_cpus=4)

pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
ray.get(pg.ready())
print("created:", placement_group_table(pg)["state"])
print("bundle_count:", pg.bundle_count)


@ray.remote(num_cpus=1)
def inside(i):
    return i + 100


refs = [
    inside.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote(i)
    for i in range(2)
]
print("tasks in bundles:", ray.get(refs))


@ray.remote(num_cpus=1)
class InGroup:
    def ping(self):
        return "pong"


a = InGroup.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
print("actor in bundle:", ray.get(a.ping.remote()))
print("available CPU while reserved:", ray.available_resources().get("CPU", 0) <= 2)
remove_placement_group(pg)
print("removed:", placement_group_table(pg)["state"])
try:
    placement_group([{"CPU": 1}], strategy="SIDEWAYS")
except ValueError as e:
    print("bad strategy:", str(e).split(".")[0])
ray.shutdown()
