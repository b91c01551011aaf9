"""``@tpuray.remote`` classes (Ray's ``ActorClass`` and ``ActorHandle``).

``exit_actor()``: the runtime catches the exit (a ``SystemExit``, or
``AsyncioActorExit`` in an async actor), runs ``atexit`` handlers, flushes output, then
kills its own actor with ``no_restart`` through the head, which records it dead
(intended, ACTOR-1: no restart) before its agent stops the process; the exiting call is
never answered, so it and the calls queued behind it fail with ``RayActorError``.
``handle.__ray_terminate__`` is the same exit, queued behind the caller's earlier calls.
"""

from __future__ import annotations

import inspect
import re

from tpuray import _tpuray
from tpuray._private import options as _options
from tpuray._private import worker
from tpuray._private.serialization import ObjectRef, ObjectRefGenerator
from tpuray.exceptions import ActorAlreadyExistsError


def method(*args, **kwargs):
    """Annotates an actor method with options (Ray's ``@ray.method``): ``num_returns``,
    ``concurrency_group`` (the group its calls run in), ``max_task_retries`` and
    ``retry_exceptions`` (retries of its calls, over the actor's); Ray's other keywords
    are refused by name unless given their defaults.

    Raises:
        AssertionError: an unknown keyword (Ray 2.60 asserts the same).
        ValueError: a bad ``num_returns``, or an option tpuray does not support.
    """

    def decorate(m):
        is_gen = inspect.isgeneratorfunction(m) or inspect.isasyncgenfunction(m)
        if "num_returns" in kwargs:
            _options.check_num_returns(kwargs["num_returns"], is_gen)
            m.__tpuray_num_returns__ = kwargs["num_returns"]
        if kwargs.get("concurrency_group") is not None:
            m.__tpuray_concurrency_group__ = kwargs["concurrency_group"]
        if kwargs.get("max_task_retries") is not None:
            m.__tpuray_max_task_retries__ = kwargs["max_task_retries"]
        if kwargs.get("retry_exceptions") is not None:
            _options.retry_filter(kwargs)  # checks a list's entries
            m.__tpuray_retry_exceptions__ = kwargs["retry_exceptions"]
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
    _options.refuse_unsupported(kwargs, "@method")
    return decorate


# Ray 2.60's ``@ray.method`` keywords (ray/actor.py, ``method``'s ``valid_kwargs``).
_METHOD_KEYS = [
    "num_returns", "concurrency_group", "max_task_retries", "retry_exceptions",
    "_generator_backpressure_num_objects", "_num_objects_per_yield", "enable_task_events",
    "tensor_transport",
]
# What ``.options(...)`` on a method call takes (Ray 2.60's ``ActorMethod._remote``).
_CALL_KEYS = {
    "name", "num_returns", "max_task_retries", "retry_exceptions", "concurrency_group",
    "_generator_backpressure_num_objects", "enable_task_events", "tensor_transport", "_labels",
}


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
        self._key: str | None = None
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
        _options.check(options, actor=True, in_options=True)
        a = ActorClass.__new__(ActorClass)
        a.__dict__.update(self.__dict__)
        a._options = {**self._options, **options}
        return a

    def remote(self, *args, **kwargs) -> "ActorHandle":
        worker.auto_init()
        if self._key is None:
            self._key = worker.export(self._cls)
        meta = _method_meta(self._cls)
        groups = {n: m["concurrency_group"] for n, m in meta.items() if m.get("concurrency_group")}
        defined = _options.concurrency_groups(self._options)
        for name, group in groups.items():
            if group not in defined:
                # Ray 2.60 asserts the same at .remote() (ray/actor.py, _remote).
                raise AssertionError(
                    f"method {self._cls.__name__}.{name} runs in concurrency group "
                    f"{group!r}, which the actor does not define (concurrency_groups="
                    f"{defined!r})"
                )
        opts = _options.actor_core_options(self._options, _is_async_class(self._cls), groups)
        if worker.state.mode == "worker":
            opts = _options.captured(opts, self._options)
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
        handle = ActorHandle(
            actor_id, self._cls.__name__, _method_returns(self._cls), retries, methods,
            meta, opts["max_pending_calls"],
        )
        if opts["name"]:
            # get_actor() rebuilds the same handle (generator methods stream, method
            # options hold) from this record.
            from tpuray._private.serialization import serialize

            _tpuray.kv_put(_HANDLE_NAMESPACE, actor_id.encode(), serialize(handle)[0], True)
        return handle

    def bind(self, *args, **kwargs):
        """A lazy actor creation (Ray's DAG API): a ``tpuray.dag.ClassNode`` whose
        methods' ``.bind`` record calls on it."""
        from tpuray.dag import ClassNode

        return ClassNode(self, args, kwargs, {})


#: KV namespace of named actors' pickled handles, by actor id (read by ``get_actor``).
_HANDLE_NAMESPACE = "actor_handle"


def _method_returns(cls) -> dict:
    """Each method's ``num_returns`` when not 1: its ``@method`` value, else
    "streaming" for a generator (Ray 2.60 streams generator methods by default)."""
    out = {}
    for name, m in inspect.getmembers(cls, predicate=inspect.isfunction):
        n = getattr(m, "__tpuray_num_returns__", None)
        if n is None and (inspect.isgeneratorfunction(m) or inspect.isasyncgenfunction(m)):
            n = "streaming"
        if n is not None:
            out[name] = n
    return out


