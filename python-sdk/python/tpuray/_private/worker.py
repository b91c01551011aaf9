"""The driver and worker state of one process, over the Rust core worker (``_tpuray``).

Everything that moves values (leases, ownership, borrowing, actor ordering, object
transfer) happens in the Rust core; this module pickles values, keeps the function
table, turns errors into Ray's exception classes, and hosts the runtime that a Python
worker process hands to the core.

Functions and classes are pickled once into the head's KV (namespace ``fn``, keyed by
content hash); workers load them by key.

Worker output: a worker's ``sys.stdout``/``sys.stderr`` forwarder (``_Forwarder``) sends
its lines to the job's driver (``ReportLogs``, batches of lines with the task or actor
name, the pid and the node's address) at each flush, at a task's end and every 100 ms;
the driver prints them as Ray's does (``sdk/src/logs.rs``, LOGS-1). Only Python-level
writes travel: output a C extension or a child process writes to the descriptors
directly, and a Rust worker's output, stay in the worker's log files (``tpuray logs``).
"""

from __future__ import annotations

import atexit
# hashlib, socket, subprocess and tempfile are imported where a driver uses them: a
# worker process imports this module at start, once per actor (issue 34's actors per
# second), and never needs them.
import contextvars
import inspect
import json
import os
import sys
import threading
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tpuray import _tpuray, exceptions

if TYPE_CHECKING:
    import subprocess
from tpuray._private.serialization import (
    ObjectRef,
    ObjectRefGenerator,
    deserialize,
    mapped_view,
    serialize,
    serialize_parts,
)

#: KV namespace of pickled functions and classes, keyed by content hash.
FUNCTION_NAMESPACE = "fn"
#: KV namespace of the module name of each exported object of a driver's script
#: (``__main__``), keyed as ``FUNCTION_NAMESPACE`` (:func:`function_module`).
FUNCTION_MODULE_NAMESPACE = "fn_module"
#: KV namespace of each job's runtime record, read by node agents to start Python workers.
JOB_RUNTIME_NAMESPACE = "job_runtime"


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.connected = False
        self.mode = None  # "driver" | "worker"
        self.info: dict = {}
        self.exported: set[str] = set()
        self.local_cluster: dict | None = None
        self.namespace = None
        self.runtime_env: dict | None = None
        self.context = None
        self.atexit_registered = False


state = _State()
_task_context = threading.local()
#: The info of the async actor call a coroutine runs for (an asyncio task copies the
#: context it was created in, so each call's coroutine sees its own; the loop thread's
#: ``_task_context`` cannot tell overlapping calls apart).
_async_call: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "tpuray_async_call", default=None
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tpuray_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "tpuray", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _start_local_cluster(
    num_cpus, num_gpus, resources, object_store_memory=None, extra_args=()
) -> str:
    """Starts a private head (and its node) for this driver, stopped at shutdown (Ray's
    ``ray.init()`` without an address). ``extra_args``: more ``tpuray start`` flags
    (from ``init``'s ``labels``, ``dashboard_port``, ``_temp_dir`` ...); a
    ``--temp-dir`` or ``--node-ip-address`` among them replaces the default."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="tpuray-local-")
    env = dict(os.environ)
    env["TPURAY_REGISTRY_DIR"] = os.path.join(tmp, "registry")
    env.pop("TPURAY_ADDRESS", None)
    port = _free_port()
    extra_args = list(extra_args)
    ip = "127.0.0.1"
    if "--node-ip-address" in extra_args:
        ip = extra_args[extra_args.index("--node-ip-address") + 1]
    args = ["start", "--head", "--port", str(port)]
    if "--node-ip-address" not in extra_args:
        args += ["--node-ip-address", ip]
    if "--temp-dir" not in extra_args:
        args += ["--temp-dir", os.path.join(tmp, "head")]
    args += extra_args
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        args += ["--num-gpus", str(num_gpus)]
    if resources:
        args += ["--resources", json.dumps(resources)]
    if object_store_memory is not None:
        args += ["--object-store-memory", str(int(object_store_memory))]
    out = _tpuray_cli(args, env)
    if out.returncode != 0:
        raise exceptions.RaySystemError(
            f"could not start a local tpuray cluster (tpuray {' '.join(args)}):\n{out.stderr}"
        )
    state.local_cluster = {"env": env, "dir": tmp, "watchdog": _fate_share(env, tmp)}
    return f"{ip}:{port}"


# The watchdog of a private cluster: it blocks on a pipe whose only write end the driver
# holds, so it reads EOF when the driver is gone however it went (SIGKILL included), then
# stops the cluster and removes its directory.
_WATCHDOG = """
import shutil, subprocess, sys
sys.stdin.buffer.read()
subprocess.run([sys.executable, "-m", "tpuray", "stop"], capture_output=True, check=False)
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


def _fate_share(env: dict, tmp: str):
    """Ties the private cluster's life to this process, as Ray's processes started by
    ``ray.init()`` share the driver's fate (``ray._private.services``, ``fate_share``): a
    driver that dies without ``shutdown()`` (killed, crashed, ``os._exit``) leaves no head
    or node agent running. Returns ``(watchdog process, write end of its pipe)``."""
    import subprocess

    r, w = os.pipe()  # both ends non-inheritable (PEP 446): no other child holds ``w``
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, tmp],
            stdin=r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a Ctrl-C to the driver's group must not reach it first
        )
    finally:
        os.close(r)
    return proc, w


def _stop_local_cluster() -> None:
    lc = state.local_cluster
    state.local_cluster = None
    if lc:
        proc, w = lc["watchdog"]
        proc.kill()
        proc.wait()
        os.close(w)
        _tpuray_cli(["stop"], lc["env"])
        import shutil

        shutil.rmtree(lc["dir"], ignore_errors=True)


#: Ray 2.60's ``ray.init`` keywords (``ray/_private/worker.py``, ``init``: its signature,
#: then the hidden keywords it pops from ``**kwargs``) beyond the ones :func:`init` names
#: in its own signature, each with what tpuray does with it (:func:`_init_extras`):
#: ``"local"`` sets up a new local cluster (``tpuray start`` flags) and is refused when
#: connecting to an existing one; ``"refuse"`` is refused by name when given other than
#: Ray's default; ``"ok"`` is honoured as it is (see :func:`_init_extras`).
_RAY_INIT_EXTRAS = {
    "labels": "local",
    "include_dashboard": "refuse",
    "dashboard_host": "local",
    "dashboard_port": "local",
    "job_config": "ok",
    "logging_config": "refuse",
    "enable_resource_isolation": "refuse",
    "cgroup_path": "refuse",
    "system_reserved_cpu": "refuse",
    "system_reserved_memory": "refuse",
    "proxy_server_url": "refuse",
    "_enable_object_reconstruction": "ok",
    "_plasma_directory": "refuse",
    "object_spilling_directory": "local",
    "_node_ip_address": "local",
    "_driver_object_store_memory": "refuse",
    "_memory": "local",
    "_redis_username": "refuse",
    "_redis_password": "refuse",
    "_temp_dir": "local",
    "_metrics_export_port": "local",
    "_system_config": "refuse",
    "_tracing_startup_hook": "refuse",
    "_node_name": "refuse",
    "_skip_env_hook": "ok",
}

