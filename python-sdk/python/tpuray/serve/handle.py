"""Deployment handles, their responses, and the router behind them.

``DeploymentHandle.remote(...)`` returns at once with a ``DeploymentResponse``
(Ray Serve's API, https://docs.ray.io/en/latest/serve/model_composition.html): await it
in async code, call ``.result(timeout_s=)`` in sync code, or pass it as an argument to
another handle call (the other call is sent once this one is assigned to a replica, with
its result as the argument, resolved by the core). ``handle.options(stream=True)`` gives
a ``DeploymentResponseGenerator`` (iterate it, or ``async for``).

One :class:`_Router` per deployment per process holds the deployment's replicas
(long-polled from the controller), the requests this process has in flight at each, and
a queue of requests waiting for a replica with room (fewer than
``max_ongoing_requests`` ongoing). Choice: power of two random choices on this
process's ongoing counts (Ray's default router), or, with
``request_router="prefix_affinity"``, the replica that rendezvous-hashing of the
request's prompt prefix names, unless it is full or has more than
``imbalanced_threshold`` requests above the least loaded (then power of two choices).

Threads: ``remote()`` runs in the caller's thread and never blocks on the network for
long (an actor call is submitted, or the request is queued). Two daemon threads per
router: one long-polls the controller for replica changes, one watches requests in
flight (to count them off), sends queued ones, and pushes this process's ongoing
request count to the controller (autoscaling's metric, Ray's handle-side metrics).

Retries: a request whose replica died (``ActorDiedError`` or a crashed worker, not an
exception the user's code raised) is sent again to another replica, at most
``_MAX_ATTEMPTS`` times in all, then fails with ``ReplicaDiedError``; a stream is
retried only before its first item. Replicas are thus at-least-once when one dies.

Past ``max_queued_requests`` waiting requests a call fails with 503
``BackPressureError``. A ``DeploymentResponse`` passed into another handle call travels
as the underlying ref, so the core resolves it at the callee (no round trip through the
caller). ``_MAX_ATTEMPTS`` is three.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import hashlib
import random
import threading
import time
import uuid
from typing import Any

import tpuray
from tpuray.serve import _common
from tpuray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RayServeException,
    ReplicaDiedError,
)

#: Sends per request before a replica death fails it.
_MAX_ATTEMPTS = 3
#: Seconds between pushes of this process's ongoing count while it is not zero.
_METRICS_PUSH_S = 0.25


class _Request:
    """One attempt to send a request: assigned to a replica when ``future`` resolves
    with ``(replica_id, ObjectRef or ObjectRefGenerator)``."""

    __slots__ = ("meta", "args", "kwargs", "future", "attempt", "replica_id", "ref", "done")

    def __init__(self, meta, args, kwargs, attempt=1):
        self.meta = meta
        self.args = args
        self.kwargs = kwargs
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.attempt = attempt
        self.replica_id = None
        self.ref = None
        self.done = False


def _prefix_of(args, kwargs, chars: int) -> str | None:
    """The prompt prefix a prefix-affinity router hashes: the first positional argument
    if it is a string, else its ``prompt`` (or ``text``, or joined ``messages``
    contents) when it is a dict or an HTTP request with such a JSON body."""
    v = args[0] if args else (kwargs.get("prompt") if kwargs else None)
    from tpuray.serve.http import HTTPRequest

    if isinstance(v, HTTPRequest):
        v = v.json_body
    if isinstance(v, dict):
        if isinstance(v.get("prompt"), str):
            v = v["prompt"]
        elif isinstance(v.get("text"), str):
            v = v["text"]
        elif isinstance(v.get("messages"), list):
            v = "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in v["messages"])
    if isinstance(v, str) and v:
        return v[:chars]
    return None


def _weight(prefix: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{prefix}\0{replica_id}".encode(), digest_size=8).digest(), "big")


class _Router:
    def __init__(self, app: str, deployment: str):
        self.app = app
        self.deployment = deployment
        self._cv = threading.Condition()
        self._replicas: dict = {}  # replica id -> actor handle
        self._models: dict = {}  # replica id -> multiplexed model ids it holds
        self._ongoing: dict = {}  # replica id -> requests this process has there
        self._dead: set = set()  # ids that died here; left out until the controller drops them
        self._config: dict[str, Any] = {"max_ongoing_requests": 5, "max_queued_requests": -1,
                        "request_router": "pow2", "request_router_kwargs": {}}
        self._version = -1
        self._exists = None  # None until the controller first answers
        self._failed = None  # the controller's message once the deployment failed
        self._pending: collections.deque = collections.deque()
        self._inflight: dict = {}  # ObjectRef -> _Request
        self._handle_id = uuid.uuid4().hex[:12]
        self._last_push = 0.0
        self._last_pushed_value = 0
        self._stopped = False
        self._rng = random.Random()
        self._threads = [
            threading.Thread(target=target, daemon=True, name=f"serve-router-{name}-{deployment}")
            for target, name in ((self._poll_loop, "poll"), (self._watch_loop, "watch"))
        ]
        for t in self._threads:
            t.start()

    # ---- sending ----

    def submit(self, req: _Request) -> None:
        with self._cv:
            if self._exists is False:
                req.future.set_exception(self._unavailable())
                return
            if not self._pending and self._try_assign(req):
                return
            mq = self._config.get("max_queued_requests", -1)
            if mq != -1 and len(self._pending) >= mq:
                req.future.set_exception(self._backpressure(mq))
                return
            self._pending.append(req)
            self._cv.notify_all()

    def _backpressure(self, mq):
        return BackPressureError(
            f"request dropped due to backpressure: deployment {self.deployment!r} of "
            f"application {self.app!r} already has {len(self._pending)} queued requests "
            f"(max_queued_requests={mq})"
        )

    def _unavailable(self):
        return DeploymentUnavailableError(
            f"deployment {self.deployment!r} of application {self.app!r} does not exist "
            "(it was deleted, or never deployed)"
        )

    def _resolve_args(self, req):
        """Top-level DeploymentResponse arguments as their ObjectRefs; None when one of
        them is not assigned yet. Raises what an argument's assignment failed with."""
        def conv(v):
            if isinstance(v, DeploymentResponse):
                r = v._current
                if not r.future.done():
                    raise _NotYet
                r.future.result()  # raises if that request could not be sent
                return r.ref
            return v

        try:
            return [conv(a) for a in req.args], {k: conv(v) for k, v in req.kwargs.items()}
        except _NotYet:
            return None

    def _choose(self, req):
        cap = self._config["max_ongoing_requests"]
        ids = [r for r in self._replicas if r not in self._dead]
        free = [r for r in ids if self._ongoing.get(r, 0) < cap]
        if not free:
            return None
        model = req.meta.get("multiplexed_model_id")
        if model:
            # Ray's multiplexed routing: a replica that holds the model, if one has room.
            holding = [r for r in free if model in self._models.get(r, ())]
            if holding:
                free = holding
            else:
                # Otherwise the one holding fewest models (it has room to load another).
                least = min(len(self._models.get(r, ())) for r in free)
                free = [r for r in free if len(self._models.get(r, ())) == least]
        elif self._config["request_router"] == "prefix_affinity":
            kw = self._config["request_router_kwargs"]
            prefix = _prefix_of(req.args, req.kwargs, int(kw.get("prefix_chars", 64)))
            if prefix is not None:
                best = max(ids, key=lambda r: _weight(prefix, r))
                least = min(self._ongoing.get(r, 0) for r in ids)
                load = self._ongoing.get(best, 0)
                if load < cap and load <= least + int(kw.get("imbalanced_threshold", 4)):
                    return best
        if len(free) == 1:
            return free[0]
        a, b = self._rng.sample(free, 2)
        return a if self._ongoing.get(a, 0) <= self._ongoing.get(b, 0) else b

    def _try_assign(self, req) -> bool:
        """Sends ``req`` if a replica has room (lock held); False leaves it queued."""
        try:
            resolved = self._resolve_args(req)
        except BaseException as e:  # noqa: BLE001 - an argument's own failure
            req.future.set_exception(e)
            return True
        if resolved is None:
            return False
        rid = self._choose(req)
        if rid is None:
            return False
        args, kwargs = resolved
        actor = self._replicas[rid]
        meta = dict(req.meta)
        try:
            if meta.get("stream"):
                ref = actor.handle_request_streaming.options(num_returns="streaming").remote(meta, *args, **kwargs)
            else:
                ref = actor.handle_request.remote(meta, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - e.g. an unpicklable argument
            req.future.set_exception(e)
            return True
        self._ongoing[rid] = self._ongoing.get(rid, 0) + 1
        req.replica_id = rid
        req.ref = ref
        if not meta.get("stream"):
            self._inflight[ref] = req
        self._cv.notify_all()
        req.future.set_result((rid, ref))
        return True

    def _dispatch_pending(self) -> None:
        """Sends queued requests in order while replicas have room (lock held)."""
        if self._exists is False:
            while self._pending:
                self._pending.popleft().future.set_exception(self._unavailable())
            return
        if self._failed and not self._replicas:
            # No replica runs and none will start: fail rather than wait forever.
            while self._pending:
                self._pending.popleft().future.set_exception(DeploymentUnavailableError(
                    f"deployment {self.deployment!r} of application {self.app!r} failed: {self._failed}"
                ))
            return
        kept: collections.deque = collections.deque()
        while self._pending:
            req = self._pending.popleft()
            if not self._try_assign(req):
                kept.append(req)
                if self._resolve_args(req) is not None:
                    # No replica has room: the rest wait too, in order.
                    kept.extend(self._pending)
                    self._pending.clear()
        self._pending = kept
        # Requests queued before this process knew the limit (its first answer from the
        # controller) are held to it now: the newest go.
        mq = self._config.get("max_queued_requests", -1)
        while mq != -1 and len(self._pending) > mq:
            self._pending.pop().future.set_exception(self._backpressure(mq))

    # ---- completion ----

    def finished(self, req: _Request) -> None:
        """Counts ``req`` off its replica (idempotent)."""
        with self._cv:
            if req.done or req.replica_id is None:
                req.done = True
                return
            req.done = True
            if not req.meta.get("stream"):
                self._inflight.pop(req.ref, None)
            n = self._ongoing.get(req.replica_id, 0) - 1
            if n <= 0:
                self._ongoing.pop(req.replica_id, None)
            else:
                self._ongoing[req.replica_id] = n
            self._dispatch_pending()

    def replica_died(self, replica_id: str) -> None:
        """Stops sending to ``replica_id`` here and tells the controller."""
        with self._cv:
            self._dead.add(replica_id)
        try:
            _common.get_controller().report_replica_failure.remote(self.app, self.deployment, replica_id)
        except Exception:  # noqa: BLE001 - best effort; health checks find it anyway
            pass

    def _watch_loop(self) -> None:
        while not self._stopped:
            try:
                with self._cv:
                    refs = list(self._inflight)
                    if not refs and not self._pending:
                        self._cv.wait(timeout=_METRICS_PUSH_S)
                if refs:
                    ready, _ = tpuray.wait(refs, num_returns=1, timeout=0.1)
                    if ready:
                        more, _ = tpuray.wait(refs, num_returns=len(refs), timeout=0)
                        ready = more or ready
                    for ref in ready:
                        with self._cv:
                            req = self._inflight.get(ref)
                        if req is not None:
                            self.finished(req)
                elif self._pending:
                    time.sleep(0.05)
                with self._cv:
                    self._dispatch_pending()
                self._push_metrics()
            except Exception:  # noqa: BLE001 - shutdown races; keep the loop alive
                if not tpuray.is_initialized():
                    return
                time.sleep(0.2)

    def _push_metrics(self) -> None:
        with self._cv:
            total = sum(self._ongoing.values()) + len(self._pending)
        now = time.monotonic()
        if total == 0 and self._last_pushed_value == 0:
            return
        if now - self._last_push < _METRICS_PUSH_S and total != 0:
            return
        try:
            _common.get_controller().record_handle_metrics.remote(
                self.app, self.deployment, self._handle_id, total
            )
            self._last_push = now
            self._last_pushed_value = total
        except Exception:  # noqa: BLE001 - no controller (yet): nothing to scale
            pass

    # ---- replica set ----

    def _poll_loop(self) -> None:
        # Waits in short slices (the long poll itself lasts up to 10 s) so that the thread
        # notices a stop soon: a daemon thread still inside the core when the interpreter
        # exits would abort the process.
        ref = None
        while not self._stopped:
            try:
                if ref is None:
                    ref = _common.get_controller().listen_for_replicas.remote(
                        self.app, self.deployment, self._version
                    )
                version, snap = tpuray.get(ref, timeout=0.25)
                ref = None
            except tpuray.exceptions.GetTimeoutError:
                continue
            except Exception:  # noqa: BLE001 - controller restarting or shut down
                ref = None
                if not tpuray.is_initialized():
                    return
                _common.forget_controller()
                time.sleep(0.25)
                continue
            with self._cv:
                self._version = version
                self._exists = snap["exists"]
                self._failed = snap.get("failed")
                self._replicas = dict(snap["replicas"])
                self._models = {k: set(v) for k, v in (snap.get("models") or {}).items()}
                self._config = snap["config"] or self._config
                self._dead &= set(self._replicas)
                self._dispatch_pending()
                self._cv.notify_all()

    def num_replicas(self) -> int:
        with self._cv:
            return len(self._replicas)


class _NotYet(Exception):
    pass


_routers: dict = {}
_routers_lock = threading.Lock()


def _router(app: str, deployment: str) -> _Router:
    global _atexit_registered
    key = (app, deployment)
    with _routers_lock:
        r = _routers.get(key)
        if r is None:
            tpuray._private.worker.check_connected()
            if not _atexit_registered:
                # Runs before tpuray.shutdown's own exit handler (registered earlier).
                atexit.register(_stop_routers)
                _atexit_registered = True
            r = _routers[key] = _Router(app, deployment)
        return r


_atexit_registered = False


def _stop_routers() -> None:
    """Stops every router of this process: queued requests fail, threads end (waited
    for, briefly)."""
    with _routers_lock:
        routers = list(_routers.values())
        _routers.clear()
    for r in routers:
        r._stopped = True
        with r._cv:
            while r._pending:
                r._pending.popleft().future.set_exception(
                    RayServeException("serve was shut down before the request was sent")
                )
            r._cv.notify_all()
    deadline = time.monotonic() + 3.0
    for r in routers:
        for t in r._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


class DeploymentHandle:
    """A handle to a deployment (Ray's ``DeploymentHandle``): ``handle.remote(...)``
    calls ``__call__``, ``handle.method.remote(...)`` or
    ``handle.options(method_name="method")`` another method. Picklable: pass it to
    tasks, actors and other deployments.

    ``options``: ``method_name``, ``stream`` (bool), ``multiplexed_model_id`` (str,
    carried to the replica's context only).
    """

    def __init__(self, deployment_name: str, app_name: str = _common.DEFAULT_APP_NAME,
                 *, method_name: str = "__call__", stream: bool = False,
                 multiplexed_model_id: str = "", _http: bool = False):
        self.deployment_name = deployment_name
        self.app_name = app_name
        self._method = method_name
        self._stream = stream
        self._model_id = multiplexed_model_id
        self._http = _http

    def options(self, *, method_name=None, stream=None, multiplexed_model_id=None,
                use_new_handle_api=None, _http=None, **unknown) -> "DeploymentHandle":
        """A copy of this handle with options changed.

        Raises:
            TypeError: an unknown option or a value of the wrong type.
        """
        if unknown:
            raise TypeError(
                f"unknown handle option(s) {sorted(unknown)}; expected method_name, stream, multiplexed_model_id"
            )
        if method_name is not None and not isinstance(method_name, str):
            raise TypeError(f"method_name must be a string (got {method_name!r})")
        if stream is not None and not isinstance(stream, bool):
            raise TypeError(f"stream must be a bool (got {stream!r})")
        return DeploymentHandle(
            self.deployment_name, self.app_name,
            method_name=self._method if method_name is None else method_name,
            stream=self._stream if stream is None else stream,
            multiplexed_model_id=self._model_id if multiplexed_model_id is None else multiplexed_model_id,
            _http=self._http if _http is None else _http,
        )

    def __getattr__(self, name: str) -> "DeploymentHandle":
        if name.startswith("_"):
            raise AttributeError(name)
        return self.options(method_name=name)

    def remote(self, *args, **kwargs):
        """Sends a request; returns a ``DeploymentResponse`` (or, with
        ``stream=True``, a ``DeploymentResponseGenerator``) at once."""
        meta = {"method": self._method, "stream": self._stream, "http": self._http,
                "request_id": uuid.uuid4().hex, "multiplexed_model_id": self._model_id}
        router = _router(self.app_name, self.deployment_name)
        req = _Request(meta, args, kwargs)
        router.submit(req)
        if self._stream:
            return DeploymentResponseGenerator(router, req)
        return DeploymentResponse(router, req)

    def __reduce__(self):
        return (_rebuild_handle, (self.deployment_name, self.app_name, self._method,
                                  self._stream, self._model_id, self._http))

    def __repr__(self) -> str:
        return f"DeploymentHandle(deployment='{self.deployment_name}', app='{self.app_name}')"


def _rebuild_handle(dep, app, method, stream, model_id, http=False):
    return DeploymentHandle(dep, app, method_name=method, stream=stream,
                            multiplexed_model_id=model_id, _http=http)


def _remaining(deadline):
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())


