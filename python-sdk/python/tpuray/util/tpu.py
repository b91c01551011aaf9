"""TPU helpers mirroring Ray 2.60's ``ray.util.tpu`` (TPU.md): slice placement groups that
reserve every host of an intact slice, and facts about the current host."""

from __future__ import annotations

import os

from tpuray import _tpuray
from tpuray._private import worker
from tpuray.util.placement_group import PlacementGroup, remove_placement_group


class SlicePlacementGroup:
    """Every host of ``num_slices`` intact slices, reserved together: bundle ``i`` is host
    ``i`` (slices in name order, hosts in ``TPU_WORKER_ID`` order); worker 0's bundle also
    holds the slice's ``TPU-<type>-head`` resource."""

    def __init__(self, pg_id, bundle_count, accelerator_type, num_hosts, chips_per_host, num_slices):
        self._pg = PlacementGroup(pg_id, bundle_count)
        self.accelerator_type = accelerator_type
        self.num_hosts = num_hosts
        self.chips_per_host = chips_per_host
        self.num_slices = num_slices

    @property
    def placement_group(self) -> PlacementGroup:
        return self._pg

    @property
    def slice_placement_group(self) -> PlacementGroup:
        return self._pg

    def shutdown(self) -> None:
        """Releases every host of the slice(s), the head reservation included."""
        remove_placement_group(self._pg)


def slice_placement_group(
    topology: str,
    accelerator_version: str,
    resources_per_bundle: dict | None = None,
    num_slices: int = 1,
    **_ignored,
) -> SlicePlacementGroup:
    """Reserves ``num_slices`` intact slices of ``topology`` (e.g. ``"4x4"``) on
    ``accelerator_version`` (e.g. ``"v6e"``); each host's bundle is ``{"TPU":
    chips_per_host}`` unless ``resources_per_bundle`` is given.

    Raises:
        ValueError: an unknown version, or a topology not valid for it.
    """
    worker.auto_init()
    pg_id, n, ty, hosts, chips = _tpuray.slice_placement_group(
        topology, accelerator_version,
        {k: float(v) for k, v in resources_per_bundle.items()} if resources_per_bundle else None,
        int(num_slices),
    )
    return SlicePlacementGroup(pg_id, n, ty, hosts, chips, num_slices)


def get_current_pod_name():
    """The TPU slice (pod) this process runs on, or ``None``."""
    return os.environ.get("TPU_NAME") or None


def get_current_pod_worker_count():
    """Hosts in the current slice, or ``None`` off TPU hosts."""
    ty = os.environ.get("TPU_ACCELERATOR_TYPE")
    if not ty:
        return None
    hostnames = os.environ.get("TPU_WORKER_HOSTNAMES")
    if hostnames:
        return len(hostnames.split(","))
    gen, _, n = ty.rpartition("-")
    try:
        chips = int(n) // (2 if gen.lower() in ("v4", "v5p") else 1)
    except ValueError:
        return None
    if gen.lower() in ("v5litepod", "v5e", "v6e") and chips <= 8:
        return 1
    return max(1, chips // 4)


def get_num_tpu_chips_on_node() -> int:
    """TPU chips this node advertises (0 off TPU hosts)."""
    me = worker.process_info()["node_id"]
    for n in _tpuray.nodes():
        if n["NodeID"] == me:
            return int(n["Resources"].get("TPU", 0))
    return 0


__all__ = [
    "SlicePlacementGroup",
    "slice_placement_group",
    "get_current_pod_name",
    "get_current_pod_worker_count",
    "get_num_tpu_chips_on_node",
]