#: Why each refused keyword is refused.
_INIT_REFUSALS = {
    "include_dashboard": "every tpuray head serves its dashboard (include_dashboard=False cannot "
                         "be honoured; pick its port with dashboard_port=)",
    "logging_config": "tpuray has no LoggingConfig (structured worker logs); use "
                      "logging_level= and logging_format= for the driver's logger",
    "enable_resource_isolation": "tpuray does not manage cgroups",
    "cgroup_path": "tpuray does not manage cgroups",
    "system_reserved_cpu": "tpuray does not manage cgroups",
    "system_reserved_memory": "tpuray does not manage cgroups",
    "proxy_server_url": "tpuray has no Ray Client proxy",
    "_plasma_directory": "the object store lives in /dev/shm",
    "_driver_object_store_memory": "drivers use their node's object store",
    "_redis_username": "tpuray has no Redis",
    "_redis_password": "tpuray has no Redis",
    "_system_config": "Ray's internal settings have no tpuray counterpart",
    "_tracing_startup_hook": "tpuray has no tracing hook",
    "_node_name": "tpuray names nodes by their address",
}

#: Ray's defaults of the refused keywords: given as these, they change nothing.
_INIT_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "include_dashboard": (None, True),
    "enable_resource_isolation": (False,),
    "_redis_username": ("",),
    "_redis_password": ("",),
    "_system_config": ({},),
}

#: The ``tpuray start`` flag of each ``"local"`` keyword.
_LOCAL_FLAGS = {
    "labels": "--labels",
    "dashboard_host": "--dashboard-host",
    "dashboard_port": "--dashboard-port",
    "object_spilling_directory": "--spill-dir",
    "_node_ip_address": "--node-ip-address",
    "_memory": "--memory",
    "_temp_dir": "--temp-dir",
    "_metrics_export_port": "--metrics-export-port",
}


def _init_extras(kwargs: dict) -> dict:
    """Checks the keywords of :data:`_RAY_INIT_EXTRAS` given to ``init``; returns the
    ``"local"`` ones given (name -> value) and ``job_config``.

    Raises:
        RuntimeError: a keyword Ray's ``init`` does not take either (Ray's ``Unknown
            keyword argument(s): ...``), ``allow_multiple`` or ``storage`` (Ray's
            refusals), ``local_mode=True`` (Ray 2.60's refusal).
        ValueError: a refused keyword given other than Ray's default, naming why.
        TypeError: ``_system_config`` not a dict (Ray's check).
    """
    if kwargs.pop("local_mode", False):
        raise RuntimeError(
            "`local_mode` is no longer supported. For interactive debugging consider using "
            "the Ray distributed debugger."
        )
    if kwargs.get("allow_multiple"):
        raise RuntimeError(
            # Ray's message, naming its docs of the Ray Client feature it belongs to.
            "`allow_multiple` argument is passed to `ray.init` when the ray client is not "
            "used (https://docs.ray.io/en/releases-2.60.0/cluster/running-applications/"
            "job-submission/ray-client.html#connect-to-multiple-ray-clusters-experimental). "
            "Do not pass the `allow_multiple` to `ray.init` to fix the issue."
        )
    if kwargs.get("storage"):
        raise RuntimeError(
            "Cluster-wide storage configuration has been removed. The last Ray version "
            "supporting the `storage` argument is `ray==2.47`."
        )
    unknown = [k for k in kwargs if k not in _RAY_INIT_EXTRAS]
    if unknown:
        raise RuntimeError(f"Unknown keyword argument(s): {', '.join(unknown)}")
    sc = kwargs.get("_system_config")
    if sc is not None and not isinstance(sc, dict):
        raise TypeError("The _system_config must be a dict.")
    local = {}
    for k, v in kwargs.items():
        how = _RAY_INIT_EXTRAS[k]
        if how == "refuse":
            if v is None or v in _INIT_DEFAULTS.get(k, ()):
                continue
            raise ValueError(f"tpuray.init does not support {k}={v!r}: {_INIT_REFUSALS[k]}")
        if how == "local" and v is not None:
            local[k] = v
    if kwargs.get("_enable_object_reconstruction") not in (None, False, True):
        raise TypeError("_enable_object_reconstruction must be a bool")
    return local


def _local_cluster_args(local: dict) -> list:
    """``tpuray start`` flags for the ``"local"`` keywords of :data:`_RAY_INIT_EXTRAS`."""
    args = []
    for k, v in local.items():
        if k == "labels":
            if not isinstance(v, dict) or not all(
                isinstance(a, str) and isinstance(b, str) for a, b in v.items()
            ):
                raise TypeError(f"labels must be a dict of str to str, got {v!r}")
            if v:
                args += ["--labels", ",".join(f"{a}={b}" for a, b in v.items())]
            continue
        if k in ("dashboard_port", "_memory", "_metrics_export_port"):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{k} must be a non-negative int, got {v!r}")
        elif not isinstance(v, str):
            raise TypeError(f"{k} must be a str, got {type(v).__name__}")
        if k == "_temp_dir" and not os.path.isabs(v):
            raise ValueError(f"_temp_dir must be an absolute path, got {v!r}")
        args += [_LOCAL_FLAGS[k], str(v)]
    return args


def _job_config_fields(job_config, runtime_env, namespace):
    """``(runtime_env, namespace)`` with a Ray ``JobConfig``'s applied: its runtime_env
    when ``init`` names none (Ray: ``init``'s replaces the job config's), its
    ``ray_namespace`` when ``init`` names none.

    Raises:
        TypeError: not a :class:`tpuray.job_config.JobConfig`.
        ValueError: a field tpuray cannot honour (see ``JobConfig``).
    """
    if job_config is None:
        return runtime_env, namespace
    from tpuray.job_config import JobConfig

    if not isinstance(job_config, JobConfig):
        raise TypeError(f"job_config must be a JobConfig, got {type(job_config).__name__}")
    job_config._check_supported()
    if runtime_env is None and job_config.runtime_env:
        runtime_env = dict(job_config.runtime_env)
    if namespace is None:
        namespace = job_config.ray_namespace
    return runtime_env, namespace


def _configure_logging(level, fmt) -> None:
    """Ray's ``configure_logging``: the package's logger (``tpuray``, also reached as
    ``ray`` through the shim) at ``logging_level`` (default INFO) with a handler of
    ``logging_format`` on stderr, once per process."""
    import logging

    logger = logging.getLogger("tpuray")
    if level is not None:
        logger.setLevel(logging.getLevelName(level) if isinstance(level, str) else level)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if fmt is not None or not any(getattr(h, "_tpuray_init", False) for h in logger.handlers):
        for h in [h for h in logger.handlers if getattr(h, "_tpuray_init", False)]:
            logger.removeHandler(h)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(fmt or "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"))
        # A marker on the stdlib handler: the handlers this function added, replaced on the next call.
        setattr(handler, "_tpuray_init", True)
        logger.addHandler(handler)
        logger.propagate = False


