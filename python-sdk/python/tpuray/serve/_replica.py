"""A replica: the actor that holds one instance of a deployment's class (or its
function) and runs requests on it.

The replica is an async actor (one asyncio loop, tpuray's executor threads block on
coroutines running there). ``async def`` user methods run on that loop; plain methods
run in a thread pool of ``max_ongoing_requests`` threads so they never block the loop
(Ray Serve runs them on the loop unless told otherwise: a deviation that keeps health
checks and batching responsive). Streaming calls run ``handle_request_streaming``, a
plain generator (tpuray streams plain generators), which pumps an ``async def``
generator on the loop item by item.

``check_health`` checks this replica only: the loop answers, then the user's own
``check_health`` if the class has one. It never calls other deployments, so a dead
downstream replica cannot make a healthy upstream one look unhealthy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpuray._private.serialization import deserialize
from tpuray.serve import http as _http

if TYPE_CHECKING:
    from tpuray.serve._ingress import Lifespan


@dataclass(frozen=True)
class ReplicaID:
    """Ray's ``ReplicaID``: the replica's ``unique_id`` and its deployment."""

    unique_id: str
    deployment_name: str
    app_name: str

    def to_full_id_str(self) -> str:
        return f"{self.app_name}#{self.deployment_name}#{self.unique_id}"


@dataclass
class ReplicaContext:
    """What ``serve.get_replica_context()`` returns inside a replica (Ray's
    ``ReplicaContext``)."""

    replica_id: ReplicaID
    servable_object: object = None

    @property
    def app_name(self) -> str:
        return self.replica_id.app_name

    @property
    def deployment(self) -> str:
        return self.replica_id.deployment_name

    @property
    def replica_tag(self) -> str:
        return self.replica_id.unique_id


_context: ReplicaContext | None = None
#: The request being served: ``{"request_id", "multiplexed_model_id"}`` (a context
#: variable, so each async request and each thread-pool call sees its own).
_request_context: contextvars.ContextVar = contextvars.ContextVar("serve_request", default=None)


def current_request() -> dict:
    """The serving request's metadata here, ``{}`` outside a request."""
    return _request_context.get() or {}


def current_context() -> ReplicaContext | None:
    return _context


def _in_placement_group(pg_id) -> None:
    """Marks this thread as running in the replica's placement group (the replica
    actor runs in its bundle 0), so ``get_current_placement_group()`` in user code
    run on the replica's event loop or thread pool returns it, as in Ray."""
    if pg_id:
        from tpuray._private import worker

        worker._task_context.placement_group_id = pg_id


def report_models(model_ids: list) -> None:
    """Tells the controller which multiplexed models this replica holds now (routers
    prefer a replica holding a request's model)."""
    ctx = _context
    if ctx is None:
        return
    from tpuray.serve import _common

    try:
        _common.get_controller().record_multiplexed_models.remote(
            ctx.app_name, ctx.deployment, ctx.replica_tag, list(model_ids))
    except Exception:  # noqa: BLE001 - routing then just does not prefer this replica
        pass


