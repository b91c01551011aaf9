"""Scheduling strategies (Ray's ``ray.util.scheduling_strategies``)."""

from __future__ import annotations


class PlacementGroupSchedulingStrategy:
    """Run inside bundle ``placement_group_bundle_index`` (-1: any) of a group."""

    def __init__(self, placement_group, placement_group_bundle_index: int = -1,
                 placement_group_capture_child_tasks=None):
        self.placement_group = placement_group
        self.placement_group_bundle_index = placement_group_bundle_index
        self.placement_group_capture_child_tasks = placement_group_capture_child_tasks


class NodeAffinitySchedulingStrategy:
    """Run on node ``node_id`` (``soft``: elsewhere when it cannot)."""

    def __init__(self, node_id: str, soft: bool, _spill_on_unavailable=False, _fail_on_unavailable=False):
        """:raises ValueError: ``_spill_on_unavailable`` or ``_fail_on_unavailable`` true
            (Ray's private options: spill elsewhere, or fail at once, while the node is
            busy); tpuray's node affinity always waits for a busy node that exists, so
            they are refused by name rather than ignored."""
        for name, value in (("_spill_on_unavailable", _spill_on_unavailable),
                            ("_fail_on_unavailable", _fail_on_unavailable)):
            if value:
                raise ValueError(
                    f"NodeAffinitySchedulingStrategy({name}=True) is not supported by tpuray: "
                    "a task with node affinity waits while its node exists and is busy"
                )
        self.node_id = node_id
        self.soft = soft
        self._spill_on_unavailable = False
        self._fail_on_unavailable = False


class In:
    def __init__(self, *values):
        self.values = list(values)


class NotIn:
    def __init__(self, *values):
        self.values = list(values)


class Exists:
    pass


class DoesNotExist:
    pass


def _selector(expr) -> str:
    if isinstance(expr, In):
        return "in(" + ",".join(expr.values) + ")"
    if isinstance(expr, NotIn):
        return "!in(" + ",".join(expr.values) + ")"
    if isinstance(expr, Exists):
        return ""
    if isinstance(expr, DoesNotExist):
        return "!"
    return str(expr)


class NodeLabelSchedulingStrategy:
    """Run on a node whose labels match ``hard``. tpuray refuses a non-empty ``soft``
    (Ray's preference) by name when a task or actor is submitted with it."""

    def __init__(self, hard: dict, *, soft: dict | None = None):
        self.hard = {k: _selector(v) for k, v in (hard or {}).items()}
        self.soft = {k: _selector(v) for k, v in (soft or {}).items()}


__all__ = [
    "PlacementGroupSchedulingStrategy",
    "NodeAffinitySchedulingStrategy",
    "NodeLabelSchedulingStrategy",
    "In",
    "NotIn",
    "Exists",
    "DoesNotExist",
]