def _refuse_local_cluster_options(**given) -> None:
    """Ray's refusals (``ray/_private/worker.py``, ``init``) of options that only size a
    new local cluster, when ``init`` connects to an existing one."""
    if given["num_cpus"] is not None or given["num_gpus"] is not None:
        raise ValueError(
            "When connecting to an existing cluster, num_cpus and num_gpus must not be provided."
        )
    for name in ("resources", "object_store_memory"):
        if given[name] is not None:
            raise ValueError(f"When connecting to an existing cluster, {name} must not be provided.")


def _current_cluster_address() -> str | None:
    reg = os.environ.get("TPURAY_REGISTRY_DIR", "/tmp/tpuray/registry")
    try:
        with open(os.path.join(reg, "current_cluster.json")) as f:
            addr = json.load(f).get("address")
    except (OSError, ValueError):
        return None
    if not addr:
        return None
    import socket

    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1):
            return addr
    except (OSError, ValueError):
        return None


def init(
    address=None,
    *,
    num_cpus=None,
    num_gpus=None,
    resources=None,
    object_store_memory=None,
    namespace=None,
    runtime_env=None,
    ignore_reinit_error=False,
    log_to_driver=None,
    configure_logging=True,
    logging_level=None,
    logging_format=None,
    **kwargs,
):
    """Connects this process to a cluster as a driver (see :func:`tpuray.init`); returns
    a :class:`RayContext`."""
    job_config = kwargs.get("job_config")
    local = _init_extras(kwargs)
    runtime_env, namespace = _job_config_fields(job_config, runtime_env, namespace)
    if configure_logging:
        _configure_logging(logging_level, logging_format)
    else:
        # Ray: configure_logging=False clears the handlers of its logger.
        import logging

        logging.getLogger("tpuray").handlers.clear()
    if isinstance(address, str) and address.startswith(("http://", "https://")):
        raise ValueError(
            f"{address} is an HTTP address (the dashboard's Jobs and state APIs); init() joins a "
            "cluster through its head's HOST:PORT (tpuray start --head prints both)"
        )
    if isinstance(address, str) and address.startswith("ray://"):
        raise ValueError(
            f"Ray Client addresses ({address}) are not supported by tpuray: pass the "
            "head's host:port (tpuray start --head prints it), or run the driver on "
            "a machine of the cluster"
        )
    with state.lock:
        if state.connected:
            if ignore_reinit_error:
                import logging

                logging.getLogger("tpuray").info(
                    "Calling ray.init() again after it has already been called."
                )
                return state.context
            raise RuntimeError(
                "Maybe you called ray.init twice by accident? This error can be suppressed "
                "by passing in 'ignore_reinit_error=True' or by calling 'ray.shutdown()' "
                "prior to 'ray.init()'."
            )
        if address in ("local",):
            address = None
        elif address in (None, "auto"):
            asked = address or os.environ.get("TPURAY_ADDRESS") or os.environ.get("RAY_ADDRESS")
            address = os.environ.get("TPURAY_ADDRESS") or os.environ.get("RAY_ADDRESS")
            if not address or address == "auto":
                address = _current_cluster_address()
            if not address and asked == "auto":
                # Ray's: "auto" joins a running cluster and never starts one
                # (ray/_private/services.py, canonicalize_bootstrap_address_or_die).
                raise ConnectionError(
                    "Could not find any running Ray instance. Please specify the one to "
                    "connect to by setting `--address` flag or `RAY_ADDRESS` environment "
                    "variable."
                )
        if address:
            _refuse_local_cluster_options(
                num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                object_store_memory=object_store_memory,
            )
            if "labels" in local:
                raise ValueError(
                    "When connecting to an existing cluster, labels must not be provided."
                )
            if local:
                k = next(iter(local))
                raise ValueError(
                    f"When connecting to an existing cluster, {k} must not be provided (it "
                    f"sets up a new local cluster; give `tpuray start {_LOCAL_FLAGS[k]}` "
                    "to the cluster's own nodes)"
                )
        else:
            address = _start_local_cluster(
                num_cpus, num_gpus, resources, object_store_memory, _local_cluster_args(local)
            )
        # A private cluster keeps its own process registry, which lists its node.
        registry = (state.local_cluster or {}).get("env", {}).get("TPURAY_REGISTRY_DIR")
        if log_to_driver is not None and not isinstance(log_to_driver, bool):
            raise TypeError(f"log_to_driver must be a bool, got {type(log_to_driver).__name__}")
        if namespace is None:
            # Ray: a job given no namespace gets an anonymous one of its own, so two such
            # drivers never see each other's named actors.
            import uuid

            namespace = str(uuid.uuid4())
        elif not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        try:
            info = _tpuray.init_driver(address, namespace, registry)
        except BaseException:
            # A local cluster started for this driver goes with the failed init.
            _stop_local_cluster()
            raise
        if log_to_driver is not None:
            # Ray's log_to_driver (None: RAY_LOG_TO_DRIVER, default on): workers stop
            # sending their lines once this driver answers that it takes none.
            _tpuray.set_log_to_driver(log_to_driver)
        state.info = dict(info)
        state.connected = True
        state.mode = "driver"
        state.namespace = namespace
        # Functions and classes exported to an earlier cluster (before a shutdown) go to
        # this one too: RemoteFunction and ActorClass keep the keys they got.
        for key, data in _exported_data.items():
            _tpuray.kv_put(FUNCTION_NAMESPACE, key.encode(), data, False)
        for key, module in _exported_modules.items():
            _tpuray.kv_put(FUNCTION_MODULE_NAMESPACE, key.encode(), module.encode(), False)
        from tpuray._private import runtime_env as _rt

        job_env = _rt.upload(_rt.validate(runtime_env, job=True))
        # A Jobs API entrypoint: the submission's environment (its working_dir package,
        # pip) is the job's, under what init() itself names (node agents build it for
        # every worker of the job).
        submitted = os.environ.get("TPURAY_JOB_RUNTIME_ENV_JSON")
        if submitted:
            job_env = _rt.merge(json.loads(submitted), job_env)
        state.runtime_env = job_env
        record = {
            "python": sys.executable,
            "cwd": os.getcwd(),
            "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
            # TPURAY_NAMESPACE: workers create and look up named actors in the job's
            # namespace, as Ray's do.
            "env_vars": {
                **dict(job_env.get("env_vars") or {}),
                "TPURAY_NAMESPACE": namespace,
            },
            "runtime_env": job_env,
        }
        _tpuray.kv_put(
            JOB_RUNTIME_NAMESPACE, info["job_id"].encode(), json.dumps(record).encode(), True
        )
        # A pre-started pool (as Ray's): the first tasks find interpreters already up.
        # With an environment to build, that starts building it on this node now (Ray's
        # eager_install, default True); eager_install=False leaves it to the first task.
        if not _rt.needs_build(job_env) or _rt.eager_install(job_env):
            try:
                _tpuray.prestart_workers(os.cpu_count() or 1)
            except RuntimeError:
                pass
        if not state.atexit_registered:
            atexit.register(shutdown)
            state.atexit_registered = True
        state.context = RayContext(_address_info(info, address))
        return state.context


