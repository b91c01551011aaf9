"""``@serve.ingress(app)``: a deployment class whose HTTP requests go to an ASGI app
(FastAPI, Starlette, or any ASGI callable), as Ray Serve's ``serve.ingress``
(https://docs.ray.io/en/latest/serve/http-guide.html#fastapi-http-deployments).

The decorated class becomes a subclass that keeps every method of the user's class
(handles still call them) and carries the app; each replica passes its HTTP requests to
the app as ASGI (``tpuray.serve.http.serve_http``). For a FastAPI app, routes declared
on the class's own methods (``@app.get("/x") def f(self, ...)``) become class-based
views: their ``self`` parameter is filled, through a FastAPI dependency, with the
replica's instance of the class (so ``self`` is not taken for a query parameter), as
Ray does. The app's lifespan (startup/shutdown events) runs in each replica.
"""

from __future__ import annotations

import copyreg
import inspect
from typing import Any, Callable


def _register_reducers() -> None:
    """Starlette's ``State`` (``app.state``) answers every attribute through
    ``__getattr__`` on its ``_state`` dict, so unpickling one by default recurses
    forever (pickle looks up ``__setstate__`` before ``_state`` exists). Pickled as
    ``State(dict)`` instead, so an app travels to its replicas."""
    try:
        from starlette.datastructures import State
    except ImportError:
        return
    copyreg.pickle(State, lambda st: (State, (dict(st._state),)))


_register_reducers()


def _walk_routes(router):
    for r in getattr(router, "routes", []):
        yield r


def _class_based_view(app, cls, holder: dict) -> None:
    """Rewrites the FastAPI routes whose endpoint is a function of ``cls`` so that their
    first parameter is the replica's instance (``holder["obj"]``)."""
    from fastapi import Depends
    from fastapi.routing import APIRoute, APIWebSocketRoute

    own: dict[int, Any] = {}
    for klass in cls.__mro__:
        for v in vars(klass).values():
            if inspect.isfunction(v):
                own.setdefault(id(v), v)

    def current_instance():
        obj = holder.get("obj")
        if obj is None:
            raise RuntimeError(f"the {cls.__name__} instance of this replica is not constructed yet")
        return obj

    params = [p for p in inspect.signature(APIRoute.__init__).parameters if p not in ("self",)]
    new_routes = []
    for route in list(app.router.routes):
        if not isinstance(route, (APIRoute, APIWebSocketRoute)) or id(route.endpoint) not in own:
            new_routes.append(route)
            continue
        fn = route.endpoint
        sig = inspect.signature(fn)
        ps = list(sig.parameters.values())
        if not ps:
            new_routes.append(route)
            continue
        first = ps[0].replace(default=Depends(current_instance))
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                else p for p in ps[1:]]
        # A copy of the function with the new signature (the class keeps the original,
        # so handle calls of the method pass arguments as they always did).
        import functools

        endpoint: Callable[..., Any]
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_endpoint(*a, __fn=fn, **k):
                return await __fn(*a, **k)

            endpoint = async_endpoint
        else:
            @functools.wraps(fn)
            def sync_endpoint(*a, __fn=fn, **k):
                return __fn(*a, **k)

            endpoint = sync_endpoint
        # inspect.signature (and so FastAPI) reads a function's __signature__ first.
        setattr(endpoint, "__signature__", sig.replace(parameters=[first] + rest))
        if isinstance(route, APIWebSocketRoute):
            new_routes.append(APIWebSocketRoute(route.path, endpoint, name=route.name,
                                                dependencies=route.dependencies))
            continue
        kwargs: dict[str, Any] = {}
        for p in params:
            if p == "endpoint":
                kwargs[p] = endpoint
            elif p == "dependency_overrides_provider":
                kwargs[p] = getattr(route, "dependency_overrides_provider", None)
            elif hasattr(route, p):
                kwargs[p] = getattr(route, p)
        kwargs["path"] = route.path
        new_routes.append(APIRoute(**kwargs))
    app.router.routes[:] = new_routes
    # FastAPI caches the OpenAPI schema; routes changed.
    if hasattr(app, "openapi_schema"):
        app.openapi_schema = None


