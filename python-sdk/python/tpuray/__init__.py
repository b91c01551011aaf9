"""tpuray: Ray-style tasks and actors with TPU slices as first-class resources.

A drop-in for Ray Core's API (``import tpuray as ray``) over tpuray's Rust core worker
(the ``tpuray._tpuray`` extension): ``init``, ``remote``, ``get``, ``put``, ``wait``,
``kill``, ``cancel``, ``get_actor``, ``nodes``, ``cluster_resources``,
``available_resources``, ``get_runtime_context``, ``exceptions``, and ``tpuray.util``
(placement groups, scheduling strategies, TPU slices). The same package gives the
``tpuray`` command (``tpuray start``, ``status``, ``list``, ``stop``).
"""

from __future__ import annotations

import inspect as _inspect

from tpuray import exceptions
from tpuray._private import worker as _worker
from tpuray._private.serialization import ObjectRef, ObjectRefGenerator
from tpuray._tpuray import __version__
from tpuray.actor import ActorClass, ActorHandle, method
from tpuray.remote_function import RemoteFunction
from tpuray.runtime_context import get_runtime_context
from tpuray import util  # noqa: E402 - imports the util package after the core names

ObjectID = ObjectRef


def init(address=None, **kwargs):
    """Connects to a cluster (Ray's ``ray.init``).

    With no address: ``TPURAY_ADDRESS`` (or ``RAY_ADDRESS``), else the cluster that
    ``tpuray start --head`` left on this machine, else a new local cluster private to this
    driver (stopped at ``shutdown`` or exit). ``init`` again after ``shutdown`` in the same
    process connects again. Keyword arguments, Ray 2.60's: ``num_cpus``, ``num_gpus``,
    ``resources``, ``object_store_memory`` (bytes), ``labels`` (``{str: str}``),
    ``dashboard_host``, ``dashboard_port``, ``object_spilling_directory``, ``_temp_dir``,
    ``_node_ip_address``, ``_memory`` (bytes), ``_metrics_export_port`` (these set up a new
    local cluster; connecting to an existing one they are refused, as Ray refuses the
    first five); ``namespace`` (default: an anonymous namespace of this job's own, as
    Ray's); ``runtime_env`` (the job's environment: ``working_dir``, ``py_modules``,
    ``pip``, ``uv``, ``env_vars``, ``excludes``, ``config``, as Ray's; see
    ``tpuray.runtime_env``); ``job_config`` (a :class:`tpuray.job_config.JobConfig`: its
    ``runtime_env`` and ``ray_namespace``); ``ignore_reinit_error``; ``log_to_driver``
    (default ``RAY_LOG_TO_DRIVER``, on: lines printed by the job's tasks and actors print
    here as ``(f pid=123) ...``, repeated lines deduplicated by Ray's rules and
    ``RAY_DEDUP_LOGS*`` variables); ``configure_logging``, ``logging_level``,
    ``logging_format`` (the ``tpuray`` logger, as Ray configures its ``ray`` logger);
    ``_enable_object_reconstruction`` and ``_skip_env_hook`` (lineage reconstruction is
    always on; tpuray runs no runtime-env hook). Refused by name, with the reason, when
    given other than Ray's default: ``include_dashboard=False``, ``logging_config``,
    ``enable_resource_isolation``, ``cgroup_path``, ``system_reserved_cpu``,
    ``system_reserved_memory``, ``proxy_server_url``, ``_plasma_directory``,
    ``_driver_object_store_memory``, ``_redis_username``, ``_redis_password``,
    ``_system_config``, ``_tracing_startup_hook``, ``_node_name``.

    Returns:
        A ``RayContext`` (Ray's): ``address_info`` (``node_ip_address``,
        ``gcs_address``, ``webui_url``, ``node_id``, ``job_id`` ...; also reached as
        ``ctx["node_id"]``), ``dashboard_url``, ``python_version``, ``ray_version``,
        ``ray_commit``; ``with tpuray.init():`` shuts down at exit.

    Raises:
        RuntimeError: already initialised (unless ``ignore_reinit_error``, Ray's text); a
            keyword Ray's ``init`` does not take either (``Unknown keyword argument(s):
            ...``); ``local_mode=True``, ``allow_multiple``, ``storage`` (Ray's refusals).
        ValueError: a local-cluster option when connecting to an existing cluster (Ray's
            refusal); a refused keyword, naming why.
        tpuray.exceptions.RaySystemError: the cluster could not be reached or started.
    """
    return _worker.init(address, **kwargs)