def _address_info(info: dict, head: str) -> dict:
    """Ray's ``address_info`` keys that tpuray has (``node_ip_address``,
    ``raylet_ip_address``, ``gcs_address``, ``address``, ``webui_url``, ``session_dir``,
    ``metrics_export_port``, ``node_id``), plus ``job_id``, ``worker_id``,
    ``head_address`` and ``agent_address``. Ray's raylet and plasma socket names have no
    counterpart."""
    try:
        url = _tpuray.dashboard_url()
    except RuntimeError:
        url = ""
    ip = info["agent_address"].rpartition(":")[0]
    node = {}
    try:
        node = next((n for n in _tpuray.nodes() if n["NodeID"] == info["node_id"]), {})
    except RuntimeError:
        pass
    return {
        "node_ip_address": ip,
        "raylet_ip_address": ip,
        "gcs_address": info["head_address"] or head,
        "address": info["head_address"] or head,
        "webui_url": url.split("://", 1)[-1] if url else None,
        "metrics_export_port": node.get("MetricsExportPort"),
        "node_id": info["node_id"],
        "job_id": info["job_id"],
        "worker_id": info["worker_id"],
        # tpuray's own: the head (as given to init) and this node's agent.
        "head_address": info["head_address"] or head,
        "agent_address": info["agent_address"],
    }


class RayContext(Mapping):
    """What ``init`` returns (Ray's ``ray._private.worker.RayContext``): a mapping of
    :attr:`address_info` (Ray keeps ``ctx["key"]`` working, deprecated), with
    ``dashboard_url`` (``HOST:PORT``, no scheme, as Ray's; None when the head serves no
    dashboard), ``python_version``, ``ray_version`` (tpuray's version), ``ray_commit``
    and ``address_info``. As a context manager (``with tpuray.init():``) it shuts down at
    exit; ``disconnect()`` shuts down too."""

    def __init__(self, address_info: dict):
        from tpuray._tpuray import __version__

        self.address_info = address_info
        self.dashboard_url = address_info.get("webui_url")
        self.python_version = "{}.{}.{}".format(*sys.version_info[:3])
        self.ray_version = __version__
        # tpuray's wheels carry no commit id: "" (Ray's own dev builds say
        # "{{RAY_COMMIT_SHA}}").
        self.ray_commit = ""

    def __getitem__(self, key):
        return self.address_info[key]

    def __len__(self) -> int:
        return len(self.address_info)

    def __iter__(self):
        return iter(self.address_info)

    def __enter__(self) -> "RayContext":
        return self

    def __exit__(self, *exc) -> None:
        shutdown()

    def disconnect(self) -> None:
        shutdown()

    def __repr__(self) -> str:
        return (
            f"RayContext(dashboard_url={self.dashboard_url!r}, python_version="
            f"{self.python_version!r}, ray_version={self.ray_version!r}, "
            f"ray_commit={self.ray_commit!r})"
        )


def shutdown() -> None:
    """Disconnects; the job's non-detached actors and groups end (and a local cluster
    started by ``init`` stops). A later ``init`` connects again (Ray's ``ray.init()``
    after ``ray.shutdown()``)."""
    with state.lock:
        if not state.connected:
            return
        state.connected = False
        if state.mode == "driver":
            _tpuray.shutdown()
            _stop_local_cluster()
            state.info = {}
            state.exported = set()
            state.namespace = None
            state.runtime_env = None
            state.context = None
            state.mode = None
            _node_ips.clear()


def is_initialized() -> bool:
    return state.connected


def check_connected() -> None:
    if not state.connected:
        raise exceptions.RaySystemError(
            "tpuray is not initialized: call tpuray.init() first"
        )


#: Ray's ``RAY_ENABLE_AUTO_CONNECT`` (``ray/_private/auto_init_hook.py``): ``"0"`` turns
#: auto-init off (calls then raise as not connected).
_AUTO_CONNECT = os.environ.get("RAY_ENABLE_AUTO_CONNECT", "") != "0"


def auto_init() -> None:
    """Ray's ``auto_init_ray``: the calls Ray wraps with it (``get``, ``put``, ``wait``,
    ``cancel``, ``kill``, ``get_actor``, ``get_gpu_ids``, ``get_runtime_context``,
    ``.remote()`` of functions, classes and actor methods, ``placement_group``) start or
    join a cluster as ``init()`` with no arguments does when none is connected."""
    if state.connected:
        return
    if not _AUTO_CONNECT:
        check_connected()
    with _auto_init_lock:
        if not state.connected:
            init()


_auto_init_lock = threading.Lock()


# ---- the function table ----

_local_functions: dict[str, Any] = {}
#: A driver's exported functions and classes, pickled, by key: a later ``init`` (after a
#: ``shutdown``) puts them in the new cluster's function table too.
_exported_data: dict[str, bytes] = {}
#: ``FUNCTION_MODULE_NAMESPACE`` entries this driver wrote, for a later ``init`` too.
_exported_modules: dict[str, str] = {}


def export(obj) -> str:
    """Pickles a function or class once, stores it in the head's KV under its content hash
    and returns that key (what workers look it up by)."""
    import hashlib

    data = serialize(obj)[0]
    key = hashlib.sha256(data).hexdigest()
    if key not in state.exported:
        _tpuray.kv_put(FUNCTION_NAMESPACE, key.encode(), data, False)
        state.exported.add(key)
        _local_functions[key] = obj
        if state.mode == "driver":
            _exported_data[key] = data
        main_module = _main_module_name(obj)
        if main_module:
            _tpuray.kv_put(FUNCTION_MODULE_NAMESPACE, key.encode(), main_module.encode(), False)
            if state.mode == "driver":
                _exported_modules[key] = main_module
    return key


def _main_module_name(obj):
    """For a function or class of the script being run (``__main__``), the module name
    its file would import as (Ray's function descriptors name ``__main__``'s objects so:
    ``script.f`` for ``python script.py``); None otherwise."""
    if getattr(obj, "__module__", None) != "__main__":
        return None
    try:
        return inspect.getmodulename(inspect.getfile(obj))
    except (TypeError, OSError):
        return None


_module_names: dict = {}


def function_module(key: str, obj) -> str:
    """The module an exported function or class is named under (Ray's
    ``get_task_function_name``): its own ``__module__``, or for one of the driver's
    script the script's module name, which the driver recorded at export."""
    module = getattr(obj, "__module__", None) or ""
    if module != "__main__":
        return module
    if key not in _module_names:
        name = _exported_modules.get(key)
        if name is None:
            raw = _tpuray.kv_get(FUNCTION_MODULE_NAMESPACE, key.encode())
            name = raw.decode() if raw else module
        _module_names[key] = name
    return _module_names[key]


def load_function(key: str):
    f = _local_functions.get(key)
    if f is None:
        data = _tpuray.kv_get(FUNCTION_NAMESPACE, key.encode())
        if data is None:
            raise RuntimeError(f"function {key} is not in the cluster's function table")
        f = deserialize(data)
        _local_functions[key] = f
    return f