class ServeReplica:
    """One replica. Created by the controller; ``initialize`` constructs the user's
    class (the controller counts the replica RUNNING once it returns)."""

    def __init__(self, app: str, deployment: str, replica_id: str, target: bytes,
                 init_args: bytes, config: dict):
        self._app = app
        self._deployment = deployment
        self._replica_id = replica_id
        self._target_bytes = target
        self._init_bytes = init_args
        self._config = config
        self._callable: Any = None
        self._lifespan: Lifespan | None = None
        self._is_function = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ongoing = 0
        self._lock = threading.Lock()
        pg_id = config.get("placement_group_id")
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2, int(config["max_ongoing_requests"])), thread_name_prefix="serve-replica",
            initializer=_in_placement_group, initargs=(pg_id,),
        )

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The replica's event loop, which ``initialize`` sets.

        Raises:
            RuntimeError: a call reached the replica before ``initialize``.
        """
        if self._loop is None:
            raise RuntimeError(
                f"replica {self._replica_id} of deployment {self._deployment!r} is not initialized"
            )
        return self._loop

    # ---- lifecycle ----

    async def initialize(self) -> dict:
        """Constructs the user's class in the thread pool (a slow constructor does not
        block the loop) and calls ``reconfigure(user_config)`` when set.

        Returns:
            ``{"node_id", "pid", "actor_id"}`` of this replica.
        """
        global _context
        loop = self._loop = asyncio.get_running_loop()
        _in_placement_group(self._config.get("placement_group_id"))
        target = deserialize(self._target_bytes)
        args, kwargs = deserialize(self._init_bytes)
        _context = ReplicaContext(ReplicaID(self._replica_id, self._deployment, self._app))
        if inspect.isclass(target):
            obj: Any = await loop.run_in_executor(self._pool, functools.partial(target, *args, **kwargs))
        else:
            obj = target
            self._is_function = True
        self._callable = obj
        _context.servable_object = obj
        if _http.is_asgi_ingress(obj):
            from tpuray.serve._ingress import Lifespan

            lifespan = self._lifespan = Lifespan(type(obj)._serve_asgi_app)
            await lifespan.startup()
        uc = self._config.get("user_config")
        if uc is not None:
            await self._reconfigure(uc)
        import tpuray

        ctx = tpuray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "actor_id": ctx.get_actor_id()}

    async def _reconfigure(self, user_config) -> None:
        rc = getattr(self._callable, "reconfigure", None) if not self._is_function else None
        if rc is None:
            raise ValueError(
                f"deployment {self._deployment!r} has a user_config but its class defines no "
                "reconfigure(config) method"
            )
        if inspect.iscoroutinefunction(rc):
            await rc(user_config)
        else:
            r = await self._running_loop().run_in_executor(self._pool, rc, user_config)
            if inspect.isawaitable(r):
                await r

    async def reconfigure(self, user_config) -> bool:
        """Applies a new ``user_config`` in place (Ray's in-place update: the replica
        keeps running, its ``reconfigure(config)`` is called with the new value).

        Raises:
            ValueError: the class has no ``reconfigure`` method.
        """
        await self._reconfigure(user_config)
        self._config = dict(self._config, user_config=user_config)
        return True

    def check_health(self) -> dict:
        """This replica's health: the event loop answers within the controller's timeout
        and the user's ``check_health`` (if any) does not raise.

        Returns:
            ``{"ongoing": requests running here now}``.
        """
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result(
                timeout=float(self._config["health_check_timeout_s"])
            )
        user = getattr(self._callable, "check_health", None) if not self._is_function else None
        if user is not None:
            r = user()
            if inspect.isawaitable(r):
                asyncio.run_coroutine_threadsafe(_await(r), self._running_loop()).result(
                    timeout=float(self._config["health_check_timeout_s"])
                )
        return {"ongoing": self._ongoing}

    def prepare_for_shutdown(self) -> bool:
        """Waits (``graceful_shutdown_wait_loop_s`` at a time) until no request is
        running here, at most ``graceful_shutdown_timeout_s``, then runs the user's
        ``__del__`` if it has one. The controller kills the actor afterwards."""
        deadline = time.monotonic() + float(self._config["graceful_shutdown_timeout_s"])
        # Handles may still send a request or two before they learn this replica stops.
        time.sleep(min(0.2, float(self._config["graceful_shutdown_timeout_s"])))
        loop_s = float(self._config.get("graceful_shutdown_wait_loop_s", 2.0))
        while self._ongoing > 0 and time.monotonic() < deadline:
            # Ray's graceful_shutdown_wait_loop_s: how often to look again.
            time.sleep(max(0.01, min(loop_s, deadline - time.monotonic())))
        if self._lifespan is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._lifespan.shutdown(), self._loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        d = getattr(type(self._callable), "__del__", None) if not self._is_function else None
        if d is not None:
            try:
                r = d(self._callable)
                if inspect.isawaitable(r) and self._loop is not None:
                    asyncio.run_coroutine_threadsafe(_await(r), self._loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        return True

    # ---- requests ----

    def _method(self, name: str):
        if self._callable is None:
            raise RuntimeError(f"replica {self._replica_id} of {self._deployment!r} is not initialized")
        if self._is_function:
            if name != "__call__":
                raise AttributeError(
                    f"deployment {self._deployment!r} is a function: it has no method {name!r} (call the handle itself)"
                )
            return self._callable
        m = getattr(self._callable, name, None)
        if m is None or not callable(m):
            raise AttributeError(f"deployment {self._deployment!r} has no method {name!r}")
        return m

    def _enter(self, meta):
        with self._lock:
            self._ongoing += 1
        _request_context.set({"request_id": meta.get("request_id"),
                              "multiplexed_model_id": meta.get("multiplexed_model_id", "")})

    def _leave(self):
        with self._lock:
            self._ongoing -= 1

    async def handle_request(self, meta: dict, *args, **kwargs):
        """Runs one call of ``meta["method"]`` and returns its result."""
        self._enter(meta)
        try:
            fn = self._method(meta["method"])
            if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
                raise TypeError(
                    f"method {meta['method']!r} of deployment {self._deployment!r} is a generator: "
                    "call it through handle.options(stream=True)"
                )
            if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
                result = await fn(*args, **kwargs)
            else:
                result = await self._running_loop().run_in_executor(
                    self._pool, contextvars.copy_context().run, functools.partial(fn, *args, **kwargs))
                if inspect.isawaitable(result):
                    result = await result
            return result
        finally:
            self._leave()

    def handle_request_streaming(self, meta: dict, *args, **kwargs):
        """Runs one streaming call: yields the items of the method's generator (plain or
        async). With ``meta["http"]`` (the proxy's calls) it yields ``("value", v)`` for
        a method that returns a value and ``("chunk", item)`` per item of a generator.

        Raises:
            TypeError: a non-HTTP streaming call of a method that is not a generator.
        """
        self._enter(meta)
        http = bool(meta.get("http"))
        try:
            if http and args and isinstance(args[0], _http.HTTPRequest):
                fn = None if _http.is_asgi_ingress(self._callable) else self._method(meta["method"])
                yield from _http.serve_http(self._callable, fn, args[0], self._running_loop(), self._pool)
                return
            fn = self._method(meta["method"])
            result = fn(*args, **kwargs)
            if inspect.iscoroutine(result):
                result = asyncio.run_coroutine_threadsafe(result, self._running_loop()).result()
            if inspect.isasyncgen(result):
                agen = result
                while True:
                    try:
                        item = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._running_loop()).result()
                    except StopAsyncIteration:
                        break
                    yield ("chunk", item) if http else item
            elif inspect.isgenerator(result):
                for item in result:
                    yield ("chunk", item) if http else item
            elif http:
                yield ("value", result)
            else:
                raise TypeError(
                    f"method {meta['method']!r} of deployment {self._deployment!r} returned a "
                    f"{type(result).__name__}, not a generator: call it without stream=True"
                )
        finally:
            self._leave()


async def _await(x):
    return await x
