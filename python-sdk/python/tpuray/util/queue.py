"""``tpuray.util.queue``: a FIFO queue held by an actor (Ray's ``ray.util.queue``).

The items live in one async actor (``_QueueActor``, an ``asyncio.Queue``); a
:class:`Queue` is a small picklable handle to it, so producers and consumers in
tasks, actors and the driver share one queue. Every method of the actor is a
coroutine, so all of them run on the actor's one event loop (``asyncio.Queue`` is
not thread-safe) and a blocked ``get`` never holds up a ``put``.

Ray's errors: the nowait forms raise a plain ``Empty``/``Full``; timeouts and batches a
``RayTaskError`` that is also one.
"""

from __future__ import annotations

import asyncio
import queue as _stdlib_queue
from collections.abc import Iterable

import tpuray


class Empty(_stdlib_queue.Empty):
    """Raised by ``get``/``get_nowait``/``get_nowait_batch`` on a queue without enough
    items (Ray's ``ray.util.queue.Empty``, a ``queue.Empty``)."""


class Full(_stdlib_queue.Full):
    """Raised by ``put``/``put_nowait``/``put_nowait_batch`` on a queue without room
    (Ray's ``ray.util.queue.Full``, a ``queue.Full``)."""


class _QueueActor:
    """The actor holding the items. ``maxsize <= 0``: unbounded."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: asyncio.Queue = asyncio.Queue(maxsize)

    async def qsize(self) -> int:
        return self.items.qsize()

    async def empty(self) -> bool:
        return self.items.empty()

    async def full(self) -> bool:
        return self.items.full()

    async def put(self, item, timeout=None) -> None:
        try:
            await asyncio.wait_for(self.items.put(item), timeout)
        except asyncio.TimeoutError:
            raise Full from None

    async def get(self, timeout=None):
        try:
            return await asyncio.wait_for(self.items.get(), timeout)
        except asyncio.TimeoutError:
            raise Empty from None

    async def put_nowait(self, item) -> None:
        # asyncio.QueueFull reaches the caller, which raises a plain Full (as Ray's).
        self.items.put_nowait(item)

    async def put_nowait_batch(self, items) -> None:
        items = list(items)
        room = self.maxsize - self.items.qsize()
        if self.maxsize > 0 and len(items) > room:
            raise Full(
                f"Cannot add {len(items)} items to queue of size {self.items.qsize()} "
                f"and maxsize {self.maxsize}."
            )
        for item in items:
            self.items.put_nowait(item)

    async def get_nowait(self):
        return self.items.get_nowait()

    async def get_nowait_batch(self, num_items: int) -> list:
        if num_items > self.items.qsize():
            raise Empty(
                f"Cannot get {num_items} items from queue of size {self.items.qsize()}."
            )
        return [self.items.get_nowait() for _ in range(num_items)]


def _check_timeout(timeout) -> None:
    if timeout is not None and timeout < 0:
        raise ValueError("'timeout' must be a non-negative number")


class Queue:
    """A first-in, first-out queue shared by the driver, tasks and actors (Ray's
    ``ray.util.queue.Queue``).

    Args:
        maxsize: The most items it holds; 0 (or less) means unbounded.
        actor_options: Options for the actor that holds the items (what
            ``.options(...)`` takes, e.g. ``{"num_cpus": 1}``).

    The queue is picklable: pass it to tasks and actors. ``put`` and ``get`` block
    (``block=True``) up to ``timeout`` seconds (``None``: forever); with several
    producers on a full queue (or consumers on an empty one) the order between them
    is not fixed.
    """

    def __init__(self, maxsize: int = 0, actor_options: dict | None = None) -> None:
        self.maxsize = maxsize
        self.actor = (
            tpuray.remote(_QueueActor).options(**(actor_options or {})).remote(maxsize)
        )

    def __len__(self) -> int:
        return self.size()

    def size(self) -> int:
        """The number of items in the queue."""
        return tpuray.get(self.actor.qsize.remote())

    def qsize(self) -> int:
        """The number of items in the queue."""
        return self.size()

    def empty(self) -> bool:
        """Whether the queue holds no items."""
        return tpuray.get(self.actor.empty.remote())

    def full(self) -> bool:
        """Whether the queue holds ``maxsize`` items (never for an unbounded queue)."""
        return tpuray.get(self.actor.full.remote())

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        """Adds ``item`` at the end.

        Raises:
            Full: the queue is full and ``block`` is false (a plain ``Full``), or it
                stayed full for ``timeout`` seconds (a ``RayTaskError`` that is also a
                ``Full``, as Ray raises it).
            ValueError: ``timeout`` is negative.
        """
        if not block:
            try:
                tpuray.get(self.actor.put_nowait.remote(item))
            except asyncio.QueueFull:
                raise Full from None
            return
        _check_timeout(timeout)
        tpuray.get(self.actor.put.remote(item, timeout))

    async def put_async(self, item, block: bool = True, timeout: float | None = None) -> None:
        """:meth:`put` for coroutines (awaits the actor instead of blocking)."""
        if not block:
            try:
                await self.actor.put_nowait.remote(item)
            except asyncio.QueueFull:
                raise Full from None
            return
        _check_timeout(timeout)
        await self.actor.put.remote(item, timeout)

    def get(self, block: bool = True, timeout: float | None = None):
        """Removes and returns the first item.

        Raises:
            Empty: the queue is empty and ``block`` is false (a plain ``Empty``), or it
                stayed empty for ``timeout`` seconds (a ``RayTaskError`` that is also an
                ``Empty``).
            ValueError: ``timeout`` is negative.
        """
        if not block:
            try:
                return tpuray.get(self.actor.get_nowait.remote())
            except asyncio.QueueEmpty:
                raise Empty from None
        _check_timeout(timeout)
        return tpuray.get(self.actor.get.remote(timeout))

    async def get_async(self, block: bool = True, timeout: float | None = None):
        """:meth:`get` for coroutines."""
        if not block:
            try:
                return await self.actor.get_nowait.remote()
            except asyncio.QueueEmpty:
                raise Empty from None
        _check_timeout(timeout)
        return await self.actor.get.remote(timeout)

    def put_nowait(self, item) -> None:
        """``put(item, block=False)``."""
        self.put(item, block=False)

    def put_nowait_batch(self, items: Iterable) -> None:
        """Adds every item of ``items``, in order, or none of them.

        Raises:
            TypeError: ``items`` is not iterable.
            Full: they do not all fit.
        """
        if not isinstance(items, Iterable):
            raise TypeError("Argument 'items' must be an Iterable")
        tpuray.get(self.actor.put_nowait_batch.remote(list(items)))

    def get_nowait(self):
        """``get(block=False)``."""
        return self.get(block=False)

    def get_nowait_batch(self, num_items: int) -> list:
        """Removes and returns the first ``num_items`` items, or none of them.

        Raises:
            TypeError: ``num_items`` is not an int.
            ValueError: ``num_items`` is negative.
            Empty: the queue holds fewer than ``num_items`` items.
        """
        if not isinstance(num_items, int):
            raise TypeError("Argument 'num_items' must be an int")
        if num_items < 0:
            raise ValueError("'num_items' must be nonnegative")
        return tpuray.get(self.actor.get_nowait_batch.remote(num_items))

    def shutdown(self, force: bool = False, grace_period_s: int = 5) -> None:
        """Stops the actor holding the items (its resources go back to the cluster).

        Args:
            force: Kill it at once; otherwise it finishes the calls already sent and
                exits, and is killed if that takes more than ``grace_period_s``
                seconds.
        """
        if self.actor is not None:
            if force:
                tpuray.kill(self.actor, no_restart=True)
            else:
                done = self.actor.__ray_terminate__.remote()
                ready, _ = tpuray.wait([done], timeout=grace_period_s)
                if not ready:
                    tpuray.kill(self.actor, no_restart=True)
        self.actor = None


__all__ = ["Empty", "Full", "Queue"]
