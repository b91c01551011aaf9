"""``@serve.multiplexed`` and ``serve.get_multiplexed_model_id`` (Ray Serve's model
multiplexing, https://docs.ray.io/en/latest/serve/model-multiplexing.html).

A replica keeps up to ``max_num_models_per_replica`` models that an ``async`` loader
returned, by model id; asking for one more unloads the least recently used (calling its
``__del__`` when it has one, as Ray does). A request names its model with the handle
option ``multiplexed_model_id`` or the HTTP header ``serve_multiplexed_model_id``; the
replica tells the controller which models it holds, and routers send a request to a
replica that holds its model when one has room (else to any, by power of two choices).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect


def get_multiplexed_model_id() -> str:
    """The model id of the request being served (``""`` when it names none).

    Raises:
        RayServeException: called outside a replica.
    """
    from tpuray.serve import _replica
    from tpuray.serve.exceptions import RayServeException

    if _replica.current_context() is None:
        raise RayServeException(
            "`serve.get_multiplexed_model_id()` may only be called from within a Ray Serve deployment."
        )
    return _replica.current_request().get("multiplexed_model_id", "") or ""


class _Cache:
    """One replica's models for one loader (held on the loader's instance)."""

    def __init__(self, loader, limit: int):
        self.loader = loader
        self.limit = limit
        self.models: collections.OrderedDict = collections.OrderedDict()
        self.loading: dict = {}
        self.lock = asyncio.Lock()

    async def get(self, args, model_id: str):
        if model_id in self.models:
            self.models.move_to_end(model_id)
            return self.models[model_id]
        fut = self.loading.get(model_id)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = self.loading[model_id] = asyncio.get_running_loop().create_future()
        try:
            async with self.lock:
                while self.limit != -1 and len(self.models) >= self.limit:
                    _, old = self.models.popitem(last=False)
                    d = getattr(old, "__del__", None)
                    if d is not None:
                        r = d()
                        if inspect.isawaitable(r):
                            await r
                    del old
                model = await self.loader(*args, model_id)
                self.models[model_id] = model
            fut.set_result(model)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            self.loading.pop(model_id, None)
        _report(list(self.models))
        return model


def _report(model_ids: list) -> None:
    from tpuray.serve import _replica

    _replica.report_models(model_ids)


def multiplexed(func=None, max_num_models_per_replica: int = 3):
    """Marks an ``async`` model loader ``(self, model_id: str)`` (or a function
    ``(model_id)``) as multiplexed (Ray's ``@serve.multiplexed``).

    Args:
        max_num_models_per_replica: models kept per replica (-1: no limit).

    Raises:
        TypeError: not an async function of one ``model_id`` argument (after ``self``),
            or a limit that is not an int.
        ValueError: a limit that is not positive or -1.
    """
    if func is not None:
        if not callable(func):
            raise TypeError("The `multiplexed` decorator must be used with a function or method.")
        if not inspect.iscoroutinefunction(func):
            raise TypeError("@serve.multiplexed can only be used to decorate async functions or methods.")
        n = len(inspect.signature(func).parameters)
        if n == 0 or n > 2:
            raise TypeError(
                "@serve.multiplexed can only be used to decorate functions or methods "
                "with at least one 'model_id: str' argument."
            )
    if isinstance(max_num_models_per_replica, bool) or not isinstance(max_num_models_per_replica, int):
        raise TypeError("max_num_models_per_replica must be an integer.")
    if max_num_models_per_replica != -1 and max_num_models_per_replica <= 0:
        raise ValueError("max_num_models_per_replica must be positive.")

    def decorate(f):
        if not inspect.iscoroutinefunction(f):
            raise TypeError("@serve.multiplexed can only be used to decorate async functions or methods.")
        method = len(inspect.signature(f).parameters) == 2
        attr = f"__serve_multiplex_{f.__name__}"
        module_cache: dict = {}

        @functools.wraps(f)
        async def wrapper(*args):
            if len(args) != (2 if method else 1):
                raise TypeError(f"{f.__name__}() takes the model id as its one argument (got {len(args)} arguments)")
            model_id = args[-1]
            if not isinstance(model_id, str) or not model_id:
                raise TypeError(f"the model id must be a non-empty string (got {model_id!r})")
            if method:
                owner = args[0]
                cache = owner.__dict__.get(attr)
                if cache is None:
                    cache = _Cache(f, max_num_models_per_replica)
                    setattr(owner, attr, cache)
            else:
                cache = module_cache.get("c")
                if cache is None:
                    cache = module_cache["c"] = _Cache(f, max_num_models_per_replica)
            return await cache.get(args[:-1], model_id)

        return wrapper

    return decorate(func) if func is not None else decorate
