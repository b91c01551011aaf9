"""``BaseGroup``: what a collective backend implements (Ray's
``ray.util.collective.collective_group.base_collective_group``); subclass it and
``register_collective_backend`` it to add a backend."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod

from tpuray.util.collective.types import (
    AllGatherOptions,
    AllReduceOptions,
    BarrierOptions,
    BroadcastOptions,
    RecvOptions,
    ReduceOptions,
    ReduceScatterOptions,
    SendOptions,
)


class BaseGroup(metaclass=ABCMeta):
    """One process's membership of a group: its rank among ``world_size``.

    Tensor arguments come wrapped in a list (one tensor per device, as Ray passes
    them); list-of-tensors arguments in a list of lists.
    """

    def __init__(self, world_size: int, rank: int, group_name: str):
        self._world_size = world_size
        self._rank = rank
        self._group_name = group_name

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group_name(self) -> str:
        return self._group_name

    def destroy_group(self) -> None:
        pass

    @classmethod
    def backend(cls):
        raise NotImplementedError()

    @classmethod
    @abstractmethod
    def check_backend_availability(cls) -> bool:
        raise NotImplementedError()

    @abstractmethod
    def allreduce(self, tensor, allreduce_options=AllReduceOptions()):
        raise NotImplementedError()

    @abstractmethod
    def barrier(self, barrier_options=BarrierOptions()):
        raise NotImplementedError()

    @abstractmethod
    def reduce(self, tensor, reduce_options=ReduceOptions()):
        raise NotImplementedError()

    @abstractmethod
    def allgather(self, tensor_list, tensor, allgather_options=AllGatherOptions()):
        raise NotImplementedError()

    @abstractmethod
    def broadcast(self, tensor, broadcast_options=BroadcastOptions()):
        raise NotImplementedError()

    @abstractmethod
    def reducescatter(self, tensor, tensor_list, reducescatter_options=ReduceScatterOptions()):
        raise NotImplementedError()

    @abstractmethod
    def send(self, tensor, send_options: SendOptions):
        raise NotImplementedError()

    @abstractmethod
    def recv(self, tensor, recv_options: RecvOptions):
        raise NotImplementedError()
