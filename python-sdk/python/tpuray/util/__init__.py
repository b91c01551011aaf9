"""``tpuray.util``: placement groups, scheduling strategies, metrics, TPU helpers,
``ActorPool`` and ``list_named_actors`` (Ray's ``ray.util`` layout). The libraries
``queue``, ``multiprocessing`` and ``collective`` are submodules imported on demand, as
Ray's.

``list_named_actors`` filters the head's ``ListActors`` (live named actors; names in the
job's namespace, or ``{"name", "namespace"}`` dicts). Named actors without a namespace
live in the job's (workers learn it from ``TPURAY_NAMESPACE``, set from the job record).
"""

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
    "list_named_actors",
]


def get_node_ip_address() -> str:
    """This process's node address (Ray's ``ray.util.get_node_ip_address``)."""
    from tpuray._private import worker

    # This process's own address (on its host; a driver on a host without a node
    # has no agent there).
    return worker.process_info()["address"].rpartition(":")[0]


def list_named_actors(all_namespaces: bool = False) -> list:
    """The named actors that are not dead (Ray's ``ray.util.list_named_actors``).

    Args:
        all_namespaces: False: the names in this job's namespace. True: every named
            actor of the cluster, as ``{"name": name, "namespace": namespace}``.

    Returns:
        A list of names, or of dicts with ``all_namespaces``; in no particular order.
    """
    from tpuray import _tpuray
    from tpuray._private import worker

    worker.auto_init()
    named = [
        (namespace, name)
        for _, _, name, namespace, state in _tpuray.list_actors()
        if name and state != "DEAD"
    ]
    if all_namespaces:
        return [{"name": name, "namespace": namespace} for namespace, name in named]
    current = worker.state.namespace or "default"
    return [name for namespace, name in named if namespace == current]


# Ray's ``ray.util`` submodules are attributes once ``ray`` is imported.
from tpuray.util import metrics, scheduling_strategies, tpu  # noqa: E402
