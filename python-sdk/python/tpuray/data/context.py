"""``DataContext``: execution settings of ``tpuray.data`` (Ray Data's ``DataContext``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional


@dataclass
class DataContext:
    """Settings read by every dataset execution in this process.

    Attributes:
        max_bytes_in_flight: backpressure bound, in bytes, on the blocks one execution
            holds in the object store (queued, waiting for the consumer, or being made);
            ``None`` means a quarter of the cluster's ``object_store_memory``, at least
            64 MiB.
        max_tasks_in_flight_per_op: tasks of one operator running at once (``None``: twice
            the cluster's CPUs).
        max_tasks_in_flight_per_actor: blocks queued on one pool actor at once.
        target_max_block_size: bytes per block that reads and ``range`` aim for.
        enable_progress_bars: one tqdm bar per operator (when tqdm is installed and
            stderr is a terminal).
        preserve_order: blocks reach the consumer in source order (Ray Data's
            ``execution_options.preserve_order``; here on by default, so ``take`` and
            ``iter_batches`` are deterministic).
    """

    max_bytes_in_flight: Optional[int] = None
    max_tasks_in_flight_per_op: Optional[int] = None
    max_tasks_in_flight_per_actor: int = 2
    target_max_block_size: int = 16 * 1024 * 1024
    enable_progress_bars: bool = True
    preserve_order: bool = True

    _current: ClassVar[Optional["DataContext"]] = None

    @staticmethod
    def get_current() -> "DataContext":
        """The process-wide context (created on first use)."""
        if DataContext._current is None:
            DataContext._current = DataContext()
        return DataContext._current

    def resolved(self) -> "DataContext":
        """A copy with ``max_bytes_in_flight`` filled in from the cluster."""
        import tpuray

        out = replace(self)
        if out.max_bytes_in_flight is None:
            store = tpuray.cluster_resources().get("object_store_memory", 0) or 0
            out.max_bytes_in_flight = max(64 * 1024 * 1024, int(store // 4))
        return out
