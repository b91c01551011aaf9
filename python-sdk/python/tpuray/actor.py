"""``@tpuray.remote`` classes (Ray's ``ActorClass`` and ``ActorHandle``)."""

from __future__ import annotations

import inspect
import re

from tpuray import _tpuray
from tpuray._private import options as _options
from tpuray._private import worker
from tpuray._private.serialization import ObjectRef, ObjectRefGenerator
from tpuray.exceptions import ActorAlreadyExistsError


def method(*args, **kwargs):
    """Annotates an actor method with options (Ray's ``@ray.method(num_returns=2)``)."""

    def decorate(m):
        if "num_returns" in kwargs:
            m.__tpuray_num_returns__ = kwargs["num_returns"]
        return m

    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    for key in kwargs:
        if key not in _METHOD_KEYS:
            # Ray 2.60 asserts the same (ray/actor.py, ``method``).
            raise AssertionError(
                f"Unexpected keyword argument to @ray.method: '{key}'. The supported "
                f"keyword arguments are {_METHOD_KEYS}"
            )
    _options.warn_unhonoured(kwargs, "@method", _options.UNHONOURED_METHOD)
    return decorate


# Ray 2.60's ``@ray.method`` keywords; tpuray honours ``num_returns`` and names the others
# in a warning (``_options.warn_unhonoured``).
_METHOD_KEYS = [
    "num_returns", "concurrency_group", "max_task_retries", "retry_exceptions",
    "_generator_backpressure_num_objects", "_num_objects_per_yield", "enable_task_events",
    "tensor_transport",
]


def _is_async_class(cls) -> bool:
    return any(
        inspect.iscoroutinefunction(m) or inspect.isasyncgenfunction(m)
        for _, m in inspect.getmembers(cls, predicate=inspect.isfunction)
    )


class ActorClass:
    """A class whose instances live in their own worker process: ``C.remote(...)``
    creates one and returns an :class:`ActorHandle`."""

    def __init__(self, cls, options: dict):
        _options.check(options, actor=True)
        self._cls = cls
        self._options = dict(options)
        self._key = None
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__doc__ = cls.__doc__
        self.__module__ = cls.__module__

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"Actors cannot be instantiated directly. Instead of '{self.__name__}()', use "
            f"'{self.__name__}.remote()'."
        )

    def options(self, **options) -> "ActorClass":
        _options.check(options, actor=True)
        a = ActorClass.__new__(ActorClass)
        a.__dict__.update(self.__dict__)
        a._options = {**self._options, **options}
        return a

    def remote(self, *args, **kwargs) -> "ActorHandle":
        worker.auto_init()
        if self._key is None:
            self._key = worker.export(self._cls)
        opts = _options.actor_core_options(self._options, _is_async_class(self._cls))
        if opts["get_if_exists"] and not opts["name"]:
            raise ValueError("The actor name must be specified to use `get_if_exists`.")
        try:
            actor_id, _ = _tpuray.create_actor(
                self._key, self._cls.__name__, worker.encode_args(args, kwargs), opts
            )
        except RuntimeError as e:
            taken = re.search(r'actor named ".*" already exists in namespace "(.*)"', str(e))
            if not (opts["name"] and taken):
                raise
            # Ray 2.60's error and text (ray/actor.py, ActorClass._remote), which names
            # the namespace option as given (None when not given).
            name, namespace = opts["name"], self._options.get("namespace")
            raise ActorAlreadyExistsError(
                f"The name {name} (namespace={namespace}) is already taken. Please use a "
                f"different name or get the existing actor using "
                f"ray.get_actor('{name}', namespace='{namespace}')"
            ) from None
        retries = int(self._options.get("max_task_retries", 0) or 0)
        methods = [n for n, _ in inspect.getmembers(self._cls, predicate=inspect.isfunction)]
        return ActorHandle(
            actor_id, self._cls.__name__, _method_returns(self._cls), retries, methods
        )

    def bind(self, *args, **kwargs):
        """A lazy actor creation (Ray's DAG API): a ``tpuray.dag.ClassNode`` whose
        methods' ``.bind`` record calls on it."""
        from tpuray.dag import ClassNode

        return ClassNode(self, args, kwargs, {})


def _method_returns(cls) -> dict:
    out = {}
    for name, m in inspect.getmembers(cls, predicate=inspect.isfunction):
        n = getattr(m, "__tpuray_num_returns__", None)
        if n is not None:
            out[name] = n
    return out