# ---- arguments and values ----


_meta_cache: dict = {}


def encode_args(args, kwargs, retry_filter=None) -> list:
    """The core's argument list: first ``(len(args), kwarg names, retry filter)``, then
    every value; top-level refs travel as refs (resolved to values before the function
    runs). ``retry_filter``: the exception classes ``retry_exceptions`` lists."""
    kw_names = tuple(kwargs)
    shape = (len(args), kw_names)
    meta = _meta_cache.get(shape) if retry_filter is None else None
    if meta is None:
        meta = ("v", serialize((len(args), list(kw_names), retry_filter))[0], [])
        if retry_filter is None and len(_meta_cache) < 1024:
            _meta_cache[shape] = meta
    out: list[tuple[Any, ...]] = [meta]
    for v in list(args) + [kwargs[k] for k in kw_names]:
        if isinstance(v, ObjectRef):
            out.append(("r", v._core))
        else:
            data, nested = serialize(v)
            out.append(("v", data, nested))
    return out


#: The first entry of an argument list (its shape), unpickled, by its bytes.
_decoded_meta: dict = {}


def _decode(raw: list[bytes]):
    """``(args, kwargs, retry_filter)`` of an argument list :func:`encode_args` made."""
    head = raw[0]
    meta = _decoded_meta.get(head)
    if meta is None:
        meta = deserialize(head)
        if len(_decoded_meta) < 1024:
            _decoded_meta[head] = meta
    n, kw_names, retry_filter = meta
    values = [deserialize(b) for b in raw[1:]]
    if not kw_names:
        return values, {}, retry_filter
    return values[:n], dict(zip(kw_names, values[n:])), retry_filter


def decode_args(raw: list[bytes]):
    args, kwargs, retry_filter = _decode(raw)
    _task_context.retry_filter = retry_filter
    return args, kwargs


def _raise(err) -> None:
    kind, message, payload, function, node, pid = err
    node = _node_ip(node)
    if kind == "task":
        cause = None
        if payload:
            try:
                cause = deserialize(payload)
            except Exception:  # noqa: BLE001 - the class may not exist here
                cause = None
        if isinstance(cause, exceptions.RayTaskError):
            raise cause
        e = exceptions.RayTaskError(function, message, cause, pid=pid, ip=node)
        raise e.as_instanceof_cause()
    if kind == "node_died":
        raise exceptions.NodeDiedError(message)
    if kind == "worker_died":
        raise exceptions.WorkerCrashedError(f"task {function}: the worker running it died: {message}")
    if kind == "runtime_env_setup":
        raise exceptions.RuntimeEnvSetupError(message)
    if kind == "actor_unavailable":
        raise exceptions.ActorUnavailableError(message)
    if kind == "actor_died":
        # An actor whose environment could not be set up (the agent's message carries
        # SETUP_FAILED_PREFIX, tpuray_proto::runtime_env): Ray raises RuntimeEnvSetupError.
        marker = "runtime_env setup failed: "
        if marker in message:
            raise exceptions.RuntimeEnvSetupError(message.split(marker, 1)[1])
        raise exceptions.ActorDiedError(f"The actor died: {message}")
    if kind == "cancelled":
        raise exceptions.TaskCancelledError(f"task {function} was cancelled")
    if kind == "pending_calls":
        raise exceptions.PendingCallsLimitExceeded(message)
    if kind == "timeout":
        raise exceptions.GetTimeoutError(f"Get timed out: {message}")
    if kind == "object_lost":
        raise _object_lost_class(message)(f"object {function} was lost: {message}")
    if kind == "infeasible":
        raise exceptions.RaySchedulingError(message)
    raise exceptions.RaySystemError(message)


#: Ray's class for each way the core reports an object lost (``sdk/src/core.rs``: the
#: message's beginning), most specific first; anything else is ``ObjectLostError``.
_OBJECT_LOST_CLASSES = (
    # OWNER_DIED: the owner process is gone (a borrower's get).
    ("owner died", exceptions.OwnerDiedError),
    # OBJECT_FREED: ray._private.internal_api.free freed it.
    ("freed explicitly", exceptions.ObjectFreedError),
    # Lost with its node, and its task has no retries left to make it again.
    ("every copy was lost with its node and the task that made it",
     exceptions.ObjectReconstructionFailedError),
    # The owner's table no longer has it: reference counting freed it.
    ("freed by its owner", exceptions.ReferenceCountingAssertionError),
    ("its owner no longer has it", exceptions.ReferenceCountingAssertionError),
)


def _object_lost_class(message: str):
    for prefix, cls in _OBJECT_LOST_CLASSES:
        if message.startswith(prefix):
            return cls
    return exceptions.ObjectLostError


_node_ips: dict = {}


def _node_ip(node_id: str) -> str:
    """The address of node ``node_id`` (what Ray prints as ``ip=``), or the id itself."""
    if not node_id:
        return node_id
    if node_id not in _node_ips:
        try:
            for n in _tpuray.nodes():
                _node_ips[n["NodeID"]] = n["NodeManagerAddress"]
        except RuntimeError:
            pass
    return _node_ips.get(node_id, node_id)


def get(refs, timeout=None):
    auto_init()
    single = isinstance(refs, ObjectRef)
    items = [refs] if single else list(refs)
    for r in items:
        if not isinstance(r, ObjectRef):
            raise TypeError(
                f"get() expects an ObjectRef or a list of ObjectRefs, got {type(r).__name__}"
            )
    if timeout is not None and timeout < 0:
        timeout = 0
    results = _tpuray.get([r._core for r in items], timeout)
    values = []
    for tag, v in results:
        if tag == 1:
            _raise(v)
        # 2: a store object mapped read-only; its buffers come back without a copy.
        values.append(deserialize(mapped_view(v) if tag == 2 else v))
    return values[0] if single else values


def put(value) -> ObjectRef:
    auto_init()
    if isinstance(value, ObjectRef):
        raise TypeError("Calling 'put' on an ObjectRef is not allowed")
    parts, nested = serialize_parts(value)
    return ObjectRef(_tpuray.put(parts, nested))