def _method_meta(cls) -> dict:
    """Each method's ``@method`` options other than ``num_returns``:
    ``{name: {"concurrency_group", "max_task_retries", "retry_exceptions"}}``."""
    out = {}
    for name, m in inspect.getmembers(cls, predicate=inspect.isfunction):
        meta = {
            "concurrency_group": getattr(m, "__tpuray_concurrency_group__", None),
            "max_task_retries": getattr(m, "__tpuray_max_task_retries__", None),
            "retry_exceptions": getattr(m, "__tpuray_retry_exceptions__", None),
            "is_generator": inspect.isgeneratorfunction(m) or inspect.isasyncgenfunction(m),
        }
        # An explicit max_task_retries=0 or retry_exceptions=False still overrides the
        # actor's: kept whenever set.
        keys = ("concurrency_group", "max_task_retries", "retry_exceptions")
        if meta["is_generator"] or any(meta[k] is not None for k in keys):
            out[name] = meta
    return out


class ActorMethod:
    def __init__(self, handle: "ActorHandle", name: str, num_returns: int = 1, call=None):
        self._handle = handle
        self._name = name
        self._num_returns = num_returns
        # Per-call options (``.options(...)``) over the method's ``@method`` ones.
        self._call = call or {}

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"Actor methods cannot be called directly. Instead of running "
            f"'object.{self._name}()', try 'object.{self._name}.remote()'."
        )

    def options(self, **options) -> "ActorMethod":
        """This method called with per-call options (Ray's ``ActorMethod.options``):
        ``num_returns``, ``concurrency_group``, ``max_task_retries``,
        ``retry_exceptions``, ``name``; Ray's others are refused unless their defaults.

        Raises:
            ValueError: an unknown or unsupported option, or a bad ``num_returns``.
        """
        if "_num_objects_per_yield" in options:
            # Ray 2.60's refusal (ray/actor.py, ActorMethod.options).
            raise ValueError(
                "_num_objects_per_yield cannot be overridden per actor method call. Use "
                "@ray.method(_num_objects_per_yield=...) instead."
            )
        for k in options:
            if k not in _CALL_KEYS:
                raise ValueError(
                    f"Invalid option keyword {k} for actor method calls. Valid ones are "
                    f"{sorted(_CALL_KEYS)}."
                )
        _options.refuse_unsupported(options, "actor method call")
        if options.get("name") is not None:
            raise ValueError(
                f"tpuray does not support the actor method call option name="
                f"{options['name']!r}: actor calls are named Class.method (see "
                "python-sdk/README.md)"
            )
        meta = self._handle._method_meta.get(self._name, {})
        if "num_returns" in options:
            _options.check_num_returns(options["num_returns"], bool(meta.get("is_generator")))
        if options.get("retry_exceptions") is not None:
            _options.retry_filter(options)
        call = {**self._call, **{k: v for k, v in options.items() if v is not None}}
        return ActorMethod(
            self._handle, self._name, options.get("num_returns", self._num_returns), call
        )

    def _effective(self):
        """(concurrency group, max_task_retries, retry_exceptions) of a call: the call's
        options, else the method's ``@method`` ones, else the handle's."""
        meta = self._handle._method_meta.get(self._name, {})

        def pick(key, default):
            v = self._call.get(key)
            if v is None:
                v = meta.get(key)
            return default if v is None else v

        group = pick("concurrency_group", "")
        retries = int(pick("max_task_retries", self._handle._max_task_retries))
        retry_exceptions = pick("retry_exceptions", False)
        return group, retries, retry_exceptions

    def bind(self, *args, **kwargs):
        """A lazy call of this method on this actor (Ray's DAG API): a
        ``tpuray.dag.ClassMethodNode``."""
        from tpuray.dag.dag_node import _UnboundClassMethodNode

        default = self._handle._method_returns.get(self._name, 1)
        options = {} if self._num_returns == default else {"num_returns": self._num_returns}
        return _UnboundClassMethodNode(self._handle, self._name, options).bind(*args, **kwargs)

    def remote(self, *args, **kwargs):
        h = self._handle
        if not self._call and self._name not in h._method_meta:
            group, retries, retry_exceptions = "", h._max_task_retries, False
        else:
            group, retries, retry_exceptions = self._effective()
        if self._num_returns == "streaming":
            task_id = _tpuray.call_actor_streaming(
                h._actor_id, h._class_name, self._name, worker.encode_args(args, kwargs),
                group, h._max_pending_calls,
            )
            return ObjectRefGenerator(task_id, f"{h._class_name}.{self._name}")
        retry_filter = None
        if isinstance(retry_exceptions, (list, tuple)):
            retry_filter = list(retry_exceptions)
        refs = _tpuray.call_actor(
            h._actor_id,
            h._class_name,
            self._name,
            worker.encode_args(args, kwargs, retry_filter),
            self._num_returns,
            retries,
            group,
            bool(retry_exceptions),
            h._max_pending_calls,
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
        method_meta: dict | None = None,
        max_pending_calls: int = -1,
    ):
        self._actor_id = actor_id
        self._class_name = class_name
        self._method_returns = method_returns or {}
        self._max_task_retries = max_task_retries
        # Each method's @method options (concurrency group, retries).
        self._method_meta = method_meta or {}
        # Ray's max_pending_calls, counted per caller process (-1: no limit).
        self._max_pending_calls = max_pending_calls
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
                self._method_meta,
                self._max_pending_calls,
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
