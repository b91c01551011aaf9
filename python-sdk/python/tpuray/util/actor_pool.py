"""``ActorPool`` (Ray's ``ray.util.ActorPool``): spread calls over a fixed set of actors."""

from __future__ import annotations

import tpuray


class ActorPool:
    """Runs ``fn(actor, value)`` calls on whichever actor of ``actors`` is free.

    ``map``/``map_unordered`` yield results; ``submit`` + ``get_next`` (submission order)
    or ``get_next_unordered`` (completion order) work call by call.
    """

    def __init__(self, actors):
        self._idle = list(actors)
        self._future_to_actor = {}
        self._index_to_future = {}
        self._next_task_index = 0
        self._next_return_index = 0
        self._pending = []

    def map(self, fn, values):
        for v in values:
            self.submit(fn, v)
        while self.has_next():
            yield self.get_next()

    def map_unordered(self, fn, values):
        for v in values:
            self.submit(fn, v)
        while self.has_next():
            yield self.get_next_unordered()

    def submit(self, fn, value):
        if self._idle:
            actor = self._idle.pop()
            future = fn(actor, value)
            self._future_to_actor[future] = (self._next_task_index, actor)
            self._index_to_future[self._next_task_index] = future
            self._next_task_index += 1
        else:
            self._pending.append((fn, value))

    def has_next(self) -> bool:
        return bool(self._future_to_actor) or bool(self._pending)

    def has_free(self) -> bool:
        return bool(self._idle) and not self._pending

    def get_next(self, timeout=None, ignore_if_timedout=False):
        if not self.has_next():
            raise StopIteration("No more results to get")
        if self._next_return_index >= self._next_task_index:
            raise ValueError("It is not allowed to call get_next() after get_next_unordered().")
        future = self._index_to_future[self._next_return_index]
        if timeout is not None:
            ready, _ = tpuray.wait([future], timeout=timeout)
            if not ready:
                if ignore_if_timedout:
                    self._next_return_index += 1
                raise TimeoutError("Timed out waiting for result")
        del self._index_to_future[self._next_return_index]
        self._next_return_index += 1
        _, actor = self._future_to_actor.pop(future)
        self._return_actor(actor)
        return tpuray.get(future)

    def get_next_unordered(self, timeout=None, ignore_if_timedout=False):
        if not self.has_next():
            raise StopIteration("No more results to get")
        ready, _ = tpuray.wait(list(self._future_to_actor), num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError("Timed out waiting for result")
        future = ready[0]
        index, actor = self._future_to_actor.pop(future)
        self._index_to_future.pop(index, None)
        self._next_return_index = max(self._next_return_index, index + 1)
        self._return_actor(actor)
        return tpuray.get(future)

    def _return_actor(self, actor):
        self._idle.append(actor)
        if self._pending:
            self.submit(*self._pending.pop(0))

    def push(self, actor):
        """Adds an actor to the pool."""
        self._return_actor(actor)

    def pop_idle(self):
        """Takes an idle actor out of the pool (``None`` when all are busy)."""
        return self._idle.pop() if self.has_free() else None
