"""``DataContext``: execution settings of ``tpuray.data`` (Ray Data's ``DataContext``),
with Ray's ``ExecutionOptions`` and ``ExecutionResources``.

Only the settings listed on each class can be set; any other name (including Ray
settings that tpuray does not implement, such as ``shuffle_strategy`` or
``max_errored_blocks``) raises ``AttributeError`` naming it and the supported ones, so a
script never runs with a setting silently ignored.
"""

from __future__ import annotations

import copy
from typing import ClassVar, Optional


class _Strict:
    """Refuses attributes outside ``_fields`` by name."""

    _fields: ClassVar[tuple] = ()

    def __setattr__(self, name, value):
        if name not in self._fields:
            raise AttributeError(
                f"{type(self).__name__}.{name} is not supported by tpuray.data "
                f"(supported: {', '.join(self._fields)})"
            )
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        raise AttributeError(
            f"{type(self).__name__}.{name} is not supported by tpuray.data "
            f"(supported: {', '.join(self._fields)})"
        )

    def __repr__(self):
        inner = ", ".join(f"{k}={self.__dict__.get(k)!r}" for k in self._fields)
        return f"{type(self).__name__}({inner})"


class ExecutionResources(_Strict):
    """Resource limits of one execution (Ray's ``ExecutionResources``).

    Attributes:
        cpu: tasks of one operator running at once (``None``: twice the cluster's CPUs).
        object_store_memory: bytes the execution may hold in the object store (the
            backpressure bound; ``None``: a quarter of the cluster's store).
    Raises:
        ValueError: ``gpu`` limits (not implemented), or a negative value.
    """

    _fields = ("cpu", "gpu", "object_store_memory")

    def __init__(self, cpu: Optional[float] = None, gpu: Optional[float] = None,
                 object_store_memory: Optional[float] = None, **unsupported):
        if unsupported:
            raise TypeError(f"ExecutionResources got unsupported argument(s) {sorted(unsupported)}")
        self.cpu = cpu
        self.gpu = gpu
        self.object_store_memory = object_store_memory

    @classmethod
    def for_limits(cls, cpu: Optional[float] = None, gpu: Optional[float] = None,
                   object_store_memory: Optional[float] = None) -> "ExecutionResources":
        """Ray's constructor for limits (``None``: no limit)."""
        return cls(cpu=cpu, gpu=gpu, object_store_memory=object_store_memory)

    def __setattr__(self, name, value):
        if name == "gpu" and value is not None:
            raise ValueError("ExecutionResources(gpu=...) limits are not supported by tpuray.data")
        if name in ("cpu", "object_store_memory") and value is not None and value < 0:
            raise ValueError(f"ExecutionResources.{name} must be >= 0, got {value}")
        super().__setattr__(name, value)


class ExecutionOptions(_Strict):
    """Ray's ``ExecutionOptions``.

    Attributes:
        preserve_order: blocks reach the consumer in source order (on by default here, so
            ``take`` and ``iter_batches`` are deterministic; Ray's default is off).
        resource_limits: an :class:`ExecutionResources`.
        verbose_progress: accepted for compatibility; progress bars are per operator
            whatever its value.
    """

    _fields = ("preserve_order", "resource_limits", "verbose_progress", "locality_with_output",
               "actor_locality_enabled")

    def __init__(self):
        self.preserve_order = True
        self.resource_limits = ExecutionResources()
        self.verbose_progress = True
        self.locality_with_output = False
        self.actor_locality_enabled = True

    def __setattr__(self, name, value):
        if name == "locality_with_output" and value:
            raise ValueError("ExecutionOptions.locality_with_output is not supported by tpuray.data")
        super().__setattr__(name, value)


class DataContext(_Strict):
    """Settings read by every dataset execution in this process.

    Attributes:
        max_bytes_in_flight: backpressure bound, in bytes, on the blocks one execution
            holds in the object store (queued, waiting for the consumer, or being made);
            ``None`` means ``execution_options.resource_limits.object_store_memory`` when
            set, else a quarter of the cluster's ``object_store_memory``, at least 64 MiB.
        max_tasks_in_flight_per_op: tasks of one operator running at once (``None``:
            ``resource_limits.cpu`` when set, else twice the cluster's CPUs).
        max_tasks_in_flight_per_actor: blocks queued on one pool actor at once.
        target_max_block_size: bytes per block that ``range`` aims for (Ray's name).
        enable_progress_bars / enable_operator_progress_bars: one tqdm bar per operator
            (when tqdm is installed and stderr is a terminal); both must be on.
        execution_options: an :class:`ExecutionOptions` (``preserve_order``,
            ``resource_limits``).
        preserve_order: the same as ``execution_options.preserve_order``.
    """

    _fields = ("max_bytes_in_flight", "max_tasks_in_flight_per_op",
               "max_tasks_in_flight_per_actor", "target_max_block_size", "enable_progress_bars",
               "enable_operator_progress_bars", "execution_options")

    _current: ClassVar[Optional["DataContext"]] = None

    def __init__(self):
        self.max_bytes_in_flight = None
        self.max_tasks_in_flight_per_op = None
        self.max_tasks_in_flight_per_actor = 2
        self.target_max_block_size = 128 * 1024 * 1024
        self.enable_progress_bars = True
        self.enable_operator_progress_bars = True
        self.execution_options = ExecutionOptions()

    @property
    def preserve_order(self) -> bool:
        return self.execution_options.preserve_order

    @preserve_order.setter
    def preserve_order(self, value: bool) -> None:
        self.execution_options.preserve_order = value

    def __setattr__(self, name, value):
        if name == "preserve_order":
            type(self).preserve_order.fset(self, value)
            return
        super().__setattr__(name, value)

    @staticmethod
    def get_current() -> "DataContext":
        """The process-wide context (created on first use)."""
        if DataContext._current is None:
            DataContext._current = DataContext()
        return DataContext._current

    @staticmethod
    def _set_current(ctx: "DataContext") -> None:
        DataContext._current = ctx

    def copy(self) -> "DataContext":
        return copy.deepcopy(self)

    def resolved(self) -> "DataContext":
        """A copy with ``max_bytes_in_flight`` and the task cap filled in from the
        resource limits and the cluster."""
        import tpuray

        out = self.copy()
        limits = out.execution_options.resource_limits
        if out.max_bytes_in_flight is None:
            if limits.object_store_memory is not None:
                out.max_bytes_in_flight = int(limits.object_store_memory)
            else:
                store = tpuray.cluster_resources().get("object_store_memory", 0) or 0
                out.max_bytes_in_flight = max(64 * 1024 * 1024, int(store // 4))
        if out.max_tasks_in_flight_per_op is None and limits.cpu is not None:
            out.max_tasks_in_flight_per_op = max(1, int(limits.cpu))
        if not out.enable_operator_progress_bars:
            out.enable_progress_bars = False
        return out
