"""TPU helpers with every public name and argument of Ray 2.60's ``ray.util.tpu``
(TPU.md), each honoured or refused by name, plus what Ray lacks: slice gangs
(:func:`run_on_slice` with restarts and the TorchTPU launch environment,
:class:`SliceActorGroup`) and :func:`torch_device`.

Where tpuray's model differs from Ray's, the argument is honoured when it asks for
what tpuray does and refused naming the difference otherwise:

- A slice is reserved atomically, one bundle per host (worker 0's also holds the
  slice's ``TPU-<type>-head``), so there are no separate head placement groups
  (``head_placement_groups`` is empty, ``release_head_pgs`` has nothing to release)
  and ``head_reservation_timeout_s`` bounds the wait for the whole reservation.
- Hosts come from the slice itself (TPU.md: v5e/v6e ``1x1``/``2x2``/``2x4`` are one
  host, everything else has 4 chips per host): ``chips_per_vm`` is accepted when it
  says the same; ``resources_per_bundle`` may add resources to each host's bundle but
  not split a host (its ``"TPU"``, if given, must be the chips per host); the
  ``TPU`` resource counts chips, so ``tpu_resource_per_chip`` must be 1 (the
  arithmetic helpers take any value).
- ``bundle_label_selector``, ``lifetime="detached"`` and subslices
  (``subslice_placement_group``) are refused by name.

:func:`run_on_slice` passes only the keywords it does not know itself to the function.
"""

from __future__ import annotations

import logging
import math
import os
import warnings

from tpuray import _tpuray
from tpuray._private import worker
from tpuray.util.placement_group import PlacementGroup, remove_placement_group

logger = logging.getLogger(__name__)

#: Ray's default wait for a slice's reservation (seconds).
DEFAULT_TPU_HEAD_RESERVATION_TIMEOUT_S: float = 100.0
#: The MegaScale coordinator's default port (multislice).
DEFAULT_MEGASCALE_PORT = "8081"
#: The generations Ray's names know (``v5litepod`` is v5e).
VALID_TPU_TYPES = ("v2", "v3", "v4", "v5p", "v5litepod", "v6e", "v7x")

_SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
_WORKER_ID_LABEL = "ray.io/tpu-worker-id"
_POD_TYPE_LABEL = "ray.io/tpu-pod-type"
#: v5e/v6e topologies of one host (TPU.md: 1, 4 or 8 chips on it).
_SINGLE_HOST_TOPOLOGIES = ("1x1", "2x2", "2x4")
_EIGHT_CHIP_HOST_TYPES = ("v5litepod", "v6e")
_ONE_CORE_PER_CHIP_TYPES = ("v5litepod", "v6e")
_CHIPS_PER_HOST = 4
#: A wait "without a limit" for the core, which takes seconds as a float.
_FOREVER_S = 10.0 * 365 * 24 * 3600


# ---- arithmetic (no cluster) ----


def get_tpu_version_from_type(accelerator_type: str) -> str:
    """The generation of an accelerator type: ``"TPU-V6E"`` -> ``"v6e"``,
    ``"tpu7x"`` -> ``"v7x"``, ``"v5litepod"`` -> ``"v5litepod"``.

    Raises:
        ValueError: not one of :data:`VALID_TPU_TYPES`.
    """
    lower = accelerator_type.lower()
    if lower.startswith("tpu-"):
        version = lower[len("tpu-"):]
    elif lower.startswith("tpu"):
        version = "v" + lower[len("tpu"):]
    else:
        version = lower
    if version not in VALID_TPU_TYPES:
        raise ValueError(
            f"Invalid accelerator_type: {accelerator_type}. Must be one of "
            f"{list(VALID_TPU_TYPES)} or start with 'TPU-' followed by a valid type."
        )
    return version


def _chips_in(topology: str) -> int:
    return math.prod(int(d) for d in topology.strip().lower().split("x"))


def _chips_per_host(topology: str, version: str) -> int:
    """TPU.md's chips per host (Ray's ``get_chips_per_host``)."""
    if version.strip().lower() in _EIGHT_CHIP_HOST_TYPES and topology.strip().lower() in _SINGLE_HOST_TOPOLOGIES:
        return _chips_in(topology)
    return _CHIPS_PER_HOST


def _resource_per_chip(value) -> int:
    if value is None:
        raw = os.environ.get("RAY_TPU_RESOURCE_PER_CHIP")
        if raw is None:
            return 1
        if not raw.isdecimal() or int(raw) < 1:
            raise ValueError(f"RAY_TPU_RESOURCE_PER_CHIP must be a positive integer, got: {raw!r}")
        return int(raw)
    return value


def _pod_type(topology: str, accelerator_type: str) -> str | None:
    """``v6e-16`` for (``4x4``, ``TPU-V6E``): the generation and its cores (v4, v5p,
    v7x: two per chip)."""
    if not topology or not accelerator_type:
        return None
    generation = accelerator_type.lower().replace("tpu-", "")
    per_chip = 1 if generation.startswith(_ONE_CORE_PER_CHIP_TYPES) else 2
    return f"{generation}-{_chips_in(topology) * per_chip}"


