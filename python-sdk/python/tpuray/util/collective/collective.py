"""The API of ``tpuray.util.collective`` (Ray's ``ray.util.collective.collective``):
groups of actors (or tasks) that all-reduce, all-gather, reduce-scatter, broadcast,
barrier and send/recv tensors among themselves.

A process joins a group either by calling :func:`init_collective_group` itself, or
because the driver declared the group with :func:`create_collective_group` (the
members, their ranks and the backend go to the head's KV, key ``info/<group>``), in
which case each member joins at its first collective call. Either way the members
meet through the cluster (see ``collective_group.torch_gloo_collective_group``).

Backends: ``GLOO`` (torch.distributed's gloo, CPU tensors) wherever torch is installed;
``NCCL`` (torch.distributed's NCCL, CUDA tensors) only in processes with a CUDA device:
elsewhere it is not registered and asking for it says why. Others can be added with
:func:`register_collective_backend`. Tensors: ``torch.Tensor`` and ``numpy.ndarray``.
The ``*_multigpu`` calls (several GPUs per process) are refused by name.
"""

from __future__ import annotations

import json
import os
import threading

from tpuray.util.collective import types
from tpuray.util.collective.backend_registry import (
    _global_registry,
    register_collective_backend,
)
from tpuray.util.collective.collective_group.torch_gloo_collective_group import (
    KV_NAMESPACE,
    TorchGLOOGroup,
    TorchNCCLGroup,
    gloo_absent_reason,
    nccl_absent_reason,
)

if gloo_absent_reason():
    _global_registry.mark_absent("GLOO", gloo_absent_reason())
else:
    register_collective_backend("GLOO", TorchGLOOGroup)
if nccl_absent_reason():
    _global_registry.mark_absent("NCCL", nccl_absent_reason())
else:
    register_collective_backend("NCCL", TorchNCCLGroup)


def nccl_available() -> bool:
    return is_backend_available("NCCL")


