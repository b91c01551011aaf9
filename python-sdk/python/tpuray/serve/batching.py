"""``@serve.batch``: calls that arrive close together run as one call on lists.

As Ray Serve's ``@serve.batch``
(https://docs.ray.io/en/latest/serve/advanced-guides/dyn-req-batch.html): the decorated
function (or method) takes a list per argument and returns a list with one result per
request, in order. A batch is sent as soon as ``max_batch_size`` requests wait, or
``batch_wait_timeout_s`` seconds after the first request of the batch arrived, whichever
comes first. Callers ``await`` the decorated function with single arguments. Up to
``max_concurrent_batches`` batches run at once. The wrapper has
``set_max_batch_size(n)`` and ``set_batch_wait_timeout_s(t)``.

Queues are per instance (per ``self``) and per event loop; a replica has one loop.
Not supported (Ray has it): generators that stream per-request results from a batch.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import uuid

#: Queues of @serve.batch plain functions, by decoration key, then event loop.
_plain_queues: dict = {}


def _check(max_batch_size, batch_wait_timeout_s, max_concurrent_batches):
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1 (got {max_batch_size!r})")
    if isinstance(batch_wait_timeout_s, bool) or not isinstance(batch_wait_timeout_s, (int, float)) \
            or batch_wait_timeout_s < 0:
        raise ValueError(f"batch_wait_timeout_s must be a number >= 0 (got {batch_wait_timeout_s!r})")
    if isinstance(max_concurrent_batches, bool) or not isinstance(max_concurrent_batches, int) \
            or max_concurrent_batches < 1:
        raise ValueError(f"max_concurrent_batches must be an integer >= 1 (got {max_concurrent_batches!r})")


class _BatchQueue:
    def __init__(self, fn, settings, is_async):
        self._fn = fn  # called with the per-argument lists
        self._is_async = is_async  # else run in the loop's default thread pool
        self._settings = settings
        self._items: list = []  # (args, kwargs, future, arrival time)
        self._wake = asyncio.Event()
        self._running = asyncio.Semaphore(settings["max_concurrent_batches"])
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def put(self, args, kwargs) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._items.append((args, kwargs, fut, time.monotonic()))
        self._wake.set()
        return fut

    async def _loop(self):
        while True:
            while not self._items:
                self._wake.clear()
                await self._wake.wait()
            first = self._items[0][3]
            while len(self._items) < self._settings["max_batch_size"]:
                left = first + self._settings["batch_wait_timeout_s"] - time.monotonic()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            n = self._settings["max_batch_size"]
            batch, self._items = self._items[:n], self._items[n:]
            await self._running.acquire()
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch):
        try:
            futs = [b[2] for b in batch]
            try:
                nargs = {len(b[0]) for b in batch}
                kwnames = {tuple(sorted(b[1])) for b in batch}
                if len(nargs) != 1 or len(kwnames) != 1:
                    raise TypeError(
                        "every call of a @serve.batch function in one batch must pass the same "
                        f"arguments (got {len(nargs)} positional shapes and keyword sets {sorted(kwnames)})"
                    )
                n = nargs.pop()
                args = [[b[0][i] for b in batch] for i in range(n)]
                kwargs = {k: [b[1][k] for b in batch] for k in kwnames.pop()}
                if self._is_async:
                    result = self._fn(*args, **kwargs)
                else:
                    result = await asyncio.get_running_loop().run_in_executor(
                        None, functools.partial(self._fn, *args, **kwargs)
                    )
                if inspect.isawaitable(result):
                    result = await result
                if inspect.isgenerator(result) or inspect.isasyncgen(result):
                    raise TypeError("@serve.batch generators (streamed batch results) are not supported by tpuray.serve")
                try:
                    results = list(result)
                except TypeError:
                    raise TypeError(
                        f"a @serve.batch function must return a list with one result per request "
                        f"(got {type(result).__name__})"
                    ) from None
                if len(results) != len(batch):
                    raise TypeError(
                        f"a @serve.batch function returned {len(results)} results for a batch of "
                        f"{len(batch)} requests (expected one per request, in order)"
                    )
                for f, r in zip(futs, results):
                    if not f.done():
                        f.set_result(r)
            except BaseException as e:  # noqa: BLE001 - every caller of the batch gets it
                for f in futs:
                    if not f.done():
                        f.set_exception(e)
        finally:
            self._running.release()


def batch(_func=None, *, max_batch_size: int = 10, batch_wait_timeout_s: float = 0.01,
          max_concurrent_batches: int = 1):
    """Batches calls of an async (or plain) function or method; see the module doc.

    Args:
        max_batch_size: the most requests per call (Ray's default 10).
        batch_wait_timeout_s: seconds a batch waits, from its first request, for more
            (Ray's default 0.01).
        max_concurrent_batches: batches that may run at once (default 1).

    Raises:
        ValueError: a bad setting (at decoration).
    """
    _check(max_batch_size, batch_wait_timeout_s, max_concurrent_batches)

    def decorate(func):
        if not callable(func):
            raise TypeError(f"@serve.batch must decorate a function or method (got {type(func).__name__})")
        params = list(inspect.signature(func).parameters)
        is_method = bool(params) and params[0] == "self"
        is_async = inspect.iscoroutinefunction(func)
        settings = {"max_batch_size": max_batch_size, "batch_wait_timeout_s": float(batch_wait_timeout_s),
                    "max_concurrent_batches": max_concurrent_batches}
        # Queues live on the instance (or, for a plain function, in a module table) and
        # not in this closure, so the decorated class still pickles by value.
        key = f"__serve_batch_queues_{func.__name__}_{uuid.uuid4().hex[:8]}"

        def queue_for(owner):
            loop = asyncio.get_running_loop()
            per = _plain_queues.setdefault(key, {}) if owner is None else owner.__dict__.setdefault(key, {})
            q = per.get(loop)
            if q is None:
                fn = func if owner is None else functools.partial(func, owner)
                q = per[loop] = _BatchQueue(fn, settings, is_async)
            return q

        @functools.wraps(func)
        async def wrapper(*args, **kwargs):
            if is_method:
                if not args:
                    raise TypeError(f"{func.__name__}() is a @serve.batch method: call it on an instance")
                owner, args = args[0], args[1:]
            else:
                owner = None
            return await queue_for(owner).put(args, kwargs)

        def set_max_batch_size(n: int) -> None:
            _check(n, settings["batch_wait_timeout_s"], settings["max_concurrent_batches"])
            settings["max_batch_size"] = n

        def set_batch_wait_timeout_s(t: float) -> None:
            _check(settings["max_batch_size"], t, settings["max_concurrent_batches"])
            settings["batch_wait_timeout_s"] = float(t)

        wrapper.set_max_batch_size = set_max_batch_size
        wrapper.set_batch_wait_timeout_s = set_batch_wait_timeout_s
        wrapper._get_max_batch_size = lambda: settings["max_batch_size"]
        wrapper._get_batch_wait_timeout_s = lambda: settings["batch_wait_timeout_s"]
        return wrapper

    if _func is not None:
        return decorate(_func)
    return decorate
