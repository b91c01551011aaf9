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

    def get_worker_id(self) -> str:
        return worker.process_info()["worker_id"]

    def get_task_id(self):
        return worker.current_task_id()

    def get_actor_id(self):
        return os.environ.get("TPURAY_ACTOR_ID") or None

    def is_canceled(self) -> bool:
        """Whether ``ray.cancel`` was called on the running task or sync actor method
        (Ray's ``is_canceled``: a sync actor method is not interrupted, it checks this).

        Raises:
            RuntimeError: in a driver or an async actor (Ray's texts).
        """
        return worker.is_canceled()

    def get_placement_group_id(self):
        """The id (hex) of the placement group the current task runs in, or None."""
        return worker.current_placement_group_id()

    def get_node_ip_address(self) -> str:
        return worker.process_info()["agent_address"].rpartition(":")[0]

    def get_namespace(self):
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
        """Accelerator ids visible to this process: ``{"TPU": ["0", "1"], "GPU": [...]}``
        (from ``TPU_VISIBLE_CHIPS`` / ``CUDA_VISIBLE_DEVICES``, which the node agent sets)."""

        def ids(var):
            v = os.environ.get(var, "")
            return [x for x in v.split(",") if x] if v else []

        return {"TPU": ids("TPU_VISIBLE_CHIPS"), "GPU": ids("CUDA_VISIBLE_DEVICES")}

    def get_assigned_resources(self) -> dict:
        acc = self.get_accelerator_ids()
        out = {}
        if acc["TPU"]:
            out["TPU"] = float(len(acc["TPU"]))
        if acc["GPU"]:
            out["GPU"] = float(len(acc["GPU"]))
        return out

    def was_current_actor_reconstructed(self) -> bool:
        """Whether the current actor was restarted at least once (Ray's meaning: this
        process is not the actor's first); False outside an actor."""
        actor_id = self.get_actor_id()
        return bool(actor_id) and _tpuray.actor_record(actor_id)[2] > 0

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
    worker.check_connected()
    return RuntimeContext()
