"""``get_runtime_context()`` (Ray's ``RuntimeContext``): who and where the caller is."""

from __future__ import annotations

import json
import os

from tpuray import _tpuray
from tpuray._private import worker


class RuntimeContext:
    """Ids of the current job, node, worker, task and actor, and the resources and
    accelerator ids assigned to this process."""

    def get_job_id(self) -> str:
        return worker.process_info()["job_id"]

    def get_node_id(self) -> str:
        return worker.process_info()["node_id"]

    def get_task_id(self):
        """The current task's id (hex) in a worker; None in a driver (Ray's)."""
        return worker.current_task_id()

    def get_task_name(self):
        """The current task's name (its function's, ``Class.method`` for an actor call,
        or the ``name=`` option); None in a driver (Ray's)."""
        info = worker.current_task_info()
        return info["name"] if info else None

    def get_task_function_name(self):
        """The current task's function as ``module.qualname`` (Ray's
        ``get_task_function_name``: ``__main__.f``, ``__main__.Actor.method``); None in
        a driver."""
        info = worker.current_task_info()
        if not info:
            return None
        if info["actor_id"]:
            instance = getattr(worker.runtime, "actor", None)
            cls = type(instance) if instance is not None else None
            if cls is None:
                return info["name"]
            module = worker.function_module(worker.runtime.actor_key, cls)
            method = info["function"]
            if method == info["class_name"] or not method:
                method = "__init__"
            return f"{module}.{cls.__qualname__}.{method}"
        try:
            fn = worker.load_function(info["function"])
        except Exception:  # noqa: BLE001 - a name is still an answer
            return info["name"]
        module = worker.function_module(info["function"], fn)
        return f"{module}.{getattr(fn, '__qualname__', info['name'])}"

    def get_actor_id(self):
        """The current actor's id (hex), None outside an actor (Ray's)."""
        return os.environ.get("TPURAY_ACTOR_ID") or None

    def is_canceled(self) -> bool:
        """Whether ``ray.cancel`` was called on the running task or sync actor method
        (Ray's ``is_canceled``: a sync actor method is not interrupted, it checks this).

        Raises:
            RuntimeError: in a driver or an async actor (Ray's texts).
        """
        return worker.is_canceled()

    @property
    def task_id(self):
        return self.get_task_id()

    @property
    def actor_id(self):
        return self.get_actor_id()

    def get_placement_group_id(self):
        """The id (hex) of the placement group the current task runs in, or None."""
        return worker.current_placement_group_id()

    def get_node_ip_address(self) -> str:
        return worker.process_info()["agent_address"].rpartition(":")[0]

    def get_namespace(self):
        """The job's namespace (Ray's ``namespace``): the driver's, also inside an actor
        that lives in another namespace."""
        return worker.state.namespace or "default"

    @property
    def namespace(self):
        return self.get_namespace()

    @property
    def job_id(self):
        return self.get_job_id()

    @property
    def node_id(self):
        return self.get_node_id()

    def get_accelerator_ids(self) -> dict:
        """Accelerator ids visible to this process: ``{"GPU": [...], "TPU": ["0", "1"]}``,
        ids as strings (from ``CUDA_VISIBLE_DEVICES`` / ``TPU_VISIBLE_CHIPS``, which the
        node agent sets for the chips it assigned)."""

        def ids(var):
            v = os.environ.get(var, "")
            return [x for x in v.split(",") if x] if v else []

        return {"GPU": ids("CUDA_VISIBLE_DEVICES"), "TPU": ids("TPU_VISIBLE_CHIPS")}

    def get_resource_ids(self) -> dict:
        """Ray's older name of :meth:`get_accelerator_ids`."""
        return self.get_accelerator_ids()

    def get_assigned_resources(self) -> dict:
        """What the current task or actor holds, by plain resource name, as floats (Ray's:
        ``{"CPU": 1.0}`` for a default task, ``{}`` for an actor given no resources; a
        placement-group bundle's ``CPU_group_0_<id>`` is counted as ``CPU``).

        Raises:
            AssertionError: called in a driver (Ray's check)."""
        assert worker.state.mode == "worker", (
            "This method is only available when the process is a worker. Current mode: "
            f"{worker.state.mode}"
        )
        info = worker.current_task_info()
        if info is not None and not info["actor_id"]:
            pairs = info.get("resources") or []
        else:
            pairs = getattr(worker.runtime, "actor_resources", None) or []
        return {k: float(v) for k, v in pairs}

    @property
    def was_current_actor_reconstructed(self) -> bool:
        """Whether the current actor was restarted at least once (Ray's property: this
        process is not the actor's first).

        Raises:
            AssertionError: called outside an actor (Ray's check)."""
        actor_id = self.get_actor_id()
        assert actor_id, "This method should't be called inside Ray tasks."
        return _tpuray.actor_record(actor_id)[2] > 0

    def get_node_labels(self) -> dict:
        """The labels of this process's node (``tpuray start --labels`` and the ones
        tpuray sets, such as ``tpuray.io/...`` and ``ray.io/...`` TPU labels)."""
        node_id = self.get_node_id()
        for n in _tpuray.nodes():
            if n["NodeID"] == node_id:
                return dict(n["Labels"])
        return {}

    def get_worker_id(self) -> str:
        """This process's worker id (hex).

        Raises:
            RuntimeError: not initialised (Ray's)."""
        if not worker.is_initialized():
            raise RuntimeError(
                "Worker ID is not available because Ray has not been initialized."
            )
        return worker.process_info()["worker_id"]

    def get_actor_name(self):
        """The current actor's name, ``""`` for an unnamed actor, None outside an actor
        (as Ray's ``get_actor_name``)."""
        actor_id = self.get_actor_id()
        return _tpuray.actor_record(actor_id)[0] if actor_id else None

    @property
    def current_actor(self):
        """A handle to the current actor (Ray's ``current_actor``).

        Raises:
            RuntimeError: not called inside an actor (Ray's text)."""
        actor_id = self.get_actor_id()
        if not actor_id:
            raise RuntimeError("This method is only available in an actor.")
        import inspect

        from tpuray.actor import ActorHandle, _method_returns

        instance = getattr(worker.runtime, "actor", None)
        cls = type(instance) if instance is not None else None
        if cls is None:
            return ActorHandle(actor_id, "")
        methods = [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)]
        return ActorHandle(actor_id, cls.__name__, _method_returns(cls), 0, methods)

    def get_runtime_env_string(self) -> str:
        """The runtime environment this process runs in, as JSON (Ray's
        ``get_runtime_env_string``): a task's or actor's own, else its job's."""
        return json.dumps(worker.state.runtime_env or {})

    @property
    def runtime_env(self):
        """The runtime environment this process runs in, as a
        :class:`tpuray.runtime_env.RuntimeEnv` (Ray's ``runtime_env``)."""
        from tpuray.runtime_env import RuntimeEnv

        return RuntimeEnv.deserialize(self.get_runtime_env_string())

    @property
    def gcs_address(self) -> str:
        """The head's ``host:port`` (what Ray calls the GCS address)."""
        return worker.process_info()["head_address"]


def get_runtime_context() -> RuntimeContext:
    """The caller's :class:`RuntimeContext`; starts or joins a cluster first when none is
    connected (Ray's auto-init)."""
    worker.auto_init()
    return RuntimeContext()
