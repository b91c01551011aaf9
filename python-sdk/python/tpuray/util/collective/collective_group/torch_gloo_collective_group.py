"""Collective groups on ``torch.distributed`` process groups: ``TorchGLOOGroup`` (CPU
tensors, the ``GLOO`` backend) and ``TorchNCCLGroup`` (CUDA tensors, ``NCCL``).

Rendezvous through the cluster, never a fixed port: rank 0 starts a
``torch.distributed.TCPStore`` on a port the kernel picks, on its node's address, and
publishes ``host:port`` in the head's KV (namespace ``collective``, key
``rendezvous/<group>``); the other ranks read it there (waiting up to the group's
timeout) and connect. Each group has a process group and a store of its own (built
directly, not through ``init_process_group``), so one process can belong to several
groups of different sizes, and a group can be destroyed and made again under the same
name. Rank 0 deletes the key once the process group is up (every rank has connected by
then).

numpy arrays are used through ``torch.from_numpy`` (results are written into them);
an array that is not writable (a value ``get`` returned from the object store is a
read-only view of shared memory) is refused with ``ValueError``, since the backend
would write into it.

COLL-1: the members of a group meet through the cluster's KV as above, never at a fixed
port.
"""

from __future__ import annotations

import time
from datetime import timedelta

from tpuray.util.collective.collective_group.base_collective_group import BaseGroup
from tpuray.util.collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    Backend,
    BarrierOptions,
    BroadcastOptions,
    RecvOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)

#: KV namespace of rendezvous addresses and declared groups.
KV_NAMESPACE = "collective"


def rendezvous_key(group_name: str) -> bytes:
    return f"rendezvous/{group_name}".encode()


def _torch_dist():
    import torch.distributed as dist

    return dist


def _reduce_op(op):
    dist = _torch_dist()
    return {
        ReduceOp.SUM: dist.ReduceOp.SUM,
        ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        ReduceOp.MIN: dist.ReduceOp.MIN,
        ReduceOp.MAX: dist.ReduceOp.MAX,
    }[op]


def _rendezvous_store(group_name: str, rank: int, world_size: int, timeout: timedelta):
    """COLL-1: rank 0: a new TCPStore on a port the kernel picks, published in the KV.
    Others: a client of the published one.

    Raises:
        TimeoutError: rank 0 published no reachable store within ``timeout``.
    """
    from tpuray import _tpuray
    from tpuray.util import get_node_ip_address

    dist = _torch_dist()
    key = rendezvous_key(group_name)
    if rank == 0:
        host = get_node_ip_address()
        store = dist.TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False)
        _tpuray.kv_put(KV_NAMESPACE, key, f"{host}:{store.port}".encode(), True)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    last_error = None
    while True:
        published = _tpuray.kv_get(KV_NAMESPACE, key)
        if published:
            host, _, port = published.decode().rpartition(":")
            left = max(1.0, deadline - time.monotonic())
            try:
                return dist.TCPStore(host, int(port), world_size, False,
                                     timeout=timedelta(seconds=left))
            except Exception as e:  # noqa: BLE001 - a stale address: read the key again
                last_error = e
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"collective group '{group_name}': rank {rank} found no store of rank 0 "
                f"within {timeout.total_seconds():g} s"
                + (f" (last attempt: {last_error})" if last_error else "")
            )
        time.sleep(0.05)