def shutdown() -> None:
    """Disconnects this driver (Ray's ``ray.shutdown``)."""
    _worker.shutdown()


def is_initialized() -> bool:
    return _worker.is_initialized()


def remote(*args, **kwargs):
    """Makes a function a remote function or a class an actor class (Ray's
    ``@ray.remote``, with or without options such as ``num_cpus=2``)."""

    def make(obj, options):
        if _inspect.isclass(obj):
            return ActorClass(obj, options)
        if callable(obj):
            return RemoteFunction(obj, options)
        raise TypeError(
            "The @tpuray.remote decorator must be applied to either a function or a class."
        )

    if len(args) == 1 and not kwargs and callable(args[0]):
        return make(args[0], {})
    if args:
        raise TypeError("@tpuray.remote takes keyword options only, e.g. @tpuray.remote(num_cpus=2)")
    return lambda obj: make(obj, kwargs)


def get(object_refs, *, timeout=None):
    """The value of an ``ObjectRef`` (or the values of a list of them), waiting at most
    ``timeout`` seconds.

    Raises:
        tpuray.exceptions.RayTaskError: the task raised (also an instance of the task's
            own exception class).
        tpuray.exceptions.GetTimeoutError: not ready within ``timeout``.
        tpuray.exceptions.RayActorError / WorkerCrashedError / NodeDiedError /
            ObjectLostError.
    """
    return _worker.get(object_refs, timeout)


def put(value, *, _owner=None) -> ObjectRef:
    """Stores ``value`` in the object store; returns its ref.

    Raises:
        ValueError: ``_owner`` given (Ray's experimental owner actor: in tpuray the
            process that puts an object always owns it)."""
    if _owner is not None:
        raise ValueError(
            "put(_owner=...) is not supported by tpuray: the process that puts an object owns it"
        )
    return _worker.put(value)


def wait(object_refs, *, num_returns=1, timeout=None, fetch_local=True):
    """Splits refs into (ready, not ready) once ``num_returns`` are ready or ``timeout``
    seconds pass; order within each list is kept."""
    return _worker.wait(
        object_refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local
    )


def kill(actor: ActorHandle, *, no_restart: bool = True) -> None:
    """Kills an actor (Ray's ``ray.kill``); with ``no_restart=False`` it may restart."""
    if not isinstance(actor, ActorHandle):
        raise ValueError(f"ray.kill() only supported for actors. Got: {type(actor)}.")
    _worker.auto_init()
    from tpuray import _tpuray

    _tpuray.kill_actor(actor._actor_id, no_restart)


def cancel(object_ref, *, force: bool = False, recursive: bool = True) -> None:
    """Cancels the task that makes ``object_ref`` (an ``ObjectRef`` or an
    ``ObjectRefGenerator``), as Ray 2.60's ``ray.cancel``: a queued task never runs; a
    running task gets ``KeyboardInterrupt`` (``force=True``: its worker exits); a running
    async actor method's coroutine is cancelled; a running sync actor method is only
    flagged (``get_runtime_context().is_canceled()``). ``get`` then raises
    ``TaskCancelledError``. With ``recursive`` (the default) the tasks it submitted are
    cancelled too. A finished task is left as it is.

    Raises:
        TypeError: not an ``ObjectRef`` or ``ObjectRefGenerator``.
        ValueError: ``force=True`` for an actor call (Ray: use ``ray.kill``).
    """
    from tpuray import _tpuray

    _worker.auto_init()
    if isinstance(object_ref, ObjectRefGenerator):
        _tpuray.cancel_task(object_ref._task_id, force, recursive)
        return
    if not isinstance(object_ref, ObjectRef):
        raise TypeError(
            "ray.cancel() only supported for object refs. For actors, try ray.kill(). "
            f"Got: {type(object_ref)}."
        )
    _tpuray.cancel(object_ref._core, force, recursive)