def get_tpu_worker_resources(topology: str, accelerator_type: str, resources_per_worker=None,
                             num_slices: int = 1, chips_per_vm=None, tpu_resource_per_chip=None):
    """How many workers ``num_slices`` slices of ``topology`` hold and each one's
    resources (Ray's arithmetic): by default one worker per host with ``{"CPU": 1,
    "TPU": chips per host}``.

    Returns:
        ``(num_workers, resources_per_worker)``.

    Raises:
        ValueError: an unknown generation, ``TPU`` per worker not dividing the
            slice's, or non-positive values.
    """
    per_chip = _resource_per_chip(tpu_resource_per_chip)
    if per_chip <= 0:
        raise ValueError("`tpu_resource_per_chip` must be a positive integer.")
    version = get_tpu_version_from_type(accelerator_type)
    per_vm = chips_per_vm if chips_per_vm is not None else _chips_per_host(topology, version)
    if per_vm <= 0:
        raise ValueError("chips_per_vm must be positive.")
    per_vm *= per_chip
    per_slice = _chips_in(topology) * per_chip
    available = per_slice * num_slices
    resources = dict(resources_per_worker or {})
    resources.setdefault("CPU", 1)
    resources.setdefault("TPU", per_vm)
    tpus = resources["TPU"]
    if tpus <= 0:
        raise ValueError("TPU resources must be positive.")
    if available % tpus != 0:
        raise ValueError(
            f"Total TPU resources ({available}) not divisible by TPUs requested per worker ({tpus})."
        )
    if per_slice % tpus != 0:
        raise ValueError(
            f"The requested resources per worker ({tpus} TPU devices) do not divide evenly "
            f"into the TPU devices available per slice ({per_slice}). This configuration "
            "results in an uneven distribution of workers across slices, which is not supported."
        )
    return int(available // tpus), resources


def get_tpu_num_slices_for_workers(topology: str, accelerator_type: str, num_workers: int,
                                   resources_per_worker=None, tpu_resource_per_chip=None) -> int:
    """Slices needed for ``num_workers`` workers of ``resources_per_worker``; 1 when
    the inputs are missing or do not compute (as Ray)."""
    if not topology or not accelerator_type:
        return 1
    try:
        per_slice, _ = get_tpu_worker_resources(
            topology, accelerator_type, resources_per_worker, 1,
            tpu_resource_per_chip=tpu_resource_per_chip,
        )
    except Exception:  # noqa: BLE001 - Ray's contract: 1 when it cannot tell
        return 1
    if per_slice == 0:
        return 1
    return max(1, math.ceil(num_workers / per_slice))


def get_tpu_coordinator_env_vars(coordinator_address: str, num_slices: int, slice_id: int,
                                 coordinator_port: str = DEFAULT_MEGASCALE_PORT) -> dict:
    """The ``MEGASCALE_*`` variables of one slice of a multislice job (a gang from
    :func:`run_on_slice` with ``num_slices > 1`` gets them already)."""
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": coordinator_address,
        "MEGASCALE_PORT": coordinator_port,
        "MEGASCALE_NUM_SLICES": str(num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
    }


# ---- the cluster's slices ----


def get_tpu_slice_name_from_node(node: dict):
    """The slice a ``nodes()`` entry belongs to (its ``ray.io/tpu-slice-name``), or
    ``None``."""
    return (node.get("Labels") or {}).get(_SLICE_NAME_LABEL)


def get_tpu_nodes_for_slice(slice_name: str, nodes=None) -> list:
    """The live nodes of slice ``slice_name`` (from ``nodes``, default ``nodes()``;
    ``[]`` when not connected)."""
    if nodes is None:
        if not worker.is_initialized():
            return []
        nodes = _tpuray.nodes()
    return [n for n in nodes if n.get("Alive") and get_tpu_slice_name_from_node(n) == slice_name]


def _intact_slices(topology: str, accelerator_type: str, per_chip: int) -> dict:
    """Slice name -> nodes, for the slices of this shape whose hosts are all alive with
    all their chips and one of them worker 0."""
    if not worker.is_initialized():
        return {}
    try:
        pod_type = _pod_type(topology, accelerator_type)
        expected = _chips_in(topology) * per_chip
    except ValueError:
        return {}
    if not pod_type or expected <= 0:
        return {}
    by_slice: dict = {}
    for n in _tpuray.nodes():
        labels = n.get("Labels") or {}
        if not n.get("Alive") or labels.get(_POD_TYPE_LABEL) != pod_type:
            continue
        single_host = expected <= (n.get("Resources") or {}).get("TPU", 0)
        name = n.get("NodeID") if single_host else get_tpu_slice_name_from_node(n)
        if name:
            by_slice.setdefault(name, []).append(n)
    intact = {}
    for name, members in by_slice.items():
        if sum((m.get("Resources") or {}).get("TPU", 0) for m in members) != expected:
            continue
        has_head = len(members) == 1 or any(
            (m.get("Labels") or {}).get(_WORKER_ID_LABEL) == "0" for m in members
        )
        if has_head:
            intact[name] = members
    return intact


def get_num_tpu_slices(topology: str, accelerator_type: str, tpu_resource_per_chip=None) -> int:
    """Intact slices of this shape in the cluster (every host alive with its chips),
    busy or not; 0 when not connected."""
    return len(_intact_slices(topology, accelerator_type, _resource_per_chip(tpu_resource_per_chip)))


def get_num_ready_tpu_slices(topology: str, accelerator_type: str, tpu_resource_per_chip=None) -> int:
    """Intact slices of this shape whose chips are all free right now."""
    intact = _intact_slices(topology, accelerator_type, _resource_per_chip(tpu_resource_per_chip))
    if not intact:
        return 0
    free = _tpuray.available_resources_per_node()

    def idle(n) -> bool:
        total = (n.get("Resources") or {}).get("TPU", 0)
        if n["NodeID"] not in free:
            return True  # not reported yet: just joined (Ray's assumption)
        return free[n["NodeID"]].get("TPU", 0.0) >= total  # an absent resource is 0 free

    return sum(1 for members in intact.values() if all(idle(n) for n in members))


# ---- slice placement groups ----


def _core_version(accelerator_version: str) -> str:
    """Ray's normal form when Ray knows the name, else as given (tpuray also takes
    ``v5e``)."""
    try:
        return get_tpu_version_from_type(accelerator_version.strip())
    except ValueError:
        return accelerator_version.strip().lower()


class SlicePlacementGroup:
    """Every host of ``num_slices`` intact slices of ``topology`` on
    ``accelerator_version``, reserved together (Ray's ``SlicePlacementGroup``): bundle
    ``i`` is host ``i`` (slices in name order, hosts in ``TPU_WORKER_ID`` order); worker
    0's bundle also holds the slice's ``TPU-<type>-head``.

    Args:
        topology: ``"4x4"``, ``"2x2x2"``, ...
        accelerator_version: ``"v6e"``, ``"v5p"``, ``"TPU-V6E"``, ``"v5litepod"``
            (``"v5e"``), ``"v7x"``, ...
        resources_per_bundle: Resources added to each host's bundle (default: the
            host's chips only). A ``"TPU"`` entry must be the chips per host.
        strategy: ``"SPREAD"`` (Ray's default) or ``"STRICT_SPREAD"``: one bundle per
            host either way; any strategy for a one-host slice.
        name: The group's name (``tpuray status`` shows it); with ``pg_per_slice``
            the groups are ``<name>_slice_<i>``.
        lifetime: ``None``; ``"detached"`` is refused (slice groups end with their job).
        num_slices: How many slices.
        chips_per_vm: Accepted when it equals TPU.md's chips per host.
        head_reservation_timeout_s: Seconds to wait for a multi-host reservation
            (``None``: no limit); one-host slices return at once, as in Ray.
        bundle_label_selector: Refused (tpuray picks the slices).
        pg_per_slice: One group per slice (``slice_placement_groups``) instead of one
            for all.
        tpu_resource_per_chip: Must be 1 (tpuray's ``TPU`` resource counts chips).

    Raises:
        ValueError: an unknown version, a topology not valid for it, or an argument
            tpuray refuses (named in the message).
        TimeoutError: not reserved within ``head_reservation_timeout_s``.
    """

    def __init__(self, topology: str, accelerator_version: str, resources_per_bundle=None,
                 strategy: str = "SPREAD", name: str = "", lifetime=None, num_slices: int = 1,
                 chips_per_vm=None, head_reservation_timeout_s=DEFAULT_TPU_HEAD_RESERVATION_TIMEOUT_S,
                 bundle_label_selector=None, pg_per_slice: bool = False, tpu_resource_per_chip=None):
        self._managed: list = []
        self._shut_down = False
        self._topology = topology.strip().lower()
        self._accelerator_version = _core_version(accelerator_version)
        self._num_slices = int(num_slices)
        self._pg_per_slice = bool(pg_per_slice)
        if self._num_slices < 1:
            raise ValueError(f"num_slices must be at least 1 (got {num_slices})")
        self._tpu_resource_per_chip = _resource_per_chip(tpu_resource_per_chip)
        if self._tpu_resource_per_chip != 1:
            raise ValueError(
                f"tpu_resource_per_chip={self._tpu_resource_per_chip} is not supported by "
                "tpuray: its TPU resource counts chips (TPU.md; v7x's two devices per chip "
                "are in a gang's TORCH_TPU_TOPOLOGY), so it must be 1"
            )
        if bundle_label_selector:
            raise ValueError(
                "bundle_label_selector is not supported by tpuray's slice placement groups: "
                "tpuray picks intact slices itself (a slice's hosts are pinned by its name "
                "and TPU_WORKER_ID)"
            )
        if lifetime not in (None, "non_detached"):
            if lifetime == "detached":
                raise ValueError(
                    "lifetime='detached' is not supported for slice placement groups by "
                    "tpuray: they end with the job that made them"
                )
            raise ValueError(
                f"Placement group `lifetime` argument must be either `None` or 'detached'. Got {lifetime}."
            )
        # The shape, as the core computes it (ValueError naming a bad version/topology).
        ty, chips, hosts, per_host = _tpuray.tpu_slice_shape(
            topology=self._topology, version=self._accelerator_version
        )
        self._accelerator_type = ty
        self._chips_per_host = per_host
        self._hosts_per_slice = hosts
        if chips_per_vm is not None:
            if chips_per_vm <= 0:
                raise ValueError("chips_per_vm must be positive.")
            if chips_per_vm != per_host:
                raise ValueError(
                    f"chips_per_vm={chips_per_vm} is not supported by tpuray: a "
                    f"{self._accelerator_version} {self._topology} slice is {hosts} host(s) of "
                    f"{per_host} chips (TPU.md), and tpuray takes the hosts as the slice "
                    "advertises them"
                )
        if strategy not in ("SPREAD", "STRICT_SPREAD") and hosts > 1:
            raise ValueError(
                f"strategy={strategy!r} is not supported for a multi-host slice by tpuray: "
                "each host of the slice holds one bundle (SPREAD)"
            )
        bundle = {"TPU": float(per_host)}
        for k, v in (resources_per_bundle or {}).items():
            if k == "TPU" and v != per_host:
                raise ValueError(
                    f"resources_per_bundle={{'TPU': {v}}} is not supported by tpuray: a slice "
                    f"group has one bundle per host, each with all {per_host} of its chips; "
                    "for one process per chip use run_on_slice(..., per_chip=True) or "
                    "SliceActorGroup(..., per_chip=True)"
                )
            bundle[k] = float(v)
        self._bundle_resources = bundle
        custom = bundle if resources_per_bundle else None
        worker.auto_init()
        try:
            if self._pg_per_slice:
                for i in range(self._num_slices):
                    self._managed.append(self._reserve(custom, 1, f"{name}_slice_{i}" if name else ""))
            else:
                self._managed.append(self._reserve(custom, self._num_slices, name or ""))
            if hosts > 1:
                self._wait_reserved(head_reservation_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _reserve(self, bundle, num_slices: int, name: str) -> PlacementGroup:
        pg_id, n, _, _, _ = _tpuray.slice_placement_group(
            self._topology, self._accelerator_version, bundle, int(num_slices), name
        )
        return PlacementGroup(pg_id, n)

    def _wait_reserved(self, timeout_s) -> None:
        import time

        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        for pg in self._managed:
            while True:
                left = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
                if pg.wait(min(left, 30.0)):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"Failed to reserve TPU slice with shape: {self._accelerator_type} after "
                        f"{timeout_s} seconds. Ensure your cluster has sufficient resources "
                        f"(needed: {self.num_hosts} host(s) with {self._chips_per_host} TPU chips "
                        "each, on intact slices)."
                    )

    @classmethod
    def _adopt(cls, pg_id: str, bundle_count: int, topology: str, accelerator_version: str,
               num_slices: int = 1):
        """A handle on a slice group made elsewhere in this process."""
        self = cls.__new__(cls)
        self._managed = [PlacementGroup(pg_id, bundle_count)]
        self._shut_down = False
        self._topology = topology.strip().lower()
        self._accelerator_version = _core_version(accelerator_version)
        self._num_slices = int(num_slices)
        self._pg_per_slice = False
        self._tpu_resource_per_chip = 1
        ty, _, hosts, per_host = _tpuray.tpu_slice_shape(topology=self._topology, version=self._accelerator_version)
        self._accelerator_type, self._hosts_per_slice, self._chips_per_host = ty, hosts, per_host
        self._bundle_resources = {"TPU": float(per_host)}
        return self

    def _gang(self, per_chip: bool, name: str, timeout: float = 600.0, index: int = 0):
        """A gang generation in group ``index`` of this reservation: ``(handle,
        generation, members)``."""
        pg = self._managed[index]
        slices = 1 if self._pg_per_slice else self._num_slices
        return _tpuray.gang_adopt(
            pg.id.hex(), pg.bundle_count, self._topology, self._accelerator_version,
            int(slices), bool(per_chip), name, float(timeout), os.urandom(8).hex(),
        )

    @property
    def tpu_resource_per_chip(self) -> int:
        """Always 1: the ``TPU`` resource counts chips."""
        return self._tpu_resource_per_chip

    @property
    def slice_placement_group(self):
        """The one group of every slice (``None`` once shut down).

        Raises:
            ValueError: made with ``pg_per_slice=True``.
        """
        if self._pg_per_slice:
            raise ValueError("pg_per_slice=True, use `slice_placement_groups` instead.")
        return self._managed[0] if self._managed else None

    @property
    def placement_group(self):
        """``slice_placement_group``."""
        return self.slice_placement_group

    @property
    def slice_placement_groups(self) -> list:
        """One group per slice.

        Raises:
            ValueError: made without ``pg_per_slice=True``.
        """
        if not self._pg_per_slice:
            raise ValueError("pg_per_slice=False, use `slice_placement_group` instead.")
        return self._managed

    @property
    def accelerator_type(self) -> str:
        """The slice's type as TPU.md writes it, e.g. ``v6e-16``."""
        return self._accelerator_type

    @property
    def chips_per_host(self) -> int:
        return self._chips_per_host

    @property
    def devices_per_host(self) -> int:
        """The ``TPU`` resource per host (chips, as ``tpu_resource_per_chip`` is 1)."""
        return self._chips_per_host * self._tpu_resource_per_chip

    @property
    def num_hosts(self) -> int:
        """Hosts over all slices."""
        return self._hosts_per_slice * self._num_slices

    @property
    def num_bundles(self) -> int:
        """Bundles over all slices (one per host)."""
        return self.num_hosts

    @property
    def topology(self) -> str:
        return self._topology

    @property
    def accelerator_version(self) -> str:
        return self._accelerator_version

    @property
    def num_slices(self) -> int:
        return self._num_slices

    @property
    def head_placement_groups(self) -> list:
        """Empty: tpuray reserves a slice's head inside the slice's own group."""
        return []

    @property
    def bundle_label_selector(self) -> list:
        """Per bundle, the slice it landed on (``{"ray.io/tpu-slice-name": name}``);
        ``{}`` for bundles not placed yet."""
        out: list[dict[str, str]] = []
        if not self._managed:
            return out
        slice_of = {n["NodeID"]: get_tpu_slice_name_from_node(n) for n in _tpuray.nodes()}
        for pg in self._managed:
            placed = _tpuray.placement_group_state(pg.id.hex(), 0.0).get("bundles_to_node_id") or {}
            for i in range(pg.bundle_count):
                name = slice_of.get(placed.get(i, ""))
                out.append({_SLICE_NAME_LABEL: name} if name else {})
        return out

    @property
    def bundle_resources(self) -> dict:
        """The resources of each bundle (one host's)."""
        return dict(self._bundle_resources)

    def release_head_pgs(self, slice_index=None) -> None:
        """Nothing to release (the head is part of the slice's group); checks
        ``slice_index`` as Ray does.

        Raises:
            ValueError: ``slice_index`` out of range.
        """
        if slice_index is not None and not 0 <= slice_index < self._num_slices:
            raise ValueError(f"Invalid slice_index: {slice_index}.")

    def shutdown(self) -> None:
        """Releases every host of the slice(s), the head reservation included.
        Idempotent."""
        groups, self._managed = self._managed, []
        self._shut_down = True
        for pg in groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - release the rest
                logger.exception("Failed to remove TPU slice placement group %s.", pg.id.hex())


def slice_placement_group(topology: str, accelerator_version: str, resources_per_bundle=None,
                          num_slices: int = 1, chips_per_vm=None, pg_per_slice: bool = False,
                          tpu_resource_per_chip=None, **kwargs) -> SlicePlacementGroup:
    """Reserves ``num_slices`` intact slices (Ray's ``slice_placement_group``); keyword
    arguments ``name``, ``lifetime``, ``strategy``, ``head_reservation_timeout_s`` and
    ``bundle_label_selector`` go to :class:`SlicePlacementGroup` (which says what each
    means and refuses).

    Raises:
        TypeError: another keyword argument.
        ValueError / TimeoutError: as :class:`SlicePlacementGroup`.
    """
    allowed = {"name", "lifetime", "strategy", "head_reservation_timeout_s", "bundle_label_selector"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(f"slice_placement_group() got unexpected keyword argument(s) {unknown}")
    return SlicePlacementGroup(
        topology, accelerator_version, resources_per_bundle=resources_per_bundle,
        num_slices=num_slices, chips_per_vm=chips_per_vm, pg_per_slice=pg_per_slice,
        tpu_resource_per_chip=tpu_resource_per_chip, **kwargs,
    )


def _gang_name(name, fn) -> str:
    if name:
        return str(name)
    return getattr(fn, "_name", None) or getattr(fn, "__name__", None) or "gang"


def _member_options(base_options: dict, generation: dict, member: dict, actor: bool) -> dict:
    """The options a gang member runs with: its bundle, ``num_cpus=0``, its chips (Ray
    2.60's ``run_on_slice`` member options), no retries of its own (the gang restarts as a
    whole) and the gang's environment merged over the function's ``runtime_env``."""
    from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rt = dict(base_options.get("runtime_env") or {})
    rt["env_vars"] = {**(rt.get("env_vars") or {}), **member["env"]}
    pg = PlacementGroup(generation["placement_group_id"], generation["bundle_count"])
    opts = {
        "num_cpus": 0,
        "resources": {**(base_options.get("resources") or {}), "TPU": member["chips"]},
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, member["bundle_index"]),
        "runtime_env": rt,
    }
    if actor:
        opts["max_restarts"] = 0
    else:
        opts["max_retries"] = 0
    return opts


def run_on_slice(
    fn,
    *args,
    topology: str | None = None,
    accelerator_version: str | None = None,
    tpu_slice: SlicePlacementGroup | None = None,
    slice_index: int | None = None,
    num_slices: int = 1,
    chips_per_vm: int | None = None,
    head_reservation_timeout_s: float | None = DEFAULT_TPU_HEAD_RESERVATION_TIMEOUT_S,
    pg_ready_timeout_s: float | None = None,
    per_chip: bool = False,
    max_restarts: int = 3,
    name: str | None = None,
    timeout: float | None = None,
    **kwargs,
) -> list:
    """Runs the remote function ``fn(*args, **kwargs)`` as a gang on every host of
    ``num_slices`` intact slices of ``topology`` on ``accelerator_version`` (Ray 2.60's
    ``ray.util.tpu.run_on_slice``); returns one ``ObjectRef`` per member, in member order
    (hosts in ``TPU_WORKER_ID`` order, slices one after another).

    Ray's arguments: ``tpu_slice`` (run in a :class:`SlicePlacementGroup` you hold;
    the gang then cannot move, so it is not restarted), ``slice_index`` (with a
    ``tpu_slice`` made with ``pg_per_slice=True``: only that slice), ``num_slices``,
    ``chips_per_vm`` (as :class:`SlicePlacementGroup` takes it),
    ``head_reservation_timeout_s`` and ``pg_ready_timeout_s`` (how long to wait for the
    slices: both together bound tpuray's one atomic reservation, ``None`` for either
    means no limit when the other is ``None`` too; for a ``tpu_slice``,
    ``pg_ready_timeout_s`` alone). Every other keyword argument goes to ``fn``.

    Each member runs in its host's bundle with ``num_cpus=0`` and ``resources={"TPU":
    chips}`` as in Ray, and with the launch environment of TPU.md's gang section
    (``TPU_WORKER_HOSTNAMES``, ``TORCH_TPU_*``, ``MASTER_ADDR``/``MASTER_PORT``,
    ``NNODES``, ``NODE_RANK``/``JOB_COMPLETION_INDEX``, ``WORLD_SIZE``, the JAX
    coordinator, ``MEGASCALE_*`` for several slices, and ``RANK``/``LOCAL_RANK`` with
    ``per_chip=True``, which runs one process per chip instead of one per host).

    Gang semantics (what Ray lacks; tpuray's own arguments ``per_chip``,
    ``max_restarts``, ``name``, ``timeout``): the members start together once every host
    is reserved; if a member or its host dies, every member is stopped and the gang
    starts again on an intact slice (up to ``max_restarts`` times) with
    ``TPURAY_GANG_GENERATION`` one higher; the refs resolve to the generation that
    finished. An exception raised by ``fn`` itself stops the gang and is raised by
    ``get`` on the members that did not finish. ``timeout`` (seconds) overrides the
    two Ray timeouts.

    Raises:
        TypeError: ``fn`` is not a remote function.
        ValueError: an unknown version or a topology not valid for it; ``slice_index``
            without a ``pg_per_slice`` ``tpu_slice`` or out of range; a ``tpu_slice``
            already shut down; ``chips_per_vm`` other than the slice's.
        TimeoutError: the slices not reserved in time (naming why the group waits).
    """
    from tpuray.remote_function import RemoteFunction

    if not isinstance(fn, RemoteFunction):
        raise TypeError(
            f"run_on_slice needs a remote function (decorate it with @tpuray.remote), got {type(fn).__name__}"
        )
    if slice_index is not None:
        if tpu_slice is None:
            raise ValueError("slice_index can only be used when an existing tpu_slice is provided.")
        if not tpu_slice._pg_per_slice:
            raise ValueError(
                "slice_index can only be used when tpu_slice was created with pg_per_slice=True."
            )
        if not 0 <= slice_index < tpu_slice.num_slices:
            raise ValueError(
                f"Invalid slice_index {slice_index}. Must be between 0 and {tpu_slice.num_slices - 1}."
            )
    if tpu_slice is not None:
        wait = timeout if timeout is not None else (_FOREVER_S if pg_ready_timeout_s is None else pg_ready_timeout_s)
        return _run_in_slice(fn, args, kwargs, tpu_slice, per_chip, name, slice_index, wait)
    if topology is None or accelerator_version is None:
        raise ValueError(
            "topology and accelerator_version are required when tpu_slice is not provided."
        )
    if chips_per_vm is not None:
        _, _, hosts, per_host = _tpuray.tpu_slice_shape(topology=topology, version=_core_version(accelerator_version))
        if chips_per_vm != per_host:
            raise ValueError(
                f"chips_per_vm={chips_per_vm} is not supported by tpuray: a {accelerator_version} "
                f"{topology} slice is {hosts} host(s) of {per_host} chips (TPU.md)"
            )
    if timeout is None:
        if head_reservation_timeout_s is None and pg_ready_timeout_s is None:
            timeout = _FOREVER_S
        else:
            timeout = (head_reservation_timeout_s or 0.0) + (pg_ready_timeout_s or 0.0)
    worker.auto_init()
    base = dict(fn._options)

    def launch(generation, member):
        return fn.options(**_member_options(base, generation, member, False)).remote(
            *args, **kwargs
        )._core

    try:
        refs = _tpuray.gang_start(
            str(topology), _core_version(str(accelerator_version)), int(num_slices), bool(per_chip),
            int(max_restarts), _gang_name(name, fn), float(timeout), launch,
        )
    except ValueError as e:
        raise _timeout_or(e) from None
    from tpuray._private.serialization import ObjectRef

    return [ObjectRef(r) for r in refs]


def _timeout_or(e: ValueError) -> Exception:
    """The core's "was not reserved within" as Ray's ``TimeoutError``; other errors as
    they are."""
    if "was not reserved within" in str(e):
        return TimeoutError(str(e))
    return e


def _run_in_slice(fn, args, kwargs, tpu_slice, per_chip, name, slice_index, wait):
    """Members of a gang in a reservation the caller holds (no restarts: it cannot
    move), one gang per group with ``pg_per_slice``."""
    if not isinstance(tpu_slice, SlicePlacementGroup):
        raise ValueError("tpu_slice must come from tpuray.util.tpu.slice_placement_group(...)")
    if tpu_slice._shut_down or not tpu_slice._managed:
        raise ValueError(
            "The provided tpu_slice has already been shut down. Create a new "
            "SlicePlacementGroup or pass tpu_slice=None to reserve one automatically."
        )
    if slice_index is not None:
        indexes = [slice_index]
    else:
        indexes = list(range(len(tpu_slice._managed)))
    base = dict(fn._options)
    refs = []
    for i in indexes:
        try:
            _, generation, members = tpu_slice._gang(per_chip, _gang_name(name, fn), wait, index=i)
        except ValueError as e:
            raise _timeout_or(e) from None
        refs.extend(
            fn.options(**_member_options(base, generation, m, False)).remote(*args, **kwargs)
            for m in members
        )
    return refs


def dispatch(*args, **kwargs) -> list:
    """Deprecated: Ray's old name of :func:`run_on_slice`."""
    warnings.warn(
        "'dispatch' is deprecated and has been renamed to 'run_on_slice'. Please use "
        "'run_on_slice' instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    return run_on_slice(*args, **kwargs)


def init_jax_profiler(port: int | None = None) -> None:
    """Starts JAX's profiler server in this process (on ``port``, default
    ``JAX_PROFILER_PORT`` or 9999) and records the port in the head's KV (namespace
    ``jax_profiler``, key ``<node id>:<pid>``) so tools can find it. Logs and returns
    when JAX is not installed or the server cannot start (as Ray)."""
    try:
        import jax
    except ImportError:
        logger.warning("JAX is not installed, skipping JAX profiler setup")
        return
    if port is None:
        port = int(os.getenv("JAX_PROFILER_PORT", "9999"))
    try:
        jax.profiler.start_server(port)
    except Exception as e:  # noqa: BLE001 - Ray logs and carries on
        logger.error(f"Failed to start JAX profiler server on port {port}: {e}")
        return
    logger.info(f"Started JAX profiler server on port {port}")
    if worker.is_initialized():
        try:
            key = f"{worker.process_info()['node_id']}:{os.getpid()}".encode()
            _tpuray.kv_put("jax_profiler", key, str(port).encode(), True)
        except Exception as e:  # noqa: BLE001
            logger.warning(f"Failed to register JAX profiler port in the KV: {e}")


class SubslicePlacementGroup:
    """Ray's handle on a subslice reservation (a contiguous block of a slice's
    workers). tpuray cannot make one (see :func:`subslice_placement_group`); the class
    exists for code that names it."""

    def __init__(self, placement_group, parent_topology, subslice_topology, subslice_index,
                 slice_name, num_hosts, chips_per_host, bundle_resources,
                 head_placement_groups=None, bundle_label_selectors=None):
        self._placement_group = placement_group
        self.parent_topology = parent_topology
        self.subslice_topology = subslice_topology
        self.subslice_index = subslice_index
        self.slice_name = slice_name
        self.num_hosts = num_hosts
        self.chips_per_host = chips_per_host
        self.bundle_resources = bundle_resources
        self.head_placement_groups = list(head_placement_groups or [])
        self.bundle_label_selector = list(bundle_label_selectors or [])

    @property
    def placement_group(self):
        return self._placement_group

    def release_head_pgs(self) -> None:
        groups, self.head_placement_groups = self.head_placement_groups, []
        for pg in groups:
            remove_placement_group(pg)

    def shutdown(self) -> None:
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        self.release_head_pgs()


def subslice_placement_group(subslice_topology: str, accelerator_version: str, chips_per_vm=None,
                             resources_per_bundle=None, strategy: str = "STRICT_SPREAD", name: str = "",
                             lifetime=None,
                             head_reservation_timeout_s=DEFAULT_TPU_HEAD_RESERVATION_TIMEOUT_S,
                             subslice_index=None) -> SubslicePlacementGroup:
    """Refused: subslices are not supported by tpuray.

    Raises:
        NotImplementedError: always (Ray discovers a slice's physical chip layout
            through libtpu to cut ICI-connected subslices; tpuray reserves whole
            slices only: use a smaller slice's topology with
            :func:`slice_placement_group`).
    """
    raise NotImplementedError(
        f"subslice_placement_group({subslice_topology!r}, {accelerator_version!r}) is not "
        "supported by tpuray: it reserves whole intact slices only (Ray discovers a "
        "slice's chip layout through libtpu to cut subslices); use slice_placement_group "
        "with the topology of a whole slice"
    )


_MEMBER_DEATHS = None


def _member_deaths():
    global _MEMBER_DEATHS
    if _MEMBER_DEATHS is None:
        from tpuray import exceptions as ex

        _MEMBER_DEATHS = (ex.RayActorError, ex.WorkerCrashedError, ex.NodeDiedError, ex.ObjectLostError)
    return _MEMBER_DEATHS


class SliceActorGroup:
    """One actor of ``actor_cls`` per member of a slice gang (the actor-group form):
    created together on every host of ``num_slices`` intact slices, called together with
    :meth:`call`, and restarted together.

    Each actor runs with ``num_cpus=0``, its host's chips (or one chip with
    ``per_chip=True``) and the gang environment that :func:`run_on_slice` gives members.
    When a member or its host dies during :meth:`call`, every member is stopped, the group
    is created again on an intact slice (up to ``max_restarts`` times) with
    ``TPURAY_GANG_GENERATION`` one higher, and the call is made again, so methods called
    through :meth:`call` should be safe to repeat.

    Raises (constructor):
        TypeError: ``actor_cls`` is not a remote class.
        ValueError: as :func:`run_on_slice`.
    """

    def __init__(self, actor_cls, *args, topology: str, accelerator_version: str,
                 num_slices: int = 1, per_chip: bool = False, max_restarts: int = 3,
                 name: str | None = None, timeout: float = 600.0, **kwargs):
        from tpuray.actor import ActorClass

        if not isinstance(actor_cls, ActorClass):
            raise TypeError(
                f"SliceActorGroup needs a remote class (decorate it with @tpuray.remote), got {type(actor_cls).__name__}"
            )
        worker.auto_init()
        self._cls = actor_cls
        self._args = args
        self._kwargs = kwargs
        self._spec = (str(topology), str(accelerator_version), int(num_slices), bool(per_chip))
        self._name = name or getattr(actor_cls, "_name", None) or "actor-group"
        self._timeout = float(timeout)
        self.max_restarts = int(max_restarts)
        self.restarts = 0
        self._gang_id = os.urandom(8).hex()
        self._handle: str | None = None
        self.actors: list = []
        self.members: list[dict] = []
        self.info: dict = {}
        self._start(0)

    def _start(self, generation: int) -> None:
        self._release()
        topology, version, slices, per_chip = self._spec
        handle, info, members = _tpuray.gang_reserve(
            topology, version, slices, per_chip, self._name, self._timeout, self._gang_id,
            generation,
        )
        self._handle, self.info, self.members = handle, info, members
        base = dict(self._cls._options)
        try:
            self.actors = [
                self._cls.options(**_member_options(base, info, m, True)).remote(
                    *self._args, **self._kwargs
                )
                for m in members
            ]
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._handle is not None:
            _tpuray.gang_release(self._handle)
            self._handle = None
        self.actors = []

    @property
    def generation(self) -> int:
        """0 for the first start; one more per restart."""
        return int(self.info.get("generation", 0))

    def call(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        """Calls ``method(*args, **kwargs)`` on every member and returns the results in
        member order, restarting the group when a member died (see the class).

        Raises:
            AttributeError: no such method.
            RayTaskError: the method raised (no restart).
            RayActorError: a member died and no restarts remain.
        """
        from tpuray._private import worker as w

        while True:
            if not self.actors:
                raise RuntimeError("the actor group was shut down")
            refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
            try:
                return w.get(refs, timeout=timeout)
            except _member_deaths() as e:
                if self.restarts >= self.max_restarts:
                    raise
                self.restarts += 1
                import logging

                logging.getLogger("tpuray").warning(
                    "actor group %s lost a member (%s); starting generation %d",
                    self._name, type(e).__name__, self.generation + 1,
                )
                self._start(self.generation + 1)

    def call_async(self, method: str, *args, **kwargs) -> list:
        """``method.remote(...)`` on every member: one ref per member, no restarts."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def shutdown(self) -> None:
        """Stops every member and releases the slices."""
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def torch_device():
    """The PyTorch device this process should use (TPU.md): ``tpu`` when ``torch_tpu``
    imports, else ``cuda`` when CUDA is available, else ``cpu``. Also sets
    ``JAX_PLATFORMS`` to match (``tpu``, ``cuda`` or ``cpu``) unless it is set already, so
    one script runs unchanged on TPU hosts, GPU hosts and CPUs.

    Returns:
        ``torch.device``.

    Raises:
        ImportError: PyTorch is not installed.
    """
    import torch

    kind = "cpu"
    try:
        import torch_tpu  # noqa: F401

        kind = "tpu"
    except ImportError:
        if torch.cuda.is_available():
            kind = "cuda"
    os.environ.setdefault("JAX_PLATFORMS", kind)
    return torch.device(kind)


def get_current_pod_name():
    """The TPU slice (pod) this process runs on, or ``None``."""
    return os.environ.get("TPU_NAME") or None


def get_current_pod_worker_count():
    """Hosts in the current slice (Ray's arithmetic: the slice's cores over this host's
    chips' cores), or ``None`` off TPU hosts."""
    ty = os.environ.get("TPU_ACCELERATOR_TYPE")
    if not ty:
        return None
    try:
        # TPU.md's normal form, from Rust (tpu7x-16 -> v7x-16).
        ty = _tpuray.tpu_slice_shape(ty)[0]
    except ValueError:
        return None
    chips = get_num_tpu_chips_on_node()
    generation, _, cores = ty.partition("-")
    per_host = chips * (1 if generation.startswith(_ONE_CORE_PER_CHIP_TYPES) else 2)
    if not cores.isdigit() or per_host <= 0:
        return None
    return -(-int(cores) // per_host)


def get_num_tpu_chips_on_node() -> int:
    """TPU chips of this node: what its agent advertises (``TPU`` in ``nodes()``) when
    connected, else the ``/dev/accel*`` character devices (TPU.md); 0 off TPU hosts."""
    if worker.is_initialized():
        me = worker.process_info()["node_id"]
        for n in _tpuray.nodes():
            if n["NodeID"] == me:
                return int(n["Resources"].get("TPU", 0))
        return 0
    import glob
    import stat

    count = 0
    for path in glob.glob("/dev/accel*"):
        try:
            if stat.S_ISCHR(os.stat(path).st_mode):
                count += 1
        except OSError:
            pass
    return count


__all__ = [
    "DEFAULT_MEGASCALE_PORT",
    "DEFAULT_TPU_HEAD_RESERVATION_TIMEOUT_S",
    "SliceActorGroup",
    "SlicePlacementGroup",
    "SubslicePlacementGroup",
    "dispatch",
    "get_current_pod_name",
    "get_current_pod_worker_count",
    "get_num_ready_tpu_slices",
    "get_num_tpu_chips_on_node",
    "get_num_tpu_slices",
    "get_tpu_coordinator_env_vars",
    "get_tpu_nodes_for_slice",
    "get_tpu_num_slices_for_workers",
    "get_tpu_slice_name_from_node",
    "get_tpu_version_from_type",
    "get_tpu_worker_resources",
    "init_jax_profiler",
    "run_on_slice",
    "slice_placement_group",
    "subslice_placement_group",
    "torch_device",
]