class DeploymentResponse:
    """The future result of one handle call (Ray's ``DeploymentResponse``).

    ``await response`` (async code) or ``response.result(timeout_s=None)`` (sync code)
    give the value; an exception the deployment raised is re-raised (a
    ``RayTaskError`` that is also an instance of the original class).
    """

    def __init__(self, router: _Router, req: _Request):
        self._router = router
        self._current = req

    def __reduce__(self):
        raise TypeError(
            "a DeploymentResponse can be passed only as a top-level argument of another "
            "handle call (where it is resolved); await it or call .result() to send its value"
        )

    def _retry_or_raise(self, req, err):
        self._router.finished(req)
        self._router.replica_died(req.replica_id)
        if req.attempt >= _MAX_ATTEMPTS:
            raise ReplicaDiedError(
                f"request to deployment {self._router.deployment!r} of application "
                f"{self._router.app!r} failed: the replica(s) running it died "
                f"({req.attempt} attempts): {err}"
            ) from err
        nxt = _Request(req.meta, req.args, req.kwargs, req.attempt + 1)
        self._current = nxt
        self._router.submit(nxt)

    def result(self, *, timeout_s: float | None = None, _skip_asyncio_check: bool = False):
        """Blocks until the result is there.

        Raises:
            TimeoutError: not done within ``timeout_s`` seconds.
            RuntimeError: called on a running event loop (use ``await``).
            ReplicaDiedError: every replica it was tried on died.
        """
        if not _skip_asyncio_check and _in_event_loop():
            raise RuntimeError(
                "Sync methods should not be called from within an `asyncio` event loop. "
                "Use `await response` instead."
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            req = self._current
            try:
                req.future.result(timeout=_remaining(deadline))
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for a replica") from None
            try:
                value = tpuray.get(req.ref, timeout=_remaining(deadline))
            except tpuray.exceptions.GetTimeoutError:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for the result") from None
            except BaseException as e:  # noqa: BLE001
                if _common.is_actor_death(e):
                    self._retry_or_raise(req, e)
                    continue
                self._router.finished(req)
                raise
            self._router.finished(req)
            return value

    async def _result_async(self):
        while True:
            req = self._current
            await asyncio.wrap_future(req.future)
            try:
                value = await req.ref
            except BaseException as e:  # noqa: BLE001
                if _common.is_actor_death(e):
                    self._retry_or_raise(req, e)
                    continue
                self._router.finished(req)
                raise
            self._router.finished(req)
            return value

    def __await__(self):
        return self._result_async().__await__()

    def _to_object_ref_sync(self, timeout_s=None):
        """The ObjectRef of the current attempt (once assigned)."""
        self._current.future.result(timeout=timeout_s)
        return self._current.ref

    async def _to_object_ref(self):
        await asyncio.wrap_future(self._current.future)
        return self._current.ref

    def cancel(self) -> None:
        """Cancels the request (Ray's ``DeploymentResponse.cancel``)."""
        req = self._current
        if req.future.done() and req.ref is not None:
            try:
                tpuray.cancel(req.ref)
            except Exception:  # noqa: BLE001 - already finished
                pass
        else:
            req.future.cancel()


class DeploymentResponseGenerator:
    """The items of a streaming call (Ray's ``DeploymentResponseGenerator``): iterate it
    in sync code, ``async for`` in async code."""

    def __init__(self, router: _Router, req: _Request):
        self._router = router
        self._current = req
        self._items = 0
        self._finished = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        while True:
            req = self._current
            try:
                _, gen = req.future.result()
            except BaseException:
                self._finished = True
                raise
            try:
                ref = next(gen)
                value = tpuray.get(ref)
            except StopIteration:
                self._close()
                raise
            except BaseException as e:  # noqa: BLE001
                if _common.is_actor_death(e):
                    if self._items == 0 and req.attempt < _MAX_ATTEMPTS:
                        self._router.finished(req)
                        self._router.replica_died(req.replica_id)
                        nxt = _Request(req.meta, req.args, req.kwargs, req.attempt + 1)
                        self._current = nxt
                        self._router.submit(nxt)
                        continue
                    self._close()
                    self._router.replica_died(req.replica_id)
                    raise ReplicaDiedError(
                        f"stream from deployment {self._router.deployment!r} of application "
                        f"{self._router.app!r} broke after {self._items} item(s): its replica "
                        f"died: {e}"
                    ) from e
                self._close()
                raise
            self._items += 1
            return value

    def __aiter__(self):
        return self

    async def __anext__(self):
        loop = asyncio.get_running_loop()

        def step():
            try:
                return True, self.__next__()
            except StopIteration:
                return False, None

        ok, value = await loop.run_in_executor(None, step)
        if not ok:
            raise StopAsyncIteration
        return value

    def _close(self):
        if not self._finished:
            self._finished = True
            self._router.finished(self._current)

    def __del__(self):
        try:
            self._close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def cancel(self) -> None:
        self._close()
