"""``DataIterator``s of ``Dataset.streaming_split``: one shared streaming execution, run by
a coordinator actor, handing blocks to ``n`` consumers (e.g. the members of a trainer
gang), each in its own process.

A ``_SplitCoordinator`` actor (0 CPUs) runs the one execution and deals blocks to the
``n`` ``DataIterator`` objects in turn (``equal=True``: the same rows each, extras
dropped); an epoch starts when the first consumer asks, and a consumer asking for epoch
``e + 1`` waits until every consumer finished ``e``. The iterators pickle into the
trainer gang's tasks or actors. Absent: locality-aware dealing (``locality_hints`` is
accepted, not used).
"""

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
        self._finished: set[int] = set()
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


def _torch_batch(batch: dict, dtypes, device: str) -> dict:
    import torch

    dev = "cpu" if device in (None, "auto") else device
    out = {}
    for k, v in batch.items():
        if v.dtype == object:
            out[k] = v
            continue
        dt = dtypes.get(k) if isinstance(dtypes, dict) else dtypes
        t = torch.as_tensor(v)
        if dt is not None:
            t = t.to(dt)
        out[k] = t.to(dev) if dev != "cpu" else t
    return out


class DataIterator:
    """Iterates a dataset's batches (Ray's ``DataIterator``); what ``Dataset.iterator``
    and ``Dataset.streaming_split`` return. Each ``iter_*`` call is one epoch."""

    def _iter_blocks(self, prefetch: int) -> Iterator[dict]:
        raise NotImplementedError

    def iter_batches(self, *, prefetch_batches: int = 1, batch_size: Optional[int] = 256,
                     batch_format: Optional[str] = "default", drop_last: bool = False,
                     local_shuffle_buffer_size: Optional[int] = None,
                     local_shuffle_seed: Optional[int] = None, _collate_fn=None) -> Iterator[Any]:
        """Batches of ``batch_size`` rows (``None``: one per block) in ``batch_format``
        (``"default"``/``"numpy"``: dict of arrays, ``"pandas"``, ``"pyarrow"``); up to
        ``prefetch_batches`` blocks are fetched ahead by a background thread.

        Raises:
            ValueError: a bad ``batch_size``, ``batch_format`` or ``prefetch_batches``.
        """
        from tpuray.data.dataset import _rebatch

        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
        if not isinstance(prefetch_batches, int) or prefetch_batches < 0:
            raise ValueError(f"prefetch_batches must be an int >= 0, got {prefetch_batches!r}")
        if local_shuffle_buffer_size is not None and local_shuffle_buffer_size < 1:
            raise ValueError(f"local_shuffle_buffer_size must be >= 1, got {local_shuffle_buffer_size}")
        fmt = "numpy" if _collate_fn is not None else batch_format
        B.check_batch_format(fmt)
        batches = _rebatch(self._iter_blocks(prefetch_batches), batch_size, fmt, drop_last,
                           local_shuffle_buffer_size, local_shuffle_seed)
        if _collate_fn is not None:
            return (_collate_fn(b) for b in batches)
        return batches

    def iter_torch_batches(self, *, prefetch_batches: int = 1, batch_size: Optional[int] = 256,
                           dtypes=None, device: str = "auto", collate_fn=None,
                           drop_last: bool = False,
                           local_shuffle_buffer_size: Optional[int] = None,
                           local_shuffle_seed: Optional[int] = None) -> Iterator[Any]:
        """Batches as dicts of ``torch.Tensor`` (string columns stay numpy arrays) on
        ``device`` (``"auto"``: the CPU, as Ray's outside a Train worker), cast to
        ``dtypes`` (one ``torch.dtype`` for all or a dict per column). ``collate_fn``
        receives each numpy batch instead and its result is yielded as is.

        Raises:
            ValueError: ``collate_fn`` together with ``dtypes`` or a ``device`` (as Ray).
        """
        if collate_fn is not None and (dtypes is not None or device not in ("auto", None)):
            raise ValueError("collate_fn cannot be used with dtypes and device; "
                             "move and cast the tensors in collate_fn")
        batches = self.iter_batches(prefetch_batches=prefetch_batches, batch_size=batch_size,
                                    batch_format="numpy", drop_last=drop_last,
                                    local_shuffle_buffer_size=local_shuffle_buffer_size,
                                    local_shuffle_seed=local_shuffle_seed)
        if collate_fn is not None:
            return (collate_fn(b) for b in batches)
        return (_torch_batch(b, dtypes, device) for b in batches)

    def iter_rows(self) -> Iterator[dict]:
        for block in self._iter_blocks(1):
            yield from B.rows(block)


class DatasetIterator(DataIterator):
    """A :class:`DataIterator` over one dataset in this process."""

    def __init__(self, dataset):
        self._ds = dataset

    def _iter_blocks(self, prefetch: int) -> Iterator[dict]:
        return self._ds._blocks(prefetch)

    def __repr__(self) -> str:
        return f"DataIterator({self._ds!r})"


class SplitIterator(DataIterator):
    """One consumer's share of a ``streaming_split``; picklable, so it can be passed to the
    task or actor that trains on it."""

    def __init__(self, coordinator, index: int):
        self._coord = coordinator
        self._index = index
        self._epoch = -1

    def _iter_blocks(self, prefetch: int) -> Iterator[dict]:
        self._epoch += 1
        while True:
            item = tpuray.get(self._coord.next_block.remote(self._index, self._epoch))
            if item is None:
                return
            yield tpuray.get(item[0])

    def __repr__(self) -> str:
        return f"DataIterator(split {self._index})"