def gloo_available() -> bool:
    return is_backend_available("GLOO")


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` is registered and usable in this process."""
    return _global_registry.check(backend)


def _info_key(group_name: str) -> bytes:
    return f"info/{group_name}".encode()


class GroupManager:
    """This process's groups, by name."""

    def __init__(self):
        self._groups: dict = {}

    def create_collective_group(self, backend, world_size, rank, group_name, gloo_timeout=None):
        backend = str(backend).upper()
        cls = _global_registry.get(backend)
        if not cls.check_backend_availability():
            raise RuntimeError(f"Backend {backend} is not available. Please check the installation.")
        if issubclass(cls, (TorchGLOOGroup, TorchNCCLGroup)):
            g = cls(world_size, rank, group_name, gloo_timeout)
        else:
            g = cls(world_size, rank, group_name)
        self._groups[group_name] = g
        return g

    def is_group_exist(self, group_name) -> bool:
        return group_name in self._groups

    def get_group_by_name(self, group_name):
        return self._groups.get(group_name)

    def destroy_collective_group(self, group_name) -> None:
        g = self._groups.pop(group_name, None)
        if g is None:
            return
        g.destroy_group()
        from tpuray import _tpuray

        _tpuray.kv_delete(KV_NAMESPACE, _info_key(group_name))


_group_mgr = GroupManager()
_group_mgr_lock = threading.Lock()


def _check_inside_actor() -> None:
    from tpuray._private import worker

    if worker.state.mode != "worker":
        raise RuntimeError("The collective APIs shall be only used inside a Ray actor or task.")


def is_group_initialized(group_name: str) -> bool:
    """Whether this process is a member of ``group_name`` already."""
    with _group_mgr_lock:
        return _group_mgr.is_group_exist(group_name)


def init_collective_group(world_size: int, rank: int, backend=types.Backend.NCCL,
                          group_name: str = "default", gloo_timeout: int = 30000) -> None:
    """Joins this actor (or task) to ``group_name`` as ``rank`` of ``world_size``; returns
    once every member has joined.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (Ray's default, which needs CUDA), or a
            registered one.
        gloo_timeout: Milliseconds to wait for the other members (joining and each
            operation).

    Raises:
        RuntimeError: outside an actor or task; the group is initialized here already.
        ValueError: no group name; ``backend`` not registered here (saying why).
        TimeoutError: the other members did not join within ``gloo_timeout``.
    """
    _check_inside_actor()
    if not group_name:
        raise ValueError(f"group_name '{group_name}' needs to be a string.")
    with _group_mgr_lock:
        if _group_mgr.is_group_exist(group_name):
            raise RuntimeError("Trying to initialize a group a second time.")
        if not (world_size > 0 and 0 <= rank < world_size):
            raise ValueError(f"rank {rank} of world_size {world_size}: expected 0 <= rank < world_size")
        _group_mgr.create_collective_group(backend, world_size, rank, group_name, gloo_timeout)


def create_collective_group(actors, world_size: int, ranks, backend=types.Backend.NCCL,
                            group_name: str = "default", gloo_timeout: int = 30000) -> None:
    """Declares ``actors`` a group (called by the driver): actor ``actors[i]`` is rank
    ``ranks[i]``; each joins at its first collective call on ``group_name``.

    Raises:
        RuntimeError: the group was declared already; ranks that are not a permutation
            of ``0..len(actors)-1``; ``world_size`` not positive; ``backend`` not
            registered or not available in this process.
    """
    from tpuray import _tpuray
    from tpuray._private import worker

    worker.check_connected()
    if _tpuray.kv_get(KV_NAMESPACE, _info_key(group_name)) is not None:
        raise RuntimeError("Trying to initialize a group twice.")
    if len(ranks) != len(actors):
        raise RuntimeError(
            f"Each actor should correspond to one rank. Got '{len(ranks)}' ranks but "
            f"'{len(actors)}' actors"
        )
    if set(ranks) != set(range(len(ranks))):
        raise RuntimeError(
            f"Ranks must be a permutation from 0 to '{len(ranks)}'. Got "
            f"'{''.join(str(r) for r in ranks)}'."
        )
    if world_size <= 0:
        raise RuntimeError(f"World size must be greater than zero. Got '{world_size}'.")
    upper = str(backend).upper()
    if not _global_registry.is_registered(upper):
        why = _global_registry.why_absent(upper)
        raise RuntimeError(
            f"Backend {upper} is not registered"
            + (f": {why}" if why else f". Please register it using "
               f"register_collective_backend('{upper}', YourBackendClass).")
        )
    if not _global_registry.check(upper):
        raise RuntimeError(
            f"Backend {upper} is registered but not available. Please check the "
            "installation requirements for this backend."
        )
    info = {
        "actor_ids": [a._actor_id for a in actors],
        "world_size": int(world_size),
        "ranks": [int(r) for r in ranks],
        "backend": upper,
        "gloo_timeout": int(gloo_timeout),
    }
    if not _tpuray.kv_put(KV_NAMESPACE, _info_key(group_name), json.dumps(info).encode(), False):
        raise RuntimeError("Trying to initialize a group twice.")


def destroy_collective_group(group_name: str = "default") -> None:
    """Leaves ``group_name`` and forgets its declaration."""
    _check_inside_actor()
    with _group_mgr_lock:
        _group_mgr.destroy_collective_group(group_name)


def get_rank(group_name: str = "default") -> int:
    """This process's rank in ``group_name``; -1 when it is not a member."""
    _check_inside_actor()
    with _group_mgr_lock:
        g = _group_mgr.get_group_by_name(group_name)
        return g.rank if g is not None else -1


def get_collective_group_size(group_name: str = "default") -> int:
    """The size of ``group_name``; -1 when this process is not a member."""
    _check_inside_actor()
    with _group_mgr_lock:
        g = _group_mgr.get_group_by_name(group_name)
        return g.world_size if g is not None else -1


def get_group_handle(group_name: str = "default"):
    """This process's group ``group_name``, joining it first when the driver declared
    it with this actor as a member (or the ``collective_*`` environment variables name
    it, as in Ray).

    Raises:
        RuntimeError: this process is not a member.
    """
    _check_inside_actor()
    from tpuray import _tpuray

    with _group_mgr_lock:
        if not _group_mgr.is_group_exist(group_name):
            raw = _tpuray.kv_get(KV_NAMESPACE, _info_key(group_name))
            me = os.environ.get("TPURAY_ACTOR_ID", "")
            if raw is not None:
                info = json.loads(raw)
                if me not in info["actor_ids"]:
                    raise RuntimeError(
                        f"The collective group '{group_name}' is not initialized in the "
                        "process (this actor is not one of its members)."
                    )
                rank = info["ranks"][info["actor_ids"].index(me)]
                _group_mgr.create_collective_group(info["backend"], info["world_size"], rank,
                                                   group_name, info["gloo_timeout"])
            elif os.environ.get("collective_group_name") == group_name:
                _group_mgr.create_collective_group(
                    os.environ["collective_backend"], int(os.environ["collective_world_size"]),
                    int(os.environ["collective_rank"]), group_name,
                    int(os.environ.get("collective_gloo_timeout", 30000)),
                )
            else:
                raise RuntimeError(f"The collective group '{group_name}' is not initialized in the process.")
        return _group_mgr.get_group_by_name(group_name)


# ---- operations ----


def _check_single_tensor_input(tensor) -> None:
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return
    if types.torch_available():
        import torch

        if isinstance(tensor, torch.Tensor):
            return
    raise RuntimeError(
        f"Unrecognized tensor type '{type(tensor)}'. Supported types are: np.ndarray, "
        "torch.Tensor, cupy.ndarray."
    )


def _check_tensor_list_input(tensor_list) -> None:
    if not isinstance(tensor_list, list):
        raise RuntimeError(f"The input must be a list of tensors. Got '{type(tensor_list)}'.")
    if not tensor_list:
        raise RuntimeError("Got an empty list of tensors.")
    for t in tensor_list:
        _check_single_tensor_input(t)


def _check_rank_valid(g, rank: int) -> None:
    if rank < 0:
        raise ValueError(f"rank '{rank}' is negative.")
    if rank >= g.world_size:
        raise ValueError(f"rank '{rank}' must be less than world size '{g.world_size}'")


def allreduce(tensor, group_name: str = "default", op=types.ReduceOp.SUM) -> None:
    """Reduces ``tensor`` across the group with ``op``; every member's tensor holds the
    result (in place)."""
    _check_single_tensor_input(tensor)
    g = get_group_handle(group_name)
    opts = types.AllReduceOptions()
    opts.reduceOp = op
    g.allreduce([tensor], opts)


def barrier(group_name: str = "default") -> None:
    """Returns once every member reached the barrier."""
    get_group_handle(group_name).barrier()


def reduce(tensor, dst_rank: int = 0, group_name: str = "default", op=types.ReduceOp.SUM) -> None:
    """Reduces ``tensor`` across the group into rank ``dst_rank``'s tensor (the others'
    stay as they were)."""
    _check_single_tensor_input(tensor)
    g = get_group_handle(group_name)
    _check_rank_valid(g, dst_rank)
    opts = types.ReduceOptions()
    opts.reduceOp = op
    opts.root_rank = dst_rank
    opts.root_tensor = 0
    g.reduce([tensor], opts)


def broadcast(tensor, src_rank: int = 0, group_name: str = "default") -> None:
    """Copies rank ``src_rank``'s tensor into every member's."""
    _check_single_tensor_input(tensor)
    g = get_group_handle(group_name)
    _check_rank_valid(g, src_rank)
    opts = types.BroadcastOptions()
    opts.root_rank = src_rank
    opts.root_tensor = 0
    g.broadcast([tensor], opts)


def allgather(tensor_list: list, tensor, group_name: str = "default") -> None:
    """``tensor_list[r]`` becomes rank ``r``'s ``tensor``, on every member.

    Raises:
        RuntimeError: ``tensor_list`` does not have ``world_size`` tensors.
    """
    _check_single_tensor_input(tensor)
    _check_tensor_list_input(tensor_list)
    g = get_group_handle(group_name)
    if len(tensor_list) != g.world_size:
        raise RuntimeError(
            "The length of the tensor list operands to allgather must be equal to world_size."
        )
    g.allgather([tensor_list], [tensor], types.AllGatherOptions())


def reducescatter(tensor, tensor_list: list, group_name: str = "default", op=types.ReduceOp.SUM) -> None:
    """Reduces each ``tensor_list[r]`` across the group; rank ``r``'s ``tensor`` gets the
    ``r``-th result.

    Raises:
        RuntimeError: ``tensor_list`` does not have ``world_size`` tensors.
    """
    _check_single_tensor_input(tensor)
    _check_tensor_list_input(tensor_list)
    g = get_group_handle(group_name)
    opts = types.ReduceScatterOptions()
    opts.reduceOp = op
    if len(tensor_list) != g.world_size:
        raise RuntimeError(
            "The length of the tensor list operands to reducescatter must not be equal to "
            "world_size."
        )
    g.reducescatter([tensor], [tensor_list], opts)


def send(tensor, dst_rank: int, group_name: str = "default") -> None:
    """Sends ``tensor`` to rank ``dst_rank`` (which calls :func:`recv`); blocks until it
    is taken.

    Raises:
        RuntimeError: ``dst_rank`` is this process's rank.
    """
    _check_single_tensor_input(tensor)
    g = get_group_handle(group_name)
    _check_rank_valid(g, dst_rank)
    if dst_rank == g.rank:
        raise RuntimeError(f"The destination rank '{dst_rank}' is self.")
    opts = types.SendOptions()
    opts.dst_rank = dst_rank
    g.send([tensor], opts)


def recv(tensor, src_rank: int, group_name: str = "default") -> None:
    """Receives into ``tensor`` what rank ``src_rank`` sends.

    Raises:
        RuntimeError: ``src_rank`` is this process's rank.
    """
    _check_single_tensor_input(tensor)
    g = get_group_handle(group_name)
    _check_rank_valid(g, src_rank)
    if src_rank == g.rank:
        raise RuntimeError(f"The destination rank '{src_rank}' is self.")
    opts = types.RecvOptions()
    opts.src_rank = src_rank
    g.recv([tensor], opts)


def _multigpu(name: str):
    def refused(*_args, **_kwargs):
        raise RuntimeError(
            f"{name} is not supported by tpuray: it needs several GPUs per process (Ray "
            "runs it on NCCL with cupy); use one process per GPU with the single-tensor "
            f"call ({name.replace('_multigpu', '')})"
        )

    refused.__name__ = name
    refused.__doc__ = f"Refused: ``{name}`` (several GPUs per process) is not supported."
    return refused


allreduce_multigpu = _multigpu("allreduce_multigpu")
reduce_multigpu = _multigpu("reduce_multigpu")
broadcast_multigpu = _multigpu("broadcast_multigpu")
allgather_multigpu = _multigpu("allgather_multigpu")
reducescatter_multigpu = _multigpu("reducescatter_multigpu")
send_multigpu = _multigpu("send_multigpu")
recv_multigpu = _multigpu("recv_multigpu")


def synchronize(gpu_id: int) -> None:
    """Waits for the work queued on CUDA device ``gpu_id``.

    Raises:
        RuntimeError: no CUDA device.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("synchronize call requires CUDA and NCCL.")
    torch.cuda.synchronize(gpu_id)