def get_actor(name: str, namespace: str | None = None) -> ActorHandle:
    """The live actor named ``name`` (Ray's ``ray.get_actor``).

    Raises:
        ValueError: no live actor has that name in the namespace.
    """
    from tpuray import _tpuray

    _worker.auto_init()
    try:
        actor_id, cls, _ = _tpuray.get_actor(name, namespace or _worker.state.namespace)
    except RuntimeError as e:
        raise ValueError(
            f"Failed to look up actor with name '{name}'. This could because 1. You are "
            "trying to look up a named actor you didn't create. 2. The named actor died. "
            "3. You did not use a namespace matching the namespace of the actor."
        ) from e
    from tpuray.actor import _HANDLE_NAMESPACE
    from tpuray._private.serialization import deserialize

    record = _tpuray.kv_get(_HANDLE_NAMESPACE, actor_id.encode())
    if record is not None:
        try:
            # The creator's handle: method options, generator methods, limits.
            return deserialize(record)
        except Exception:  # noqa: BLE001 - a class this process cannot load
            pass
    return ActorHandle(actor_id, cls)


def get_gpu_ids() -> list:
    """GPU ids visible to this worker (from ``CUDA_VISIBLE_DEVICES``; Ray's
    ``ray.get_gpu_ids``)."""
    import os

    _worker.auto_init()
    v = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(x) if x.isdigit() else x for x in v.split(",") if x]


def nodes() -> list[dict]:
    """Every node, alive or dead, with Ray's keys: ``NodeID``, ``Alive`` (and Ray's
    lower-case ``alive``), ``NodeManagerAddress`` (the node's IP), ``NodeManagerPort``
    (its agent's port), ``NodeManagerHostname``, ``NodeName`` (the IP, Ray's default),
    ``Resources``, ``Labels``, ``MetricsExportPort``, ``DeathReasonMessage`` (``""``
    while alive). Ray's raylet-internal keys (``ObjectManagerPort``,
    ``ObjectStoreSocketName``, ``RayletSocketName``) have no tpuray counterpart."""
    from tpuray import _tpuray

    _worker.check_connected()
    return _tpuray.nodes()


def cluster_resources() -> dict:
    from tpuray import _tpuray

    _worker.check_connected()
    return _tpuray.cluster_resources()


def available_resources() -> dict:
    from tpuray import _tpuray

    _worker.check_connected()
    return _tpuray.available_resources()


def timeline(filename=None):
    """The cluster's tasks as a timeline, as Ray's ``ray.timeline``: Chrome trace events
    (one complete ``"ph": "X"`` span per task that ran, ``pid`` a node, ``tid`` a worker
    process on it, times in microseconds, Ray's ``args``), which Perfetto
    (ui.perfetto.dev) and ``chrome://tracing`` open.

    Like Ray, it first waits one second so that task events still being reported reach
    the head (workers and drivers send them every 0.5 s).

    Args:
        filename: When given, the events are written there as a JSON array and ``None``
            is returned.

    Returns:
        The list of trace events (dicts) when ``filename`` is ``None``.

    Raises:
        RuntimeError: When tpuray is not initialized (as Ray), or the head cannot be
            reached.
    """
    import json
    import time

    from tpuray import _tpuray

    if not is_initialized():
        raise RuntimeError(
            "tpuray has not been started yet. Timeline requires tpuray to be initialized first."
        )
    time.sleep(1)
    text = _tpuray.timeline_json()
    if filename is not None:
        with open(filename, "w") as f:
            f.write(text)
        return None
    return json.loads(text)


def __getattr__(name):
    """``tpuray.data`` on first use after ``import tpuray`` (as ``ray.data`` after
    ``import ray``), without importing numpy/pandas/pyarrow for programs that never
    touch it."""
    if name == "data":
        import importlib

        return importlib.import_module("tpuray.data")
    raise AttributeError(f"module 'tpuray' has no attribute {name!r}")


__all__ = [
    "ActorClass",
    "ActorHandle",
    "ObjectID",
    "ObjectRef",
    "ObjectRefGenerator",
    "RemoteFunction",
    "__version__",
    "available_resources",
    "cancel",
    "cluster_resources",
    "exceptions",
    "get",
    "get_actor",
    "get_gpu_ids",
    "get_runtime_context",
    "init",
    "is_initialized",
    "kill",
    "method",
    "nodes",
    "put",
    "remote",
    "shutdown",
    "timeline",
    "util",
    "wait",
]
