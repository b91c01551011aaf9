"""Placement groups (Ray's ``ray.util.placement_group``): bundles of resources reserved
together, all or nothing, by the head and the node agents."""

from __future__ import annotations

from tpuray import _tpuray, exceptions
from tpuray._private import worker

VALID_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class _PlacementGroupID:
    def __init__(self, hex_id: str):
        self._hex = hex_id

    def hex(self) -> str:
        return self._hex

    def __eq__(self, other) -> bool:
        return isinstance(other, _PlacementGroupID) and other._hex == self._hex

    def __hash__(self) -> int:
        return hash(self._hex)

    def __repr__(self) -> str:
        return f"PlacementGroupID({self._hex})"


class PlacementGroup:
    """A handle to a placement group. ``ray.get(pg.ready())`` or ``pg.wait(timeout)``
    waits until every bundle is reserved."""

    def __init__(self, id_hex: str, bundle_count: int, bundle_specs=None):
        self.id = _PlacementGroupID(id_hex)
        self._bundle_count = bundle_count
        self._bundle_specs = bundle_specs

    @property
    def bundle_count(self) -> int:
        return self._bundle_count

    @property
    def bundle_specs(self) -> list[dict]:
        if self._bundle_specs is None:
            st = _tpuray.placement_group_state(self.id.hex(), 0.0)
            self._bundle_specs = [st["bundles"][i] for i in sorted(st["bundles"])]
        return self._bundle_specs

    def wait(self, timeout_seconds: float = 30) -> bool:
        """Waits up to ``timeout_seconds`` for the group; ``False`` on timeout."""
        worker.check_connected()
        st = _tpuray.placement_group_state(self.id.hex(), float(timeout_seconds))
        if st["state"] == "REMOVED":
            raise exceptions.RaySystemError(f"placement group {self.id.hex()} was removed")
        return st["state"] == "CREATED"

    def ready(self):
        """An ``ObjectRef`` that becomes ready when the group is created (Ray's
        ``pg.ready()``): a zero-CPU task scheduled inside the group."""
        from tpuray.remote_function import RemoteFunction
        from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        f = RemoteFunction(_pg_ready, {"num_cpus": 0})
        return f.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self, -1),
            name="PlacementGroup.ready",
        ).remote()

    def __eq__(self, other) -> bool:
        return isinstance(other, PlacementGroup) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __reduce__(self):
        return (PlacementGroup, (self.id.hex(), self._bundle_count, self._bundle_specs))

    def __repr__(self) -> str:
        return f"PlacementGroup({self.id.hex()})"


def _pg_ready():
    return True


def placement_group(
    bundles,
    strategy: str = "PACK",
    name: str = "",
    lifetime=None,
    _max_cpu_fraction_per_node=None,
    _soft_target_node_id=None,
    bundle_label_selector=None,
) -> PlacementGroup:
    """Creates a placement group of ``bundles`` (list of resource dicts) with
    ``strategy``. Returns at once; the group is reserved in the background.

    Raises:
        ValueError: an empty list, an empty bundle, an unknown strategy or lifetime.
    """
    worker.auto_init()
    bundles = list(bundles)
    if not bundles:
        raise ValueError("The placement group `bundles` argument cannot contain an empty list")
    for b in bundles:
        if not isinstance(b, dict) or not b or all(v == 0 for v in b.values()):
            raise ValueError(
                f"Bundles cannot be an empty dictionary or resources with only 0 values. Bundles: {bundles}"
            )
    if strategy not in VALID_STRATEGIES:
        raise ValueError(
            f"Invalid placement group strategy {strategy}. Supported strategies are: {list(VALID_STRATEGIES)}."
        )
    if lifetime not in (None, "detached"):
        raise ValueError(
            f"Placement group `lifetime` argument must be either `None` or 'detached'. Got {lifetime}."
        )
    pg_id, n = _tpuray.create_placement_group(
        [{k: float(v) for k, v in b.items()} for b in bundles],
        strategy,
        name or None,
        worker.state.namespace,
        lifetime == "detached",
        bundle_label_selector,
    )
    return PlacementGroup(pg_id, n, [dict(b) for b in bundles])


def remove_placement_group(placement_group: PlacementGroup) -> None:
    """Removes the group: its bundles are given back and what ran inside is stopped."""
    worker.check_connected()
    _tpuray.remove_placement_group(placement_group.id.hex())


def get_placement_group(placement_group_name: str) -> PlacementGroup:
    """The group with this name in the job's namespace.

    Raises:
        ValueError: no such group.
    """
    worker.check_connected()
    try:
        pg_id, n = _tpuray.get_placement_group(placement_group_name, worker.state.namespace)
    except RuntimeError as e:
        raise ValueError(f"Failed to look up placement group with name: {placement_group_name}") from e
    return PlacementGroup(pg_id, n)


def placement_group_table(placement_group: PlacementGroup | None = None) -> dict:
    """Ray's ``placement_group_table``: one group's entry, or all keyed by id."""
    worker.check_connected()
    if placement_group is not None:
        return _tpuray.placement_group_state(placement_group.id.hex(), 0.0)
    return {g["placement_group_id"]: g for g in _tpuray.placement_group_table()}


def get_current_placement_group():
    """The group the current task runs in, or ``None`` (also in the driver)."""
    pg_id = worker.current_placement_group_id()
    if not pg_id:
        return None
    st = _tpuray.placement_group_state(pg_id, 0.0)
    return PlacementGroup(pg_id, len(st["bundles"]))
