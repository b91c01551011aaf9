"""tpuray.cluster_utils.Cluster (Ray's ray.cluster_utils.Cluster): what the compat
recording (compat/cluster_utils_basic.py) does not show: refused arguments, a node that
dies without remove_node, and nothing left running or pointing at the cluster after
shutdown."""

import os
import subprocess
import sys

import pytest

from tpuray.cluster_utils import Cluster


def test_arguments_tpuray_nodes_do_not_take_are_refused_by_name():
    with pytest.raises(RuntimeError, match="Cannot connect to uninitialized cluster"):
        Cluster(connect=True, shutdown_at_exit=False)
    c = Cluster(shutdown_at_exit=False)
    try:
        with pytest.raises(ValueError, match="_system_config"):
            c.add_node(_system_config={"x": 1})
        c.add_node(num_cpus=0)
        with pytest.raises(ValueError, match="dashboard_port is for the head node only"):
            c.add_node(dashboard_port=0)
        with pytest.raises(ValueError, match="labels must be a dict"):
            c.add_node(labels="zone=a")
    finally:
        c.shutdown()


def test_a_killed_node_fails_wait_for_nodes_and_shutdown_leaves_nothing(tmp_path):
    # A process of its own: the suite's session driver (conftest's `cluster`) must neither
    # be reused by connect() (ignore_reinit_error, as Ray's) nor shut down here.
    script = tmp_path / "killed_node.py"
    script.write_text(KILLED_NODE)
    env = {k: v for k, v in os.environ.items() if k not in ("TPURAY_ADDRESS", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


KILLED_NODE = r"""
import os, signal, time

import tpuray
from tpuray.cluster_utils import Cluster, _alive


def alive_ids():
    return {n["NodeID"] for n in tpuray.nodes() if n["Alive"]}


def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[19])
    except OSError:
        return -1


before = {k: os.environ.get(k) for k in ("TPURAY_ADDRESS", "TPURAY_REGISTRY_DIR")}
c = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 0},
            shutdown_at_exit=False)
try:
    assert os.environ["TPURAY_ADDRESS"] == c.address
    node = c.add_node(num_cpus=1, resources={"w": 1}, labels={"zone": "z"})
    c.wait_for_nodes()

    @tpuray.remote(resources={"w": 1})
    def where():
        return tpuray.get_runtime_context().get_node_id(), os.getpid()

    node_id, worker_pid = tpuray.get(where.remote(), timeout=120)
    assert node_id == node.node_id
    labels = {n["NodeID"]: n.get("Labels", {}) for n in tpuray.nodes()}
    assert labels[node.node_id].get("zone") == "z", labels
    # Lost without remove_node: once the head stops counting it, the cluster's count no
    # longer matches (Ray's rule).
    agent = [e for e in node._entries(c._registry) if e["kind"] == "agent"][0]
    os.kill(agent["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and node.node_id in alive_ids():
        time.sleep(0.2)
    assert node.node_id not in alive_ids()
    try:
        c.wait_for_nodes(timeout=2)
        raise AssertionError("wait_for_nodes returned with a node lost")
    except TimeoutError as e:
        assert "Timed out while waiting for nodes to join" in str(e)
    c.remove_node(node, allow_graceful=False)  # its worker goes too
    c.wait_for_nodes(timeout=60)
    assert not _alive({"pid": worker_pid, "start_time": start_time(worker_pid)})
    assert c.remaining_processes_alive()
    entries = [e for n in c.list_all_nodes() for e in n._entries(c._registry)]
finally:
    c.shutdown()
assert not c.connected and not tpuray.is_initialized()
assert entries and not any(_alive(e) for e in entries)
assert not os.path.exists(c._dir)
assert {k: os.environ.get(k) for k in before} == before
print("ok")
"""
