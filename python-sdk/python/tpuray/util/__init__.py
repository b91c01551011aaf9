"""``tpuray.util``: placement groups, scheduling strategies and TPU helpers (Ray's
``ray.util`` layout)."""

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

    return worker.process_info()["agent_address"].rpartition(":")[0]
