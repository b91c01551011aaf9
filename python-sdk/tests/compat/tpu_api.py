"""ray.util.tpu on a cluster without TPUs: the arithmetic helpers, the node helpers,
this host's facts, and how slice reservations and run_on_slice fail (argument errors,
timeouts)."""

import os

import ray
from ray.util import tpu

ray.init(num_cpus=2)

# A TPU slice's environment in this driver only (after init: the cluster's processes do
# not see it), so Ray does not ask the GCE metadata server; this host has no chips, so it
# counts no workers.
os.environ.update({"TPU_NAME": "my-slice", "TPU_ACCELERATOR_TYPE": "v6e-16"})


def show(what, call, message=True):
    """What ``call`` returns or raises (the error's type, and its message unless it
    names things of this cluster or tpuray words it its own way)."""
    try:
        print(what, "->", call())
    except (ValueError, TypeError, TimeoutError, RuntimeError) as e:
        print(what, "->", type(e).__name__, e if message else "")


print("constants", tpu.DEFAULT_TPU_HEAD_RESERVATION_TIMEOUT_S)
for t in ["TPU-V6E", "v5litepod", "tpu7x", "V4", "v5p", "tpu-v5p", "h100"]:
    show(f"version of {t}", lambda t=t: tpu.get_tpu_version_from_type(t))

show("workers 4x4 v6e", lambda: tpu.get_tpu_worker_resources("4x4", "TPU-V6E"))
show("workers 2x4 v6e", lambda: tpu.get_tpu_worker_resources("2x4", "v6e"))
show("workers 2x2x4 v4 x2", lambda: tpu.get_tpu_worker_resources("2x2x4", "TPU-V4", num_slices=2))
show("workers TPU 1", lambda: tpu.get_tpu_worker_resources("4x4", "v6e", {"TPU": 1, "memory": 100}))
show("workers chips_per_vm 8", lambda: tpu.get_tpu_worker_resources("2x4", "v6e", chips_per_vm=4))
show("workers per chip 2", lambda: tpu.get_tpu_worker_resources("2x2x2", "v7x", tpu_resource_per_chip=2))
show("workers TPU 3", lambda: tpu.get_tpu_worker_resources("4x4", "v6e", {"TPU": 3}))
show("workers TPU 0", lambda: tpu.get_tpu_worker_resources("4x4", "v6e", {"TPU": 0}))
show("workers chips_per_vm 0", lambda: tpu.get_tpu_worker_resources("4x4", "v6e", chips_per_vm=0))
show("workers per chip 0", lambda: tpu.get_tpu_worker_resources("4x4", "v6e", tpu_resource_per_chip=0))
show("workers bad version", lambda: tpu.get_tpu_worker_resources("4x4", "v9"))

show("slices for 8 workers", lambda: tpu.get_tpu_num_slices_for_workers("4x4", "v6e", 8))
show("slices for 5 workers", lambda: tpu.get_tpu_num_slices_for_workers("4x4", "v6e", 5))
show("slices for 17 one-chip workers", lambda: tpu.get_tpu_num_slices_for_workers("4x4", "v6e", 17, {"TPU": 1}))
show("slices, no topology", lambda: tpu.get_tpu_num_slices_for_workers("", "v6e", 8))
show("slices, bad version", lambda: tpu.get_tpu_num_slices_for_workers("4x4", "v9", 8))

show("coordinator env", lambda: tpu.get_tpu_coordinator_env_vars("10.0.0.2", 2, 1))
show("coordinator env port", lambda: tpu.get_tpu_coordinator_env_vars("10.0.0.2", 4, 3, "9000"))

fake_nodes = [
    {"NodeID": "a", "Alive": True, "Labels": {"ray.io/tpu-slice-name": "s1"}},
    {"NodeID": "b", "Alive": False, "Labels": {"ray.io/tpu-slice-name": "s1"}},
    {"NodeID": "c", "Alive": True, "Labels": {"ray.io/tpu-slice-name": "s2"}},
    {"NodeID": "d", "Alive": True, "Labels": {}},
]
show("slice name of a", lambda: tpu.get_tpu_slice_name_from_node(fake_nodes[0]))
show("slice name of d", lambda: tpu.get_tpu_slice_name_from_node(fake_nodes[3]))
show("nodes of s1", lambda: [n["NodeID"] for n in tpu.get_tpu_nodes_for_slice("s1", fake_nodes)])
show("nodes of s1 in this cluster", lambda: tpu.get_tpu_nodes_for_slice("s1"))

show("pod name", tpu.get_current_pod_name)
show("pod worker count", tpu.get_current_pod_worker_count)
show("chips on this node", tpu.get_num_tpu_chips_on_node)
show("ready v6e 4x4 slices", lambda: tpu.get_num_ready_tpu_slices("4x4", "TPU-V6E"))
show("v6e 4x4 slices", lambda: tpu.get_num_tpu_slices("4x4", "TPU-V6E"))


@ray.remote
def member(*args, **kwargs):
    return args, kwargs


def not_remote():
    pass


show("run_on_slice plain function", lambda: tpu.run_on_slice(not_remote, topology="4x4", accelerator_version="v6e"), message=False)
show("run_on_slice no topology", lambda: tpu.run_on_slice(member, accelerator_version="v6e"))
show("run_on_slice slice_index without tpu_slice",
     lambda: tpu.run_on_slice(member, topology="4x4", accelerator_version="v6e", slice_index=0))
show("run_on_slice timeout",
     lambda: type(tpu.run_on_slice(member, 1, topology="4x4", accelerator_version="v6e",
                                   head_reservation_timeout_s=1, pg_ready_timeout_s=1)), message=False)
show("dispatch no topology", lambda: tpu.dispatch(member, accelerator_version="v6e"))
show("slice group timeout",
     lambda: type(tpu.SlicePlacementGroup("4x4", "v6e", head_reservation_timeout_s=1)), message=False)
show("slice_placement_group timeout",
     lambda: type(tpu.slice_placement_group("4x8", "v6e", head_reservation_timeout_s=1)), message=False)
show("slice_placement_group unknown keyword", lambda: tpu.slice_placement_group("4x4", "v6e", colour="red"), message=False)
show("slice group bad version", lambda: tpu.SlicePlacementGroup("4x4", "v9"), message=False)
show("slice group chips_per_vm 0", lambda: tpu.SlicePlacementGroup("4x4", "v6e", chips_per_vm=0))
print("no groups left", [g["state"] for g in ray.util.placement_group_table().values()
                         if g["state"] not in ("REMOVED",)])
ray.shutdown()
