"""``DataIterator``s of ``Dataset.streaming_split``: one shared streaming execution, run by
a coordinator actor, handing blocks to ``n`` consumers (e.g. the members of a trainer
gang), each in its own process."""

from __future__ import annotations

import threading
from typing import Any, Iterator, Optional

import tpuray
from tpuray.data import block as B


@tpuray.remote
class _SplitCoordinator:
    """Runs the dataset once per epoch and deals its blocks to ``n`` consumers in turn.

    An epoch starts when the first consumer asks for it; a consumer that finished epoch
    ``e`` and asks for ``e + 1`` waits until every consumer finished ``e``. With ``equal``,
    blocks are cut so every consumer gets the same number of rows (extra rows dropped).
    """

    def __init__(self, dataset, n: int, equal: bool):
        self._ds = dataset
        self._n = n
        self._equal = equal
        self._cond = threading.Condition()
        self._epoch = -1
        self._queues: list[list] = []
        self._finished = set()
        self._done = False
        self._error: Optional[BaseException] = None

    def _run_epoch(self) -> None:
        try:
            items = []
            turn = 0
            for ref, meta in self._ds._execute():
                if self._equal:
                    items.append((ref, meta))
                    continue
                with self._cond:
                    self._queues[turn % self._n].append([ref])
                    self._cond.notify_all()
                turn += 1
            if self._equal:
                self._deal_equal(items)
        except BaseException as e:  # handed to every consumer
            with self._cond:
                self._error = e
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def _deal_equal(self, items) -> None:
        total = sum(m.num_rows for _, m in items)
        share = total // self._n
        blocks = [tpuray.get(ref) for ref, _ in items]
        whole = B.concat(blocks) if blocks else {}
        with self._cond:
            for i in range(self._n):
                part = B.slice_block(whole, i * share, (i + 1) * share) if share else {}
                if B.num_rows(part):
                    self._queues[i].append([tpuray.put(part)])
            self._cond.notify_all()

    def next_block(self, index: int, epoch: int):
        """The next block ref of consumer ``index`` in ``epoch`` as ``[ref]``, or ``None``
        when the epoch has no more for it."""
        with self._cond:
            if epoch > self._epoch:
                if self._epoch >= 0 and len(self._finished) < self._n:
                    self._cond.wait_for(lambda: len(self._finished) >= self._n or epoch <= self._epoch)
                if epoch > self._epoch:
                    self._epoch = epoch
                    self._queues = [[] for _ in range(self._n)]
                    self._finished = set()
                    self._done = False
                    self._error = None
                    threading.Thread(target=self._run_epoch, daemon=True).start()
            self._cond.wait_for(lambda: self._queues[index] or self._done)
            if self._queues[index]:
                return self._queues[index].pop(0)
            if self._error is not None:
                raise self._error
            self._finished.add(index)
            self._cond.notify_all()
            return None


class DataIterator:
    """One consumer's share of a ``streaming_split``; picklable, so it can be passed to the
    task or actor that trains on it."""

    def __init__(self, coordinator, index: int):
        self._coord = coordinator
        self._index = index
        self._epoch = -1

    def _blocks(self) -> Iterator[dict]:
        self._epoch += 1
        while True:
            item = tpuray.get(self._coord.next_block.remote(self._index, self._epoch))
            if item is None:
                return
            yield tpuray.get(item[0])

    def iter_batches(self, *, batch_size: Optional[int] = 256, batch_format: str = "numpy",
                     drop_last: bool = False, **_ignored) -> Iterator[Any]:
        """Batches of this consumer's blocks (one epoch per call)."""
        from tpuray.data.dataset import _rebatch

        return _rebatch(self._blocks(), batch_size, batch_format, drop_last)

    def iter_torch_batches(self, *, batch_size: Optional[int] = 256, drop_last: bool = False,
                           **_ignored) -> Iterator[dict]:
        return self.iter_batches(batch_size=batch_size, batch_format="torch", drop_last=drop_last)

    def iter_rows(self) -> Iterator[dict]:
        for block in self._blocks():
            yield from B.rows(block)

    def __repr__(self) -> str:
        return f"DataIterator(split {self._index})"