def _wait_with_generators(refs, num_returns, timeout):
    """``wait`` over refs and ``ObjectRefGenerator``s (Ray 2.60 takes both): a generator
    is ready once its next item, or its end, is there. Returns the ready positions."""
    import time

    deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
    delay = 0.001
    while True:
        plain = [i for i, r in enumerate(refs) if isinstance(r, ObjectRef)]
        ready = set()
        if plain:
            at = _tpuray.wait([refs[i]._core for i in plain], len(plain), 0)
            ready.update(plain[j] for j in at)
        ready.update(
            i for i, r in enumerate(refs) if isinstance(r, ObjectRefGenerator) and r._next_ready()
        )
        if len(ready) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            return sorted(ready)[:num_returns]
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def wait(refs, *, num_returns=1, timeout=None, fetch_local=True):
    auto_init()
    if isinstance(refs, (ObjectRef, ObjectRefGenerator)):
        raise TypeError(
            f"wait() expected a list of ray.ObjectRef or ray.ObjectRefGenerator, got a single "
            f"{type(refs).__name__}"
        )
    refs = list(refs)
    if num_returns <= 0:
        raise ValueError("Invalid number of objects to return %d." % num_returns)
    if num_returns > len(refs):
        raise ValueError("num_returns cannot be greater than the number of objects provided.")
    if any(isinstance(r, ObjectRefGenerator) for r in refs):
        for r in refs:
            if not isinstance(r, (ObjectRef, ObjectRefGenerator)):
                raise TypeError(
                    f"wait() expected a list of ObjectRef or ObjectRefGenerator, got "
                    f"{type(r).__name__}"
                )
        ready_at = _wait_with_generators(refs, num_returns, timeout)
        ready = [refs[i] for i in ready_at]
        taken = set(ready_at)
        return ready, [r for i, r in enumerate(refs) if i not in taken]
    try:
        cores = [r._core for r in refs]
    except AttributeError:
        bad = next(r for r in refs if not isinstance(r, ObjectRef))
        raise TypeError(f"wait() expected a list of ObjectRef, got {type(bad).__name__}") from None
    # The positions of the ready refs, in order (the core also refuses duplicates).
    ready_at = _tpuray.wait(cores, num_returns, timeout)
    ready = [refs[i] for i in ready_at]
    not_ready = []
    start = 0
    for i in ready_at:
        not_ready += refs[start:i]
        start = i + 1
    not_ready += refs[start:]
    return ready, not_ready


# ---- the worker side ----


def current_task_id():
    info = _async_call.get()
    if info is not None:
        return info["task_id"]
    return getattr(_task_context, "task_id", None)


def current_placement_group_id():
    pg = getattr(_task_context, "placement_group_id", None)
    if pg is None and runtime is not None and runtime.actor is not None:
        return runtime.actor_pg  # an actor's method: the group the actor was placed in
    return pg


def current_capture_group():
    """The placement group (hex id) that what the running task or actor creates without
    a strategy goes to (``placement_group_capture_child_tasks``), or None."""
    if state.mode != "worker" or runtime is None:
        return None
    pg = getattr(_task_context, "placement_group_id", None)
    capture = getattr(_task_context, "capture_child_tasks", False)
    if pg is None and runtime.actor is not None:
        pg, capture = runtime.actor_pg, runtime.actor_capture
    return pg if (pg and capture) else None


def is_canceled() -> bool:
    """Whether the task or sync actor method running on this thread was cancelled
    (Ray's ``RuntimeContext.is_canceled``).

    Raises:
        RuntimeError: in a driver, or in an async actor (Ray's texts).
    """
    if state.mode != "worker":
        raise RuntimeError(
            f"This method is only available when the process is a worker. Current mode: {state.mode}"
        )
    if runtime is not None and runtime.loop is not None and runtime._wake_read >= 0:
        raise RuntimeError("This method is not supported in an async actor.")
    task_id = getattr(_task_context, "task_id", None)
    return bool(task_id) and _tpuray.is_cancelled(task_id)


def current_task_info():
    """The info dict (``tpuray::foreign::TaskInfo``) of the task this thread runs, or
    None (a driver, or between tasks)."""
    info = _async_call.get()
    if info is not None:
        return info
    if getattr(_task_context, "task_id", None) is None:
        return None
    return getattr(_task_context, "info", None)


#: ``_failure``'s default: the retry filter of the arguments this thread decoded last.
_FROM_CONTEXT = object()

#: This worker process's :class:`WorkerRuntime` (None in a driver).
runtime = None


class ActorExit(SystemExit):
    """Raised by ``exit_actor()`` in a sync actor's method (a ``SystemExit``, as Ray
    raises): the runtime that catches it ends the actor instead of answering."""


def _is_actor_exit(e: BaseException) -> bool:
    return isinstance(e, (ActorExit, exceptions.AsyncioActorExit))


