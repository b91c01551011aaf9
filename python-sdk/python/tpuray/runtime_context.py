"""``get_runtime_context()`` (Ray's ``RuntimeContext``): who and where the caller is."""

from __future__ import annotations

import os

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
        return False


def get_runtime_context() -> RuntimeContext:
    worker.check_connected()
    return RuntimeContext()
