"""``WorkerGroup``: a gang of actors for a trainer or sampler pool, on TPU slices or on CPUs.

A group is either every host of ``num_slices`` intact TPU slices (one actor per host, a
:class:`tpuray.util.tpu.SliceActorGroup` with the TPU launch environment of TPU.md) or
``num_workers`` actors of ``num_cpus`` CPUs each in a placement group of their own. Either
way its resources are reserved for it alone, so a trainer group and a sampler group never
share TPU chips or CPUs. Before reserving, the group checks that the cluster can hold it
and fails at once, naming the missing resource and who holds it, instead of waiting for
resources that will not come.

The check reads the node table and the placement group table, then reserves; another
driver reserving in between can still make the reservation wait (up to ``timeout``
seconds, then ``PoolUnsatisfiableError``). Work that holds TPU chips or CPUs outside any
placement group is not visible to the check.

TPU form: a member death restarts the group, up to ``max_restarts``, and repeats the
call. CPU form: the placement group is ``SPREAD``, and members get ``MASTER_ADDR``/
``MASTER_PORT`` (a free port on member 0's node), ``NNODES``, ``NODE_RANK``,
``WORLD_SIZE``, ``RANK``. ``call`` gathers one result per member; ``call_each`` gives
each member its own arguments.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, cast

import tpuray
from tpuray.exceptions import RaySchedulingError

_PREFIX = "tpuray.io/"
#: Groups alive in this process, by name (what the capacity error says holds a slice).
_LIVE: dict[str, "WorkerGroup"] = {}


class PoolUnsatisfiableError(RaySchedulingError, ValueError):
    """The cluster cannot hold the requested worker group (the message names the missing
    resource and what holds the rest)."""


def _slice_shape(topology: str, accelerator_version: str) -> tuple[str, int]:
    """``(accelerator type, hosts)`` of one slice, e.g. ``("v6e-16", 4)`` for ``4x4`` v6e
    or ``("v7x-16", 2)`` for ``2x2x2`` v7x (TPU.md's arithmetic, from the Rust core).

    Raises:
        ValueError: an unknown version or a topology not valid for it.
    """
    from tpuray import _tpuray

    ty, _chips, hosts, _per_host = _tpuray.tpu_slice_shape(
        topology=str(topology), version=str(accelerator_version))
    return ty, hosts


def _held_by_placement_groups() -> dict[str, list]:
    """``node id -> [(group name, bundle resources)]`` for every created placement group."""
    from tpuray.util.placement_group import placement_group_table

    held: dict[str, list] = {}
    for g in placement_group_table().values():
        if g.get("state") != "CREATED":
            continue
        nodes = g.get("bundles_to_node_id") or {}
        for i, res in (g.get("bundles") or {}).items():
            node = nodes.get(i) or nodes.get(str(i))
            if node:
                held.setdefault(node, []).append((g.get("name") or "", dict(res)))
    return held


def _holder(pg_name: str) -> str:
    """The group that a placement group name belongs to (``gang:<name>:<generation>``)."""
    if pg_name.startswith("gang:"):
        return pg_name[5:].rpartition(":")[0] or pg_name
    if pg_name.startswith("workers:"):
        return pg_name[8:]
    return pg_name or "an unnamed placement group"


def _check_tpu_capacity(name: str, topology: str, version: str, num_slices: int) -> None:
    pod_type, hosts = _slice_shape(topology, version)
    slices: dict[str, dict[int, dict]] = {}
    for n in tpuray.nodes():
        lab = n.get("Labels") or {}
        if not n.get("Alive", True) or lab.get(_PREFIX + "tpu-pod-type") != pod_type:
            continue
        if lab.get(_PREFIX + "tpu-topology", topology) != str(topology):
            continue
        try:
            wid = int(lab.get(_PREFIX + "tpu-worker-id", ""))
        except ValueError:
            continue
        slices.setdefault(lab.get(_PREFIX + "tpu-slice-name", ""), {})[wid] = n
    held = _held_by_placement_groups()
    intact, broken, free, holders = [], [], [], {}
    for sname, by_worker in sorted(slices.items()):
        if set(by_worker) != set(range(hosts)):
            broken.append(f"slice {sname} has {len(by_worker)} of {hosts} hosts")
            continue
        intact.append(sname)
        who = sorted({_holder(pg) for w in by_worker.values()
                      for pg, res in held.get(w["NodeID"], []) if res.get("TPU", 0) > 0})
        if who:
            holders[sname] = who
        else:
            free.append(sname)
    if len(free) >= num_slices:
        return
    missing = num_slices - len(free)
    msg = (f"{name} pool needs {missing} more intact {pod_type} slice{'s' if missing > 1 else ''} "
           f"(TPU {topology}): cluster has {len(intact)}")
    if holders:
        if len(intact) == 1 and len(holders) == 1:
            msg += f", {' and '.join(next(iter(holders.values())))} hold{'s' if len(next(iter(holders.values()))) == 1 else ''} it"
        else:
            msg += ", " + ", ".join(f"{' and '.join(w)} hold{'s' if len(w) == 1 else ''} {s}"
                                    for s, w in holders.items())
    if broken:
        msg += f" ({'; '.join(broken)})"
    raise PoolUnsatisfiableError(msg)


def _check_cpu_capacity(name: str, num_workers: int, bundle: dict) -> None:
    held = _held_by_placement_groups()
    fits, holders, per_node = 0, set(), []
    for n in tpuray.nodes():
        if not n.get("Alive", True):
            continue
        total = n.get("Resources") or {}
        used: dict[str, float] = {}
        for pg, res in held.get(n["NodeID"], []):
            for k, v in res.items():
                used[k] = used.get(k, 0.0) + float(v)
            if any(res.get(k, 0) > 0 for k in bundle):
                holders.add(_holder(pg))
        free = {k: float(total.get(k, 0.0)) - used.get(k, 0.0) for k in bundle}
        here = min(int(math.floor(free[k] / v + 1e-9)) for k, v in bundle.items() if v > 0)
        fits += max(0, here)
        per_node.append(f"{n['NodeID'][:8]} {', '.join(f'{k} {free[k]:g}' for k in bundle)}")
    if fits >= num_workers:
        return
    what = ", ".join(f"{k}: {v:g}" for k, v in bundle.items())
    missing = num_workers - fits
    msg = (f"{name} pool needs {missing} more worker{'s' if missing > 1 else ''} of {{{what}}} "
           f"({num_workers} requested, the cluster has room for {fits}")
    if holders:
        msg += f"; {' and '.join(sorted(holders))} hold{'s' if len(holders) == 1 else ''} the rest"
    msg += f"; free per node: {'; '.join(per_node) or 'no nodes'})"
    raise PoolUnsatisfiableError(msg)


@tpuray.remote(num_cpus=0)
def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    from tpuray.util import get_node_ip_address

    return get_node_ip_address(), port


class WorkerGroup:
    """``n`` actors of ``actor_cls`` reserved and called together: a trainer or sampler pool.

    TPU form (``topology`` and ``accelerator_version`` given): one actor per host of
    ``num_slices`` intact slices, each with its host's chips and the gang environment of
    :func:`tpuray.util.tpu.run_on_slice` (``TPU_WORKER_ID``, ``MASTER_ADDR``/``MASTER_PORT``,
    ``NNODES``, ``NODE_RANK``...); a member death restarts the whole group on an intact
    slice (``max_restarts``) and repeats the call.

    CPU form (``num_workers`` given): ``num_workers`` actors of ``num_cpus`` CPUs (plus
    ``resources``) in a placement group of their own (``strategy``, default ``SPREAD``),
    with the same variables for ``torch.distributed``: ``MASTER_ADDR``/``MASTER_PORT``
    (a free port on member 0's node), ``NNODES`` and ``WORLD_SIZE`` (members), ``NODE_RANK``
    and ``RANK`` (the member's index). No group restarts: a member death raises.

    Either form sets ``TPURAY_WORKER_GROUP`` (the name) in every member. The constructor
    checks capacity first and raises at once when the cluster cannot hold the group.

    Args:
        actor_cls: a ``@tpuray.remote`` class; ``*args``/``**kwargs`` go to its constructor.
        name: the pool's name, used in errors, in ``tpuray status`` and by other groups'
            capacity errors ("trainer holds it").
        topology, accelerator_version, num_slices: the TPU form (e.g. ``"4x4"``, ``"v6e"``).
        num_workers, num_cpus, resources, strategy: the CPU form.
        max_restarts: TPU form only, group restarts on member deaths.
        timeout: seconds to wait for the reservation after the capacity check passed.

    Raises:
        TypeError: ``actor_cls`` is not a remote class.
        ValueError: both forms or neither, a bad topology or count.
        PoolUnsatisfiableError: the cluster cannot hold the group (checked before
            reserving; also raised when the reservation is not made within ``timeout``).
    """

    def __init__(self, actor_cls, *args, name: str = "workers", topology: Optional[str] = None,
                 accelerator_version: Optional[str] = None, num_slices: int = 1,
                 num_workers: Optional[int] = None, num_cpus: float = 1.0,
                 resources: Optional[dict] = None, strategy: str = "SPREAD",
                 max_restarts: int = 0, timeout: float = 60.0, **kwargs):
        from tpuray.actor import ActorClass

        if not isinstance(actor_cls, ActorClass):
            raise TypeError(
                f"WorkerGroup needs a remote class (decorate it with @tpuray.remote), got {type(actor_cls).__name__}"
            )
        tpu_form = topology is not None or accelerator_version is not None
        if tpu_form == (num_workers is not None):
            raise ValueError(
                "give either topology= and accelerator_version= (a TPU slice group) or "
                "num_workers= (a CPU group), not both or neither"
            )
        if name in _LIVE:
            raise ValueError(f"a worker group named {name!r} is alive in this process")
        from tpuray._private import worker

        worker.auto_init()
        self.name = str(name)
        self._slices = None
        self._pg = None
        self._actors: list = []
        if tpu_form:
            if topology is None or accelerator_version is None:
                raise ValueError("a TPU worker group needs both topology= and accelerator_version=")
            if int(num_slices) < 1:
                raise ValueError(f"num_slices must be >= 1, got {num_slices}")
            _check_tpu_capacity(self.name, str(topology), str(accelerator_version), int(num_slices))
            from tpuray.util.tpu import SliceActorGroup

            try:
                self._slices = SliceActorGroup(
                    actor_cls, *args, topology=topology, accelerator_version=accelerator_version,
                    num_slices=int(num_slices), max_restarts=int(max_restarts), name=self.name,
                    timeout=float(timeout), **kwargs,
                )
            except ValueError as e:
                raise PoolUnsatisfiableError(f"{self.name} pool: {e}") from e
            self.kind = "tpu"
        else:
            # Not the TPU form, so num_workers was given (checked above).
            self._start_cpu(actor_cls, args, kwargs, int(cast(int, num_workers)), float(num_cpus),
                            dict(resources or {}), strategy, float(timeout))
            self.kind = "cpu"
        _LIVE[self.name] = self

    def _start_cpu(self, actor_cls, args, kwargs, n, num_cpus, resources, strategy, timeout):
        from tpuray.util.placement_group import placement_group, remove_placement_group
        from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if n < 1:
            raise ValueError(f"num_workers must be >= 1, got {n}")
        if num_cpus < 0 or any(float(v) < 0 for v in resources.values()):
            raise ValueError("num_cpus and resources must be >= 0")
        bundle = {k: float(v) for k, v in {"CPU": num_cpus, **resources}.items() if float(v) > 0}
        if not bundle:
            raise ValueError("a CPU worker group needs num_cpus > 0 or some resources per worker")
        _check_cpu_capacity(self.name, n, bundle)
        pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy,
                             name=f"workers:{self.name}")
        if not pg.wait(timeout):
            remove_placement_group(pg)
            raise PoolUnsatisfiableError(
                f"{self.name} pool: {n} workers of {bundle} were not reserved within {timeout:g}s"
            )
        self._pg = pg
        try:
            addr, port = tpuray.get(_free_port.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote(), timeout=timeout)
            base = dict(actor_cls._options)
            rt = dict(base.get("runtime_env") or {})
            for i in range(n):
                env = {**(rt.get("env_vars") or {}), "MASTER_ADDR": str(addr),
                       "MASTER_PORT": str(port), "NNODES": str(n), "WORLD_SIZE": str(n),
                       "NODE_RANK": str(i), "RANK": str(i), "TPURAY_WORKER_GROUP": self.name}
                self._actors.append(actor_cls.options(
                    num_cpus=num_cpus, resources=resources or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
                    runtime_env={**rt, "env_vars": env},
                ).remote(*args, **kwargs))
        except BaseException:
            self.shutdown()
            raise

    @property
    def actors(self) -> list:
        """The members' actor handles, in member order."""
        return list(self._slices.actors) if self._slices is not None else list(self._actors)

    @property
    def size(self) -> int:
        return len(self.actors)

    def __len__(self) -> int:
        return self.size

    def call(self, method: str, *args, timeout: Optional[float] = None, **kwargs) -> list:
        """``method(*args, **kwargs)`` on every member; the results in member order.

        Raises:
            RuntimeError: the group was shut down.
            RayTaskError: a member's method raised.
            RayActorError: a member died (TPU form: after ``max_restarts`` group restarts).
        """
        if self._slices is not None:
            return self._slices.call(method, *args, timeout=timeout, **kwargs)
        return tpuray.get(self.call_async(method, *args, **kwargs), timeout=timeout)

    def call_async(self, method: str, *args, **kwargs) -> list:
        """``method.remote(*args, **kwargs)`` on every member: one ref per member."""
        actors = self.actors
        if not actors:
            raise RuntimeError(f"worker group {self.name!r} was shut down")
        return [getattr(a, method).remote(*args, **kwargs) for a in actors]

    def call_each(self, method: str, per_member: list, *, timeout: Optional[float] = None) -> list:
        """``method(*per_member[i])`` on member ``i`` (each gets its own arguments, e.g. its
        shard of a batch); the results in member order.

        Raises:
            ValueError: ``per_member`` does not have one argument tuple per member.
        """
        return tpuray.get(self.call_each_async(method, per_member), timeout=timeout)

    def call_each_async(self, method: str, per_member: list) -> list:
        actors = self.actors
        if len(per_member) != len(actors):
            raise ValueError(
                f"call_each needs one argument tuple per member ({len(actors)}), got {len(per_member)}"
            )
        return [getattr(a, method).remote(*(p if isinstance(p, tuple) else (p,)))
                for a, p in zip(actors, per_member)]

    def placement(self) -> list[dict]:
        """Where each member runs: ``{"rank", "node_id", "slice", "worker_id"}`` (slice and
        worker id are ``None`` in the CPU form)."""
        if self._slices is not None:
            out = []
            for i, (m, host) in enumerate(zip(self._slices.members,
                                              _member_hosts(self._slices))):
                out.append({"rank": i, "node_id": host.get("node_id"),
                            "slice": m["env"].get("TPU_NAME") or host.get("slice_name"),
                            "worker_id": int(m["env"].get("TPU_WORKER_ID", host.get("worker_id", i)))})
            return out
        from tpuray.util.placement_group import placement_group_table

        nodes = placement_group_table(self._pg).get("bundles_to_node_id") or {}
        return [{"rank": i, "node_id": nodes.get(i) or nodes.get(str(i)), "slice": None,
                 "worker_id": None} for i in range(len(self._actors))]

    def shutdown(self) -> None:
        """Stops every member and releases the reservation (safe to call twice)."""
        if self._slices is not None:
            self._slices.shutdown()
        for a in self._actors:
            try:
                tpuray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []
        if self._pg is not None:
            from tpuray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if _LIVE.get(self.name) is self:
            del _LIVE[self.name]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, {self.kind}, {self.size} members)"


def _member_hosts(group) -> list[dict]:
    """Host facts of a slice group's members (node ids from the placement group table)."""
    from tpuray.util.placement_group import placement_group_table

    info = group.info
    hosts = info.get("hosts") or []
    pg = placement_group_table().get(info.get("placement_group_id"), {})
    nodes = pg.get("bundles_to_node_id") or {}
    out = []
    for m in group.members:
        b = m["bundle_index"]
        h = dict(hosts[b]) if b < len(hosts) else {}
        h["node_id"] = nodes.get(b) or nodes.get(str(b))
        out.append(h)
    return out