def ingress(app):
    """Makes a deployment class serve HTTP through ``app`` (Ray's ``serve.ingress``).

    Args:
        app: a FastAPI or Starlette app, or any ASGI 3 callable
            ``async (scope, receive, send)``; or a zero-argument function returning one
            (called in each replica, as Ray's builder form).

    Returns:
        A class decorator (apply it under ``@serve.deployment``).

    Raises:
        TypeError: ``app`` is not callable, or the decorated object is not a class.
        ValueError: the class defines ``__call__`` (as Ray refuses it).
    """
    if not callable(app):
        raise TypeError(f"serve.ingress expects an ASGI app (FastAPI, Starlette) (got {type(app).__name__})")

    def decorator(cls):
        if not inspect.isclass(cls):
            raise TypeError(
                f"@serve.ingress must decorate a class (got {type(cls).__name__}); "
                "for a function, deploy the app itself"
            )
        from tpuray.serve.deployment import Deployment

        if "__call__" in {k for klass in cls.__mro__[:-1] for k in vars(klass)}:
            # As Ray: the app answers HTTP; a __call__ would be ambiguous.
            raise ValueError("Classes passed to @serve.ingress may not have __call__ method.")
        if isinstance(cls, Deployment):
            raise TypeError("@serve.ingress must be applied under @serve.deployment, not above it")
        holder: dict = {}
        asgi = app
        is_builder = inspect.isfunction(app) and not inspect.signature(app).parameters
        try:
            from fastapi import FastAPI

            if isinstance(app, FastAPI):
                _class_based_view(app, cls, holder)
        except ImportError:
            pass

        class ASGIIngressWrapper(cls):
            _serve_asgi_app = None
            _serve_asgi_holder = holder

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                holder["obj"] = self
                type(self)._serve_asgi_app = asgi() if is_builder else asgi

        ASGIIngressWrapper._serve_asgi_app = asgi if not is_builder else (lambda *a: None)
        ASGIIngressWrapper.__name__ = cls.__name__
        ASGIIngressWrapper.__qualname__ = cls.__qualname__
        ASGIIngressWrapper.__module__ = cls.__module__
        ASGIIngressWrapper.__doc__ = cls.__doc__
        return ASGIIngressWrapper

    return decorator


class Lifespan:
    """The ASGI lifespan protocol (https://asgi.readthedocs.io/en/latest/specs/lifespan.html)
    for one app in one replica: ``await startup()`` when the replica starts, ``await
    shutdown()`` when it stops. An app that does not speak it (raises on the
    ``lifespan`` scope before answering) is served without it, as uvicorn's
    ``lifespan="auto"`` does."""

    def __init__(self, app):
        self._app = app
        self._to_app = None
        self._from_app = None
        self._task = None
        self._supported = True

    async def _receive(self):
        return await self._to_app.get()

    async def _send(self, msg):
        await self._from_app.put(msg)

    async def _main(self):
        try:
            await self._app({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                             "state": {}}, self._receive, self._send)
        except BaseException as e:  # noqa: BLE001 - no lifespan support, or it failed
            await self._from_app.put({"type": "_error", "error": e})

    async def startup(self) -> None:
        """Raises:
            RuntimeError: the app's startup failed (its message)."""
        import asyncio

        self._to_app, self._from_app = asyncio.Queue(), asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._main())
        await self._to_app.put({"type": "lifespan.startup"})
        msg = await self._from_app.get()
        if msg["type"] == "_error":
            self._supported = False  # the app raised on the lifespan scope: none
            return
        if msg["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the ASGI app's startup failed: {msg.get('message', '')}")

    async def shutdown(self) -> None:
        if not self._supported or self._task is None:
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._from_app.get()