class ActorMethod:
    def __init__(self, handle: "ActorHandle", name: str, num_returns: int = 1):
        self._handle = handle
        self._name = name
        self._num_returns = num_returns

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"Actor methods cannot be called directly. Instead of running "
            f"'object.{self._name}()', try 'object.{self._name}.remote()'."
        )

    def options(self, **options) -> "ActorMethod":
        return ActorMethod(self._handle, self._name, options.get("num_returns", self._num_returns))

    def bind(self, *args, **kwargs):
        """A lazy call of this method on this actor (Ray's DAG API): a
        ``tpuray.dag.ClassMethodNode``."""
        from tpuray.dag.dag_node import _UnboundClassMethodNode

        default = self._handle._method_returns.get(self._name, 1)
        options = {} if self._num_returns == default else {"num_returns": self._num_returns}
        return _UnboundClassMethodNode(self._handle, self._name, options).bind(*args, **kwargs)

    def remote(self, *args, **kwargs):
        h = self._handle
        if self._num_returns == "streaming":
            task_id = _tpuray.call_actor_streaming(
                h._actor_id, h._class_name, self._name, worker.encode_args(args, kwargs)
            )
            return ObjectRefGenerator(task_id, f"{h._class_name}.{self._name}")
        refs = _tpuray.call_actor(
            h._actor_id,
            h._class_name,
            self._name,
            worker.encode_args(args, kwargs),
            self._num_returns,
            h._max_task_retries,
        )
        refs = [ObjectRef(r) for r in refs]
        if self._num_returns == 1:
            return refs[0]
        return refs if self._num_returns != 0 else None


#: Methods every actor has (Ray's names -> what the worker runtime answers to).
_BUILTIN_METHODS = {
    "__ray_terminate__": "__tpuray_terminate__",
    "__ray_ready__": "__tpuray_ready__",
}


def exit_actor() -> None:
    """Ends the current actor from inside one of its methods (Ray's
    ``ray.actor.exit_actor``).

    The calling method does not return: its caller gets ``RayActorError``, as do the
    calls queued behind it; ``atexit`` handlers run; the actor is not restarted,
    whatever its ``max_restarts``, and its name is free again.

    Raises:
        TypeError: called outside an actor (a driver or a task).
    """
    rt = worker.runtime
    if worker.state.mode != "worker" or rt is None or rt.actor is None:
        raise TypeError(
            "exit_actor API is called on a non-actor worker. Call this API inside an "
            "actor methods if you'd like to exit the actor gracefully."
        )
    from tpuray import exceptions

    if rt.loop is not None and rt._wake_read >= 0:
        # An async actor: a SystemExit would end the event loop's thread instead.
        raise exceptions.AsyncioActorExit()
    raise worker.ActorExit("exit_actor() is called.")


class ActorHandle:
    """A handle to an actor: ``handle.method.remote(...)``. Picklable, so it can be
    passed to tasks and other actors; calls from one caller run in order."""

    def __init__(
        self,
        actor_id: str,
        class_name: str,
        method_returns: dict | None = None,
        max_task_retries: int = 0,
        methods: list | None = None,
    ):
        self._actor_id = actor_id
        self._class_name = class_name
        self._method_returns = method_returns or {}
        self._max_task_retries = max_task_retries
        # None when unknown (a handle from get_actor): any name is sent.
        self._methods = set(methods) if methods is not None else None

    def __getattr__(self, name: str) -> ActorMethod:
        if name in _BUILTIN_METHODS:
            return ActorMethod(self, _BUILTIN_METHODS[name])
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        methods = self.__dict__.get("_methods")
        if methods is not None and name not in methods:
            raise AttributeError(f"'{self._class_name}' object has no attribute '{name}'")
        method = ActorMethod(self, name, self._method_returns.get(name, 1))
        # Kept: the next ``handle.name`` finds it without coming here.
        self.__dict__[name] = method
        return method

    def __reduce__(self):
        return (
            ActorHandle,
            (
                self._actor_id,
                self._class_name,
                self._method_returns,
                self._max_task_retries,
                sorted(self._methods) if self._methods is not None else None,
            ),
        )

    def __repr__(self) -> str:
        return f"Actor({self._class_name}, {self._actor_id})"

    def __hash__(self) -> int:
        return hash(self._actor_id)

    def __eq__(self, other) -> bool:
        return isinstance(other, ActorHandle) and other._actor_id == self._actor_id

    @property
    def _ray_actor_id(self):
        return self._actor_id