class _TorchGroup(BaseGroup):
    """A group over one ``torch.distributed`` process group of its own."""

    _TORCH_BACKEND = ""

    def __init__(self, world_size: int, rank: int, group_name: str, gloo_timeout: int | None = None):
        super().__init__(world_size, rank, group_name)
        timeout = timedelta(milliseconds=gloo_timeout or 30000)
        self._timeout_ms = int(timeout.total_seconds() * 1000)
        self._store = _rendezvous_store(group_name, rank, world_size, timeout)
        self._pg = self._process_group(self._store, rank, world_size, timeout)
        if rank == 0:
            from tpuray import _tpuray

            # COLL-1: every rank has connected once the process group is up.
            _tpuray.kv_delete(KV_NAMESPACE, rendezvous_key(group_name))

    def _process_group(self, store, rank, world_size, timeout):
        raise NotImplementedError

    def destroy_group(self) -> None:
        self._pg = None
        self._store = None

    # ---- tensors ----

    def _tensor(self, tensors, writes: bool = True):
        assert isinstance(tensors, list) and len(tensors) == 1, "one tensor per call"
        return self._as_torch(tensors[0], writes)

    def _tensors(self, tensor_lists, writes: bool = True):
        assert isinstance(tensor_lists, list) and len(tensor_lists) == 1, "one list per call"
        return [self._as_torch(t, writes) for t in tensor_lists[0]]

    @staticmethod
    def _as_torch(t, writes: bool):
        import numpy as np
        import torch

        if isinstance(t, torch.Tensor):
            return t
        if isinstance(t, np.ndarray):
            if writes and not t.flags.writeable:
                raise ValueError(
                    "the numpy array is read-only (a value from the object store is a "
                    "read-only view): pass a copy, e.g. array.copy()"
                )
            return torch.from_numpy(t)
        raise ValueError(
            f"{type(t).__name__} is not a tensor: torch.distributed groups take "
            "torch.Tensor or numpy.ndarray"
        )

    def _live_pg(self):
        if self._pg is None:
            raise RuntimeError(f"the collective group '{self.group_name}' was destroyed")
        return self._pg

    # ---- operations ----

    def allreduce(self, tensor, allreduce_options: AllReduceOptions | None = None) -> None:
        dist = _torch_dist()
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op((allreduce_options or AllReduceOptions()).reduceOp)
        self._live_pg().allreduce([self._tensor(tensor)], opts).wait()

    def barrier(self, barrier_options=BarrierOptions()) -> None:
        self._live_pg().barrier().wait()

    def reduce(self, tensor, reduce_options: ReduceOptions | None = None) -> None:
        dist = _torch_dist()
        o = reduce_options or ReduceOptions()
        t = self._tensor(tensor, writes=self.rank == o.root_rank)
        opts = dist.ReduceOptions()
        opts.reduceOp = _reduce_op(o.reduceOp)
        opts.rootRank = o.root_rank
        opts.rootTensor = 0
        # Only the root's tensor changes (as Ray's): the others reduce a copy.
        work = t if self.rank == o.root_rank else t.detach().clone()
        self._live_pg().reduce([work], opts).wait()

    def allgather(self, tensor_list, tensor, allgather_options=None) -> None:
        outs = self._tensors(tensor_list)
        self._live_pg().allgather([outs], [self._tensor(tensor, writes=False)]).wait()

    def broadcast(self, tensor, broadcast_options: BroadcastOptions | None = None) -> None:
        dist = _torch_dist()
        o = broadcast_options or BroadcastOptions()
        opts = dist.BroadcastOptions()
        opts.rootRank = o.root_rank
        opts.rootTensor = 0
        self._live_pg().broadcast([self._tensor(tensor, writes=self.rank != o.root_rank)], opts).wait()

    def reducescatter(self, tensor, tensor_list, reducescatter_options=None) -> None:
        """Reduces each tensor of the list across the group (in place, as Ray's gloo
        group does) and copies this rank's into ``tensor``."""
        dist = _torch_dist()
        o = reducescatter_options or ReduceScatterOptions()
        inputs = self._tensors(tensor_list)
        out = self._tensor(tensor)
        if out.shape != inputs[self.rank].shape:
            raise ValueError(
                f"Output tensor has wrong shape {tuple(out.shape)}, expected "
                f"{tuple(inputs[self.rank].shape)}"
            )
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(o.reduceOp)
        pg = self._live_pg()
        for t in inputs:
            pg.allreduce([t], opts).wait()
        if out.data_ptr() != inputs[self.rank].data_ptr():
            out.copy_(inputs[self.rank])

    def send(self, tensor, send_options: SendOptions) -> None:
        self._live_pg().send([self._tensor(tensor, writes=False)], send_options.dst_rank, 0).wait()

    def recv(self, tensor, recv_options: RecvOptions) -> None:
        self._live_pg().recv([self._tensor(tensor)], recv_options.src_rank, 0).wait()


class TorchGLOOGroup(_TorchGroup):
    """A group on torch.distributed's gloo (CPU tensors), its connections on this
    node's address."""

    _TORCH_BACKEND = "gloo"

    def _process_group(self, store, rank, world_size, timeout):
        from tpuray.util import get_node_ip_address

        dist = _torch_dist()
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=get_node_ip_address())]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)

    @classmethod
    def backend(cls):
        return Backend.GLOO

    @classmethod
    def check_backend_availability(cls) -> bool:
        try:
            return _torch_dist().is_gloo_available()
        except ImportError:
            return False


class TorchNCCLGroup(_TorchGroup):
    """A group on torch.distributed's NCCL (CUDA tensors on this process's device)."""

    _TORCH_BACKEND = "nccl"

    def _process_group(self, store, rank, world_size, timeout):
        dist = _torch_dist()
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)

    def reducescatter(self, tensor, tensor_list, reducescatter_options=None) -> None:
        dist = _torch_dist()
        o = reducescatter_options or ReduceScatterOptions()
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _reduce_op(o.reduceOp)
        self._live_pg().reduce_scatter([self._tensor(tensor)], [self._tensors(tensor_list)], opts).wait()

    @classmethod
    def backend(cls):
        return Backend.NCCL

    @classmethod
    def check_backend_availability(cls) -> bool:
        return nccl_absent_reason() == ""


def nccl_absent_reason() -> str:
    """Why torch.distributed's NCCL cannot run here ("" when it can)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "it runs on torch.distributed, and torch is not installed"
    if not dist.is_nccl_available():
        return "this torch was built without NCCL"
    if not torch.cuda.is_available():
        return "NCCL needs a CUDA device and this process has none (use backend='gloo' on CPUs)"
    return ""


def gloo_absent_reason() -> str:
    try:
        import torch.distributed as dist
    except ImportError:
        return "it runs on torch.distributed, and torch is not installed"
    if not dist.is_gloo_available():
        return "this torch was built without gloo"
    return ""
