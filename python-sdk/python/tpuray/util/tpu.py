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

    def __init__(self, pg_id, bundle_count, accelerator_type, num_hosts, chips_per_host, num_slices,
                 topology=None, accelerator_version=None):
        self._pg = PlacementGroup(pg_id, bundle_count)
        self.accelerator_type = accelerator_type
        self.num_hosts = num_hosts
        self.chips_per_host = chips_per_host
        self.num_slices = num_slices
        self.topology = topology
        self.accelerator_version = accelerator_version

    def _gang(self, per_chip: bool, name: str, timeout: float = 600.0):
        """A gang generation in this reservation: ``(handle, generation, members)``."""
        return _tpuray.gang_adopt(
            self._pg.id.hex(), self._pg.bundle_count, self.topology, self.accelerator_version,
            int(self.num_slices), bool(per_chip), name, float(timeout), os.urandom(8).hex(),
        )

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
    return SlicePlacementGroup(pg_id, n, ty, hosts, chips, num_slices, topology, accelerator_version)


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
    num_slices: int = 1,
    per_chip: bool = False,
    max_restarts: int = 3,
    name: str | None = None,
    timeout: float = 600.0,
    **kwargs,
) -> list:
    """Runs the remote function ``fn(*args, **kwargs)`` as a gang on every host of
    ``num_slices`` intact slices of ``topology`` on ``accelerator_version`` (Ray 2.60's
    ``ray.util.tpu.run_on_slice``); returns one ``ObjectRef`` per member, in member order
    (hosts in ``TPU_WORKER_ID`` order, slices one after another).

    Each member runs in its host's bundle with ``num_cpus=0`` and ``resources={"TPU":
    chips}`` as in Ray, and with the launch environment of TPU.md's gang section
    (``TPU_WORKER_HOSTNAMES``, ``TORCH_TPU_*``, ``MASTER_ADDR``/``MASTER_PORT``,
    ``NNODES``, ``NODE_RANK``/``JOB_COMPLETION_INDEX``, ``WORLD_SIZE``, the JAX
    coordinator, ``MEGASCALE_*`` for several slices, and ``RANK``/``LOCAL_RANK`` with
    ``per_chip=True``, which runs one process per chip instead of one per host).

    Gang semantics (what Ray lacks): the members start together once every host is
    reserved; if a member or its host dies, every member is stopped and the gang starts
    again on an intact slice (up to ``max_restarts`` times) with
    ``TPURAY_GANG_GENERATION`` one higher; the refs resolve to the generation that
    finished. An exception raised by ``fn`` itself stops the gang and is raised by ``get``
    on the members that did not finish.

    ``tpu_slice``: reuse a ``SlicePlacementGroup`` you reserved instead (its topology and
    version are used; the gang then cannot move, so it is not restarted).

    Raises:
        TypeError: ``fn`` is not a remote function.
        ValueError: an unknown version or a topology not valid for it; the slices not
            reserved within ``timeout`` seconds (naming why the group waits).
    """
    from tpuray.remote_function import RemoteFunction

    if not isinstance(fn, RemoteFunction):
        raise TypeError(
            f"run_on_slice needs a remote function (decorate it with @tpuray.remote), got {type(fn).__name__}"
        )
    if tpu_slice is not None:
        return _run_in_slice(fn, args, kwargs, tpu_slice, per_chip, name)
    if topology is None or accelerator_version is None:
        raise ValueError("run_on_slice needs topology= and accelerator_version= (or tpu_slice=)")
    worker.auto_init()
    base = dict(fn._options)

    def launch(generation, member):
        return fn.options(**_member_options(base, generation, member, False)).remote(
            *args, **kwargs
        )._core

    refs = _tpuray.gang_start(
        str(topology), str(accelerator_version), int(num_slices), bool(per_chip),
        int(max_restarts), _gang_name(name, fn), float(timeout), launch,
    )
    from tpuray._private.serialization import ObjectRef

    return [ObjectRef(r) for r in refs]


def _run_in_slice(fn, args, kwargs, tpu_slice, per_chip, name):
    """Members of a gang in a reservation the caller holds (no restarts: it cannot move)."""
    gen = getattr(tpu_slice, "_gang", None)
    if gen is None or tpu_slice.topology is None:
        raise ValueError(
            "tpu_slice must come from tpuray.util.tpu.slice_placement_group(...) in this process"
        )
    handle, generation, members = gen(per_chip, _gang_name(name, fn))
    base = dict(fn._options)
    return [
        fn.options(**_member_options(base, generation, m, False)).remote(*args, **kwargs)
        for m in members
    ]


_MEMBER_DEATHS = None


def _member_deaths():
    global _MEMBER_DEATHS
    if _MEMBER_DEATHS is None:
        from tpuray import exceptions as ex

        _MEMBER_DEATHS = (ex.RayActorError, ex.WorkerCrashedError, ex.ObjectLostError)
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
        self._handle = None
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
    """Hosts in the current slice, or ``None`` off TPU hosts."""
    ty = os.environ.get("TPU_ACCELERATOR_TYPE")
    if not ty:
        return None
    hostnames = os.environ.get("TPU_WORKER_HOSTNAMES")
    if hostnames:
        return len(hostnames.split(","))
    try:
        # TPU.md's arithmetic, in Rust: v4/v5p/v7x types count TensorCores (tpu7x-16 is 8
        # chips on 2 hosts), v5e/v6e count chips.
        return _tpuray.tpu_slice_shape(ty)[2]
    except ValueError:
        return None


def get_num_tpu_chips_on_node() -> int:
    """TPU chips this node advertises (0 off TPU hosts)."""
    me = worker.process_info()["node_id"]
    for n in _tpuray.nodes():
        if n["NodeID"] == me:
            return int(n["Resources"].get("TPU", 0))
    return 0


__all__ = [
    "SlicePlacementGroup",
    "SliceActorGroup",
    "run_on_slice",
    "torch_device",
    "slice_placement_group",
    "get_current_pod_name",
    "get_current_pod_worker_count",
    "get_num_tpu_chips_on_node",
]
