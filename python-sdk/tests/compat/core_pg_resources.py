"""get_assigned_resources() inside a task or actor scheduled into a placement-group
bundle: the bundle's resources under their plain names, as Ray reports them."""

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init(num_cpus=4, resources={"widget": 2})
pg = placement_group([{"CPU": 2, "widget": 1}, {"CPU": 1}])
ray.get(pg.ready(), timeout=120)


@ray.remote
def assigned():
    c = ray.get_runtime_context()
    return c.get_assigned_resources(), c.get_placement_group_id() == pg.id.hex()


@ray.remote(num_cpus=0)
class InGroup:
    def assigned(self):
        return ray.get_runtime_context().get_assigned_resources()


for label, opts in (
    ("bundle 0 default", dict(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0))),
    ("bundle 0 two cpus and a widget",
     dict(num_cpus=2, resources={"widget": 1},
          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0))),
    ("bundle 1", dict(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 1))),
    ("any bundle", dict(scheduling_strategy=PlacementGroupSchedulingStrategy(pg))),
):
    res, in_pg = ray.get(assigned.options(**opts).remote(), timeout=120)
    print(label, sorted(res.items()), in_pg)
a = InGroup.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 1)).remote()
print("actor num_cpus=1 in bundle 1", sorted(ray.get(a.assigned.remote(), timeout=120).items()))
print("outside the group", sorted(ray.get(assigned.remote(), timeout=120)[0].items()))
remove_placement_group(pg)
ray.shutdown()
