"""``tpuray.util``: placement groups, scheduling strategies, metrics and TPU helpers
(Ray's ``ray.util`` layout)."""

from tpuray.util.actor_pool import ActorPool
from tpuray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

__all__ = [
    "ActorPool",
    "PlacementGroup",
    "get_current_placement_group",
    "get_placement_group",
    "placement_group",
    "placement_group_table",
    "remove_placement_group",
    "get_node_ip_address",
]


def get_node_ip_address() -> str:
    """This process's node address (Ray's ``ray.util.get_node_ip_address``)."""
    from tpuray._private import worker

    # This process's own address (on its host; a driver on a host without a node
    # has no agent there).
    return worker.process_info()["address"].rpartition(":")[0]


# Ray's ``ray.util`` submodules are attributes once ``ray`` is imported.
from tpuray.util import metrics, scheduling_strategies, tpu  # noqa: E402
