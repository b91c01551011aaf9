"""placement_group_capture_child_tasks (Ray 2.60): with it, what a task in a placement
group submits without a strategy runs in the same group (and captures in turn); without
it, or with scheduling_strategy="DEFAULT", children run outside the group."""

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init(num_cpus=4)


@ray.remote(num_cpus=0)
def where():
    pg = get_current_placement_group()
    return None if pg is None else pg.id.hex()


@ray.remote(num_cpus=0)
def grandchild_where():
    return ray.get(where.remote())


@ray.remote(num_cpus=1)
def parent():
    default = ray.get(where.remote())
    explicit_default = ray.get(where.options(scheduling_strategy="DEFAULT").remote())
    nested = ray.get(grandchild_where.remote())
    return default, explicit_default, nested


@ray.remote(num_cpus=0)
class InGroup:
    def child_group(self):
        return ray.get(where.remote())


pg = placement_group([{"CPU": 2}])
ray.get(pg.ready())
me = pg.id.hex()


def show(label, values):
    print(label, [v == me if v is not None else None for v in values])


show("capture", ray.get(parent.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    pg, placement_group_capture_child_tasks=True)).remote()))
show("no capture", ray.get(parent.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    pg)).remote()))
actor = InGroup.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    pg, placement_group_capture_child_tasks=True)).remote()
show("actor capture", [ray.get(actor.child_group.remote())])
