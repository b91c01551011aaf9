"""``Pool``: ``multiprocessing.Pool``'s methods over a set of actors (Ray's
``ray.util.multiprocessing.Pool``).

Each "process" is a ``_PoolActor`` (``num_cpus=0`` unless ``ray_remote_args`` say
otherwise) that runs batches of calls: work is cut into chunks, chunk ``i`` goes to actor
``i mod processes``, and one actor call runs one chunk, returning one value per call (an
exception a call raised comes back as a :class:`PoolTaskError` in its place, so the rest
of the chunk still runs). ``map``-style calls send every chunk at once; ``imap`` and
``imap_unordered`` keep one chunk per actor in flight and send the next as results are
taken.

Behaviour kept from Ray where it differs from the standard library: ``imap`` and
``imap_unordered`` yield a failed call's :class:`PoolTaskError` (its ``underlying`` is
the exception) instead of raising it, and ``error_callback`` gets that
:class:`PoolTaskError`; ``map``/``apply``/``AsyncResult.get`` raise the call's own
exception. ``context`` is accepted and ignored; joblib's ``BatchedCalls`` get
no object-store caching.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from multiprocessing import TimeoutError

import tpuray

logger = logging.getLogger(__name__)


class PoolTaskError(Exception):
    """A call in a pool raised ``underlying``."""

    def __init__(self, underlying):
        super().__init__(underlying)
        self.underlying = underlying


class _PoolActor:
    """One pool process: runs the initializer once, then batches of calls."""

    def __init__(self, initializer=None, initargs=None):
        if initializer:
            initializer(*(initargs or ()))

    def ping(self):
        return None

    def run_batch(self, func, batch):
        out = []
        for args, kwargs in batch:
            try:
                out.append(func(*(args or ()), **(kwargs or {})))
            except Exception as e:  # noqa: BLE001 - the caller decides what a failure means
                out.append(PoolTaskError(e))
        return out


def _chunk_results(ref) -> list:
    """The values of one chunk; a cluster error (the actor died, ...) stands for all of
    them, as one item."""
    try:
        return tpuray.get(ref)
    except tpuray.exceptions.RayError as e:
        return [e]


class AsyncResult:
    """The pending result of ``apply_async``/``map_async``/``starmap_async``.

    A thread of its own collects the chunks as they finish; ``callback`` then gets the
    whole result (one value for ``apply_async``, the list otherwise) if no call failed,
    else ``error_callback`` gets the first failure to arrive (a :class:`PoolTaskError`
    for an exception the call raised, as Ray passes it; a ``RayError`` when the actor
    died).
    """

    def __init__(self, chunk_refs, callback=None, error_callback=None, single_result=False):
        self._refs = list(chunk_refs)
        self._single = single_result
        self._callback = callback
        self._error_callback = error_callback
        self._chunks: list = [None] * len(self._refs)
        self._failed = False
        self._done = threading.Event()
        threading.Thread(target=self._collect, daemon=True, name="tpuray-pool-result").start()

    def _collect(self) -> None:
        index = {ref: i for i, ref in enumerate(self._refs)}
        pending = list(self._refs)
        first_error = None
        try:
            while pending:
                ready, pending = tpuray.wait(pending, num_returns=1)
                for ref in ready:
                    chunk = _chunk_results(ref)
                    self._chunks[index[ref]] = chunk
                    if first_error is None:
                        first_error = next((v for v in chunk if isinstance(v, Exception)), None)
            self._failed = first_error is not None
            if first_error is not None:
                if self._error_callback is not None:
                    # As Ray's: the PoolTaskError itself (``.underlying`` is the call's).
                    self._error_callback(first_error)
            elif self._callback is not None:
                values = [v for chunk in self._chunks for v in chunk]
                self._callback(values[0] if self._single else values)
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> None:
        """Returns once the result is ready or after ``timeout`` seconds (never
        raises)."""
        self._done.wait(timeout)

    def get(self, timeout: float | None = None):
        """The result (one value, or the list of values in input order).

        Raises:
            multiprocessing.TimeoutError: not ready within ``timeout`` seconds.
            The first failed call's exception, in input order.
        """
        if not self._done.wait(timeout):
            raise TimeoutError
        values = []
        for chunk in self._chunks:
            for v in chunk:
                if isinstance(v, PoolTaskError):
                    raise v.underlying
                if isinstance(v, Exception):
                    raise v
            values.extend(chunk)
        return values[0] if self._single else values

    def ready(self) -> bool:
        """Whether every call finished."""
        return self._done.is_set()

    def successful(self) -> bool:
        """Whether no call failed.

        Raises:
            ValueError: not ready yet.
        """
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return not self._failed


class IMapIterator:
    """The results of ``imap`` (in input order) or ``imap_unordered`` (as chunks
    finish), with one chunk in flight per pool actor."""

    def __init__(self, pool: "Pool", func, iterable, chunksize, ordered: bool):
        self._pool = pool
        self._func = func
        self._ordered = ordered
        self._chunksize = max(1, int(chunksize or 1))
        self._source = iter(iterable)
        self._exhausted = False
        self._sent = 0  # chunks sent so far
        self._in_flight: dict = {}  # ref -> chunk index
        self._by_index: dict = {}  # chunk index -> ref (ordered form)
        self._next_index = 0
        self._ready: collections.deque = collections.deque()
        for _ in range(len(pool._actors)):
            self._send_next()

    def _send_next(self) -> None:
        if self._exhausted:
            return
        chunk = list(itertools.islice(self._source, self._chunksize))
        if len(chunk) < self._chunksize:
            self._exhausted = True
        if not chunk:
            return
        ref = self._pool._run_chunk(self._sent % len(self._pool._actors), self._func,
                                    [((v,), {}) for v in chunk])
        self._in_flight[ref] = self._sent
        self._by_index[self._sent] = ref
        self._sent += 1

    def __iter__(self):
        return self

    def __next__(self):
        return self.next()

    def next(self, timeout: float | None = None):
        """The next result.

        Raises:
            StopIteration: every result was taken.
            multiprocessing.TimeoutError: none ready within ``timeout`` seconds.
        """
        while not self._ready:
            if not self._in_flight:
                raise StopIteration
            if self._ordered:
                ref = self._by_index[self._next_index]
                ready, _ = tpuray.wait([ref], timeout=timeout)
            else:
                ready, _ = tpuray.wait(list(self._in_flight), num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError
            ref = ready[0]
            i = self._in_flight.pop(ref)
            del self._by_index[i]
            self._next_index += 1
            self._ready.extend(_chunk_results(ref))
            self._send_next()
        return self._ready.popleft()


class Pool:
    """A pool of actors with ``multiprocessing.Pool``'s API.

    Args:
        processes: How many actors; default: the cluster's CPUs.
        initializer: Called as ``initializer(*initargs)`` in each actor when it starts.
        initargs: Arguments for ``initializer``.
        maxtasksperchild: Replace an actor after it ran this many chunks (default:
            never).
        context: Accepted for ``multiprocessing.Pool``'s signature; ignored.
        ray_address: The cluster to connect to when this process is not connected yet
            (default: ``RAY_ADDRESS``/``TPURAY_ADDRESS``, this machine's cluster, else a
            new local cluster with ``processes`` CPUs).
        ray_remote_args: Options for the actors (what ``.options(...)`` takes).

    Raises:
        ValueError: ``processes`` is not positive or more than the cluster's CPUs.
    """

    def __init__(self, processes=None, initializer=None, initargs=None, maxtasksperchild=None,
                 context=None, ray_address=None, ray_remote_args=None):
        if context is not None:
            logger.warning("The 'context' argument is not supported by tpuray's Pool; ignored.")
        self._closed = False
        self._initializer = initializer
        self._initargs = initargs
        self._maxtasksperchild = maxtasksperchild or -1
        self._remote_args = dict(ray_remote_args or {})
        self._stopping: list = []
        self._cursor = 0
        processes = self._connect(processes, ray_address)
        self._actor_cls = tpuray.remote(num_cpus=0)(_PoolActor).options(**self._remote_args)
        # [actor, chunks it ran]
        self._actors = [[self._new_actor(), 0] for _ in range(processes)]
        tpuray.get([a.ping.remote() for a, _ in self._actors])

    @staticmethod
    def _connect(processes, ray_address) -> int:
        if not tpuray.is_initialized():
            if ray_address is not None:
                tpuray.init(address=ray_address, num_cpus=processes if ray_address == "local" else None)
            else:
                tpuray.init(num_cpus=processes)
        cpus = int(tpuray.cluster_resources().get("CPU", 0))
        if processes is None:
            processes = cpus
        if processes <= 0:
            raise ValueError("Processes in the pool must be >0.")
        if cpus < processes:
            raise ValueError(
                f"Tried to start a pool with {processes} processes on an existing ray "
                f"cluster, but there are only {cpus} CPUs in the ray cluster."
            )
        return processes

    def _new_actor(self):
        return self._actor_cls.remote(self._initializer, self._initargs)

    def _stop_actor(self, actor) -> None:
        # Behind the chunks already sent to it (one caller's calls run in order).
        self._stopping.append(actor.__ray_terminate__.remote())

    def _run_chunk(self, actor_index: int, func, batch):
        entry = self._actors[actor_index]
        ref = entry[0].run_batch.remote(func, batch)
        entry[1] += 1
        if entry[1] == self._maxtasksperchild:
            self._stop_actor(entry[0])
            entry[0], entry[1] = self._new_actor(), 0
        return ref

    def _next_actor(self) -> int:
        self._cursor = (self._cursor + 1) % len(self._actors)
        return self._cursor

    def _check_running(self) -> None:
        if self._closed:
            raise ValueError("Pool not running")

    def _chunksize(self, n: int) -> int:
        size, extra = divmod(n, len(self._actors) * 4)
        return size + 1 if extra else size

    def _map_chunks(self, func, iterable, chunksize, star: bool) -> list:
        items = iterable if hasattr(iterable, "__len__") else list(iterable)
        if chunksize is None:
            chunksize = self._chunksize(len(items))
        it = iter(items)
        refs: list = []
        while len(refs) * chunksize < len(items):
            batch: list[tuple[tuple, dict]] = [((tuple(v) if star else (v,)), {}) for v in itertools.islice(it, chunksize)]
            refs.append(self._run_chunk(len(refs) % len(self._actors), func, batch))
        return refs

    # ---- multiprocessing.Pool's API ----

    def apply(self, func, args=None, kwargs=None, kwds=None):
        """``func(*args, **kwargs)`` on one of the actors; its result.

        Raises:
            The call's exception.
        """
        return self.apply_async(func, args, kwargs, kwds=kwds).get()

    def apply_async(self, func, args=None, kwargs=None, callback=None, error_callback=None,
                    kwds=None):
        """``func(*args, **kwargs)`` on the next actor in turn; an :class:`AsyncResult`."""
        self._check_running()
        ref = self._run_chunk(self._next_actor(), func, [(args, kwargs or kwds)])
        return AsyncResult([ref], callback, error_callback, single_result=True)

    def map(self, func, iterable, chunksize=None) -> list:
        """``[func(v) for v in iterable]``, computed on the actors in chunks."""
        return self.map_async(func, iterable, chunksize).get()

    def map_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        """:meth:`map` without waiting: an :class:`AsyncResult`."""
        self._check_running()
        return AsyncResult(self._map_chunks(func, iterable, chunksize, False), callback,
                           error_callback)

    def starmap(self, func, iterable, chunksize=None) -> list:
        """``[func(*args) for args in iterable]``."""
        return self.starmap_async(func, iterable, chunksize).get()

    def starmap_async(self, func, iterable, chunksize=None, callback=None, error_callback=None):
        """:meth:`starmap` without waiting: an :class:`AsyncResult`."""
        self._check_running()
        return AsyncResult(self._map_chunks(func, iterable, chunksize, True), callback,
                           error_callback)

    def imap(self, func, iterable, chunksize=1) -> IMapIterator:
        """An iterator over ``func(v)`` in input order; one chunk per actor in flight."""
        self._check_running()
        return IMapIterator(self, func, iterable, chunksize, ordered=True)

    def imap_unordered(self, func, iterable, chunksize=1) -> IMapIterator:
        """Like :meth:`imap`, in the order the chunks finish."""
        self._check_running()
        return IMapIterator(self, func, iterable, chunksize, ordered=False)

    def close(self) -> None:
        """No more work; the actors exit once the work already sent is done."""
        for actor, _ in self._actors:
            self._stop_actor(actor)
        self._closed = True

    def terminate(self) -> None:
        """No more work; the actors are killed at once."""
        if not self._closed:
            self.close()
        for actor, _ in self._actors:
            tpuray.kill(actor)

    def join(self) -> None:
        """Waits for the actors of a closed pool to exit.

        Raises:
            ValueError: the pool was not closed.
        """
        if not self._closed:
            raise ValueError("Pool is still running")
        if self._stopping:
            tpuray.wait(self._stopping, num_returns=len(self._stopping))
        self._stopping = []

    def __enter__(self):
        self._check_running()
        return self

    def __exit__(self, *exc):
        self.terminate()


__all__ = ["AsyncResult", "IMapIterator", "Pool", "PoolTaskError"]