class WorkerRuntime:
    """What a Python worker process hands the core: runs tasks, the actor's constructor
    and its methods. Answers ``("ok", [bytes...], [refs...])`` or ``("err", message,
    pickled exception)``."""

    def __init__(self):
        self.actor = None
        self.actor_id = ""
        self.actor_resources: list = []
        self.loop = None
        self.loop_lock = threading.Lock()
        self._wake_read = -1
        self._async_tasks: set = set()
        self._current_task = None
        # Cancellation (Ray's ray.cancel): the thread of each running task, and the
        # asyncio task of each running async method, by task id.
        self._cancel_lock = threading.Lock()
        self._threads: dict = {}
        self._async_by_id: dict = {}
        # The actor's placement group (hex) and whether it captures what it creates.
        self.actor_pg = None
        self.actor_capture = False

    def _event_loop(self):
        import asyncio  # only async actors need it (and it is slow to import)

        with self.loop_lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, daemon=True, name="tpuray-async").start()
            return self.loop

    def _enable_async_calls(self, methods) -> None:
        """Has the core hand calls of ``methods`` (the actor's ``async def`` methods) to the
        event loop directly: an executor thread queues the call in the extension and waits
        there without the GIL; the loop, woken through a pipe, takes every queued call at
        once and runs each as a task that answers when it ends: no Python thread blocked per
        call, no GIL taken by the executor thread."""
        import asyncio

        loop = self._event_loop()
        self._current_task = asyncio.current_task
        r, w = os.pipe()
        os.set_blocking(r, False)
        self._wake_read = r
        ready = threading.Event()

        def register():
            loop.add_reader(r, self._take_async_calls)
            ready.set()

        loop.call_soon_threadsafe(register)
        ready.wait()
        _tpuray.enable_async_calls(sorted(methods), w)

    def _take_async_calls(self) -> None:
        # Runs on the loop thread.
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass
        for reply, name, num_returns, raw_args, task_id in _tpuray.take_async_calls():
            self._start_async_call(reply, name, num_returns, raw_args, task_id)

    def _start_async_call(self, reply, name, num_returns, raw_args, task_id="") -> None:
        # Runs on the loop thread: the coroutine starts as a task (so calls overlap) that
        # answers itself when it ends.
        retry_filter = None
        cls = type(self.actor).__name__
        # What get_runtime_context() names inside the call (the sync path's TaskInfo keys).
        token = _async_call.set({
            "task_id": task_id or None, "name": f"{cls}.{name}", "function": name,
            "class_name": cls, "actor_id": os.environ.get("TPURAY_ACTOR_ID", ""),
        })
        try:
            try:
                method = getattr(self.actor, name)
                args, kwargs, retry_filter = _decode(raw_args)
                result = method(*args, **kwargs)
                if not inspect.iscoroutine(result):
                    reply.send(self._returns(num_returns, result))
                    return
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                if _is_actor_exit(e):
                    self._exit_from_loop(reply)
                    return
                reply.send(self._failure(None, e, retry_filter))
                return
            # The loop holds tasks weakly: the set keeps a waiting one alive. The task
            # copies this context, so the coroutine sees this call's info.
            task = self.loop.create_task(
                self._answer(result, reply, num_returns, retry_filter, task_id)
            )
        finally:
            _async_call.reset(token)
        self._async_tasks.add(task)
        if task_id:
            with self._cancel_lock:
                self._async_by_id[task_id] = task

    async def _answer(self, coro, reply, num_returns, retry_filter, task_id=""):
        try:
            answer = self._returns(num_returns, await coro)
        except BaseException as e:  # noqa: BLE001 - cancellation and failures alike
            if _is_actor_exit(e):
                self._exit_from_loop(reply)
                return
            answer = self._failure(None, e, retry_filter)
        finally:
            self._async_tasks.discard(self._current_task())
            if task_id:
                with self._cancel_lock:
                    self._async_by_id.pop(task_id, None)
        reply.send(answer)

    def cancel_task(self, task_id: str) -> None:
        """``ray.cancel`` without force reaching this worker (the core calls it): a
        running async method's asyncio task is cancelled; a running task gets
        ``KeyboardInterrupt`` raised in its thread (Ray's behaviour). A sync actor
        method is not interrupted: it sees ``get_runtime_context().is_canceled()``."""
        with self._cancel_lock:
            task = self._async_by_id.get(task_id)
            if task is not None and self.loop is not None:
                self.loop.call_soon_threadsafe(task.cancel)
                return
            entry = self._threads.get(task_id)
            if entry is not None and self.actor is None:
                import ctypes

                # Raised at the task's next bytecode (as Ray's, it does not cut a
                # blocking call such as time.sleep short).
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(entry), ctypes.py_object(KeyboardInterrupt)
                )

    def _enter_task(self, task_id) -> None:
        if task_id:
            with self._cancel_lock:
                self._threads[task_id] = threading.get_ident()

    def _leave_task(self, task_id) -> None:
        """Forgets the running task; a ``KeyboardInterrupt`` sent for it that has not
        fired yet is withdrawn, so it never reaches the thread's next task."""
        if not task_id:
            return
        with self._cancel_lock:
            if self._threads.pop(task_id, None) is not None and _tpuray.is_cancelled(task_id):
                import ctypes

                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(threading.get_ident()), None
                )

    def _run(self, info, fn, raw_args):
        _task_context.task_id = info["task_id"]
        _task_context.label = _label(info)
        _task_context.placement_group_id = info.get("placement_group_id") or None
        _task_context.capture_child_tasks = bool(info.get("capture_child_tasks"))
        self._enter_task(info["task_id"])
        _task_context.info = info
        try:
            args, kwargs = decode_args(raw_args)
            result = fn(*args, **kwargs)
            if inspect.iscoroutine(result):
                import asyncio

                result = asyncio.run_coroutine_threadsafe(result, self._event_loop()).result()
            return self._returns(info["num_returns"], result)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            if _is_actor_exit(e) and self.actor is not None:
                self.exit_actor()
            return self._failure(info, e)
        finally:
            self._leave_task(info["task_id"])
            # The thread (and its thread state) serves the next task too.
            _task_context.task_id = None
            _task_context.retry_filter = None
            _flush_output()

    def _exit_from_loop(self, reply) -> None:
        """``exit_actor()`` in an async call: the call is never answered (a reply
        dropped would answer with an error, so it is kept), and the actor exits from
        another thread while the loop runs on."""
        self._unanswered = getattr(self, "_unanswered", []) + [reply]
        threading.Thread(target=self.exit_actor, daemon=True).start()

    def exit_actor(self) -> None:
        """Ends this actor for good (``exit_actor()``, ``__ray_terminate__``): runs the
        process's ``atexit`` handlers, sends what it printed, then has the head record it
        dead with no restart and stop this process (Ray's intended exit: the call that
        asked gets ``RayActorError``, as do the calls queued behind it). Does not
        return."""
        import atexit

        try:
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001 - a failing handler does not stop the exit
            pass
        _flush_output()
        try:
            # The head marks the actor dead (intended: no restart) before its agent
            # stops this process, so no exit report can make it restart.
            _tpuray.kill_actor(
                self.actor_id, True,
                "the actor ended itself with exit_actor() (Ray's INTENDED_USER_EXIT)",
            )
        finally:
            os._exit(0)

    @staticmethod
    def _returns(n, result):
        """The answer for a call with ``n`` return values that returned ``result``:
        ``("ok", [bytes...], [refs...])``.

        Raises:
            ValueError: ``result`` does not match ``num_returns``.
            TypeError: a value cannot be pickled.
        """
        if inspect.isgenerator(result):
            # A generator with a fixed num_returns (Ray 2.60): each yield is one return.
            result = list(result)
            if len(result) != n:
                raise ValueError(
                    f"Task returned {len(result)} objects, but num_returns={n}."
                )
            if n == 1:
                result = result[0]
        if n == 1:
            data, refs = serialize(result)
            return ("ok", [data], refs)
        if not isinstance(result, (tuple, list)) or len(result) != n:
            raise ValueError(
                f"Task returned {type(result).__name__} but num_returns={n} "
                "expects a tuple or list of that many values"
            )
        out, nested = [], []
        for v in result:
            data, refs = serialize(v)
            out.append(data)
            nested.extend(refs)
        return ("ok", out, nested)

    @staticmethod
    def _failure(info, e, retry_filter=_FROM_CONTEXT):
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            payload = serialize(e)[0]
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            payload = b""
        # retry_exceptions=[...]: other exceptions are final.
        if retry_filter is _FROM_CONTEXT:
            retry_filter = getattr(_task_context, "retry_filter", None)
        no_retry = bool(retry_filter) and not isinstance(e, tuple(retry_filter))
        return ("err", tb, payload, no_retry)

    def run_task(self, info, raw_args):
        try:
            fn = load_function(info["function"])
        except BaseException as e:  # noqa: BLE001
            return self._failure(info, e)
        return self._run(info, fn, raw_args)

    def create_actor(self, info, raw_args):
        _task_context.task_id = info["task_id"]
        _task_context.label = info["class_name"]
        _task_context.info = info
        # An actor's methods hold what its creation asked for (Ray: the actor's
        # resources, {} for an actor given none).
        self.actor_resources = info.get("resources") or []
        self.actor_key = info["function"]
        _ActorLabel.name = info["class_name"]
        try:
            cls = load_function(info["function"])
            args, kwargs = decode_args(raw_args)
            self.actor = cls.__new__(cls)
            self.actor_id = os.environ.get("TPURAY_ACTOR_ID", "")
            self.actor_pg = info.get("placement_group_id") or None
            self.actor_capture = bool(info.get("capture_child_tasks"))
            init_result = self.actor.__init__(*args, **kwargs)
            if inspect.iscoroutine(init_result):
                import asyncio

                asyncio.run_coroutine_threadsafe(init_result, self._event_loop()).result()
            # Ray's prefix for an actor's lines is its __repr__ when its class defines
            # one ("Customizing prefixes for Actor logs"), else the class name.
            if type(self.actor).__repr__ is not object.__repr__:
                try:
                    _ActorLabel.name = repr(self.actor)
                except Exception:  # noqa: BLE001 - a failing __repr__ keeps the class name
                    pass
            async_methods = [
                name
                for name, m in inspect.getmembers(cls, predicate=inspect.isfunction)
                if inspect.iscoroutinefunction(m)
            ]
            if async_methods:
                self._enable_async_calls(async_methods)
            return ("ok", [], [])
        except BaseException as e:  # noqa: BLE001
            return self._failure(info, e)
        finally:
            # The thread (and its thread state) serves the next task too.
            _task_context.task_id = None
            _task_context.retry_filter = None
            _flush_output()

    def start_stream(self, info, raw_args):
        """Starts a streaming task or method: ``("ok", stream)`` whose ``next_item()``
        answers ``("item", bytes)``, ``("done",)`` or ``("err", message, payload)``."""
        try:
            if info["actor_id"]:
                fn = getattr(self.actor, info["function"])
            else:
                fn = load_function(info["function"])
            args, kwargs = decode_args(raw_args)
            _task_context.task_id = info["task_id"]
            _task_context.label = _label(info)
            _task_context.info = info
            gen = fn(*args, **kwargs)
            if inspect.isasyncgen(gen):
                # An async generator (an async actor's method): each item is produced on
                # the actor's event loop, as Ray runs them.
                return ("ok", _Stream(self, info, _AsyncItems(gen, self._event_loop())))
            if not inspect.isgenerator(gen):
                raise TypeError(
                    f"{info['name']} was called as a generator (num_returns=\"streaming\") "
                    f"but returned {type(gen).__name__}, not a generator"
                )
            return ("ok", _Stream(self, info, gen))
        except BaseException as e:  # noqa: BLE001
            return self._failure(info, e)

    def call_method(self, info, raw_args):
        name = info["function"]
        if name == "__tpuray_terminate__":
            # Ray's ``__ray_terminate__``: behind the caller's earlier calls (calls from one
            # caller run in order), the actor exits as ``exit_actor()`` makes it.
            self.exit_actor()
        if name == "__tpuray_ready__":
            return ("ok", [serialize(True)[0]], [])
        method = getattr(self.actor, name, None)
        if method is None:
            return self._failure(
                info, AttributeError(f"'{type(self.actor).__name__}' object has no attribute '{name}'")
            )
        return self._run(info, method, raw_args)


