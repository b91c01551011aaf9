"""``ActorPool`` (Ray's ``ray.util.ActorPool``): spread calls over a fixed set of actors.

As in Ray, an actor whose call died leaves the pool.
"""

from __future__ import annotations

import tpuray


def _key(future):
    # A call with num_returns > 1 gives a list of refs: keyed by the tuple.
    return tuple(future) if isinstance(future, list) else future


class ActorPool:
    """Runs ``fn(actor, value)`` calls on whichever actor of ``actors`` is idle.

    ``fn`` returns the ref (or list of refs) of one call; the actor stays busy until
    that call's result is taken. ``map`` / ``map_unordered`` yield results (in
    submission order / as they finish); ``submit`` queues one value (run at once when
    an actor is idle, else when one frees up) and ``get_next`` (submission order) or
    ``get_next_unordered`` (completion order) take results one at a time.

    Args:
        actors: The actor handles to use.
    """

    def __init__(self, actors: list):
        self._idle_actors = list(actors)
        # Key of each call in flight -> (submission index, actor).
        self._future_to_actor: dict = {}
        self._index_to_future: dict = {}
        self._next_task_index = 0
        self._next_return_index = 0
        self._pending_submits: list = []

    def map(self, fn, values):
        """``fn(actor, v)`` for every ``v`` of ``values``; an iterator over the results
        in the order of ``values``. Results of earlier submissions not yet taken are
        dropped first.

        Raises (while iterating):
            The call's own exception (``get`` semantics).
        """
        while self.has_next():
            try:
                self.get_next(timeout=0, ignore_if_timedout=True)
            except TimeoutError:
                pass
        for v in values:
            self.submit(fn, v)

        def results():
            while self.has_next():
                yield self.get_next()

        return results()

    def map_unordered(self, fn, values):
        """Like :meth:`map`, but yields each result as soon as it is ready."""
        while self.has_next():
            try:
                self.get_next_unordered(timeout=0)
            except TimeoutError:
                pass
        for v in values:
            self.submit(fn, v)

        def results():
            while self.has_next():
                yield self.get_next_unordered()

        return results()

    def submit(self, fn, value) -> None:
        """Runs ``fn(actor, value)`` on an idle actor, or queues it until one is idle."""
        if not self._idle_actors:
            self._pending_submits.append((fn, value))
            return
        actor = self._idle_actors.pop()
        future = fn(actor, value)
        self._future_to_actor[_key(future)] = (self._next_task_index, actor)
        self._index_to_future[self._next_task_index] = future
        self._next_task_index += 1

    def has_next(self) -> bool:
        """Whether a submitted call's result is still to be taken."""
        return bool(self._future_to_actor)

    def has_free(self) -> bool:
        """Whether an actor is idle and nothing waits to be submitted."""
        return bool(self._idle_actors) and not self._pending_submits

    def get_next(self, timeout: float | None = None, ignore_if_timedout: bool = False):
        """The next result in submission order, waiting up to ``timeout`` seconds.

        Raises:
            StopIteration: no result is pending.
            ValueError: ``get_next_unordered`` already took a later result.
            TimeoutError: not ready within ``timeout`` (with ``ignore_if_timedout`` the
                call is dropped first and its actor returned to the pool).
        """
        if not self.has_next():
            raise StopIteration("No more results to get")
        if self._next_return_index >= self._next_task_index:
            raise ValueError("It is not allowed to call get_next() after get_next_unordered().")
        future = self._index_to_future[self._next_return_index]
        timed_out = False
        if timeout is not None:
            ready, _ = tpuray.wait([future], timeout=timeout)
            if not ready:
                if not ignore_if_timedout:
                    raise TimeoutError("Timed out waiting for result")
                timed_out = True
        del self._index_to_future[self._next_return_index]
        self._next_return_index += 1
        _, actor = self._future_to_actor.pop(_key(future))
        if timed_out:
            self._return_actor(actor)
            raise TimeoutError(f"Timed out waiting for result. The task {future} has been ignored.")
        return self._take(future, actor)

    def get_next_unordered(self, timeout: float | None = None, ignore_if_timedout: bool = False):
        """Whichever pending result is ready first, waiting up to ``timeout`` seconds.

        Raises:
            StopIteration: no result is pending.
            TimeoutError: none ready within ``timeout``.
        """
        if not self.has_next():
            raise StopIteration("No more results to get")
        ready, _ = tpuray.wait(list(self._future_to_actor), num_returns=1, timeout=timeout)
        if not ready:
            # Nothing finished: there is no call to drop, whatever ignore_if_timedout says.
            raise TimeoutError("Timed out waiting for result")
        future = ready[0]
        index, actor = self._future_to_actor.pop(future)
        del self._index_to_future[index]
        self._next_return_index = max(self._next_return_index, index + 1)
        return self._take(future, actor)

    def _take(self, future, actor):
        """``get`` the result; the actor goes back to the pool unless it died."""
        alive = True
        try:
            return tpuray.get(list(future) if isinstance(future, tuple) else future)
        except tpuray.exceptions.ActorDiedError:
            alive = False
            raise
        finally:
            self._return_actor(actor, alive)

    def _return_actor(self, actor, alive: bool = True) -> None:
        if alive:
            self._idle_actors.append(actor)
        if self._pending_submits and self._idle_actors:
            self.submit(*self._pending_submits.pop(0))

    def push(self, actor) -> None:
        """Adds ``actor`` to the pool (it takes a queued submission at once, if any).

        Raises:
            ValueError: the actor is in the pool already.
        """
        busy = [a for _, a in self._future_to_actor.values()]
        if actor in self._idle_actors or actor in busy:
            raise ValueError("Actor already belongs to current ActorPool")
        self._return_actor(actor)

    def pop_idle(self):
        """Takes an idle actor out of the pool; ``None`` when none is free (see
        :meth:`has_free`)."""
        return self._idle_actors.pop() if self.has_free() else None