class _AsyncItems:
    """An async generator's items, each awaited on the actor's event loop from the
    executor thread that streams them."""

    def __init__(self, agen, loop):
        self._agen = agen
        self._loop = loop

    def __iter__(self):
        return self

    def __next__(self):
        import asyncio

        fut = asyncio.run_coroutine_threadsafe(self._agen.__anext__(), self._loop)
        try:
            return fut.result()
        except StopAsyncIteration:
            raise StopIteration from None
        except KeyboardInterrupt:
            # ray.cancel reached this thread: the generator's coroutine goes too.
            fut.cancel()
            raise


class _Stream:
    def __init__(self, runtime, info, it):
        self._runtime = runtime
        self._info = info
        self._it = it

    def next_item(self):
        _task_context.task_id = self._info["task_id"]
        _task_context.label = _label(self._info)
        _task_context.placement_group_id = self._info.get("placement_group_id") or None
        _task_context.capture_child_tasks = bool(self._info.get("capture_child_tasks"))
        _task_context.info = self._info
        task_id = self._info["task_id"]
        self._runtime._enter_task(task_id)
        try:
            value = next(self._it)
            return ("item", serialize(value)[0])
        except StopIteration:
            return ("done",)
        except BaseException as e:  # noqa: BLE001
            return self._runtime._failure(self._info, e)
        finally:
            self._runtime._leave_task(task_id)
            _task_context.task_id = None
            _flush_output()


class _ActorLabel:
    """The name an actor's printed lines carry (its class, or its ``__repr__``)."""

    name = ""


def _label(info) -> str:
    """The name a task's or actor call's printed lines carry: the actor's (its
    ``__repr__`` when its class defines one), else the class or function name."""
    if info["class_name"] and _ActorLabel.name:
        return _ActorLabel.name
    return info["class_name"] or info["name"]


class _Forwarder:
    """A worker's ``sys.stdout``/``sys.stderr``: writes to the worker's log file as before
    and sends each complete line to the job's driver with the name of the task or actor
    that printed it (the driver prefixes it as Ray does, ``(f pid=123)``, with
    ``ip=`` from another host, and deduplicates repeated lines: ``tpuray.logs``).
    Sending stops for good when the driver answers that it takes no worker output
    (``init(log_to_driver=False)``)."""

    #: Set by any write, cleared by :func:`_flush_output` before it flushes.
    written = False

    def __init__(self, inner, driver: str, is_err: bool):
        self._inner = inner
        self._driver: str | None = driver
        self._is_err = is_err
        self._partial = ""
        # (name, lines) in the order printed.
        self._batches: list[tuple[str, list[str]]] = []
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        _Forwarder.written = True
        self._inner.write(s)
        if self._driver is None:
            return len(s)
        with self._lock:
            text = self._partial + s
            *done, self._partial = text.split("\n")
            if done:
                label = getattr(_task_context, "label", None) or _ActorLabel.name or ""
                if self._batches and self._batches[-1][0] == label:
                    self._batches[-1][1].extend(done)
                else:
                    self._batches.append((label, done))
        return len(s)

    def flush(self) -> None:
        self._inner.flush()
        with self._lock:
            batches, self._batches = self._batches, []
        if batches and self._driver is not None:
            try:
                if not _tpuray.report_logs(self._driver, batches, self._is_err):
                    self._driver = None
            except RuntimeError:
                pass  # the driver is gone; the log file still has the lines

    def fileno(self) -> int:
        return self._inner.fileno()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _flush_output() -> None:
    if not _Forwarder.written:
        return  # nothing written since the last flush (most calls print nothing)
    _Forwarder.written = False
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, _Forwarder):
            stream.flush()


def _forward_output() -> None:
    driver = os.environ.get("TPURAY_DRIVER_ADDRESS")
    if not driver:
        return
    sys.stdout = _Forwarder(sys.stdout, driver, False)
    sys.stderr = _Forwarder(sys.stderr, driver, True)

    def pump():
        import time

        while True:
            time.sleep(0.1)
            _flush_output()

    threading.Thread(target=pump, daemon=True, name="tpuray-logs").start()


def worker_main() -> int:
    """Entry point of a Python worker process (``python -m tpuray._worker``)."""
    state.mode = "worker"
    state.connected = True
    state.namespace = os.environ.get("TPURAY_NAMESPACE") or None
    # The environment this worker runs in (its task's, else its job's): what tasks it
    # submits merge theirs over, as Ray's nested tasks inherit their parent's.
    raw = os.environ.get("TPURAY_RUNTIME_ENV") or os.environ.get("TPURAY_JOB_RUNTIME_ENV")
    if raw:
        try:
            state.runtime_env = json.loads(raw)
        except ValueError:
            state.runtime_env = None
    _forward_output()
    global runtime
    runtime = WorkerRuntime()
    return _tpuray.run_worker(runtime)


def process_info() -> dict:
    if not state.info:
        state.info = dict(_tpuray.process_info())
    return state.info
