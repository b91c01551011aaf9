"""A cluster of several nodes on this one machine, for tests and benchmarks: Ray's
``ray.cluster_utils.Cluster`` (Ray 2.60, ``python/ray/cluster_utils.py``) with its
methods, arguments and defaults.

    from tpuray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    node = cluster.add_node(num_cpus=4, resources={"special": 1})
    cluster.wait_for_nodes()
    tpuray.init(address=cluster.address)
    ...
    cluster.remove_node(node)          # its agent and workers go, as a lost node
    cluster.shutdown()

Every node is a real node agent started by ``tpuray start`` (detached, as that command
starts them), with its own session folder under one
temporary folder of the cluster, all recorded in a process registry of the cluster's
own, so ``shutdown()`` and ``remove_node()`` stop exactly this cluster's processes and no
other cluster on the machine. As Ray's ``Cluster`` makes ``ray.init()`` connect to it (it
writes Ray's current-cluster file), starting the head sets ``TPURAY_ADDRESS`` and
``TPURAY_REGISTRY_DIR`` in this process's environment, so a plain ``tpuray.init()``, and
``tpuray`` commands run from here, reach this cluster; ``shutdown()`` puts them back.

Node arguments (``add_node(**node_args)``, ``head_node_args``) take Ray's names:
``num_cpus`` (default 1, as Ray's), ``num_gpus`` (default 0), ``resources``,
``object_store_memory`` (default 150 MiB, as Ray's), ``memory``, ``labels`` (a dict),
``node_ip_address`` (default 127.0.0.1) and, for the head, ``dashboard_port`` and
``dashboard_host``; ``metrics_export_port`` on any node. Any other is refused with a
``ValueError`` naming it (Ray's internal ``_system_config`` included).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

__all__ = ["Cluster", "ClusterNode"]

# Ray's defaults for every node a Cluster adds (``Cluster.add_node``).
_DEFAULTS = {"num_cpus": 1, "num_gpus": 0, "object_store_memory": 150 * 1024 * 1024}
_HEAD_ONLY = {"dashboard_port", "dashboard_host"}
_NODE_ARGS = {
    "num_cpus", "num_gpus", "resources", "object_store_memory", "memory", "labels",
    "node_ip_address", "metrics_export_port", *_HEAD_ONLY,
}
#: Bound for one ``tpuray start`` (s); it waits itself up to 45 s for its processes.
_START_TIMEOUT = 120

_HEAD_LINE = re.compile(r"^tpuray head started at (\S+) \(node ([0-9a-f]+)\)")
_NODE_LINE = re.compile(r"^tpuray node ([0-9a-f]+) joined the cluster at (\S+)")
_ADDR_LINE = re.compile(r"^\s+node address:\s+(\S+)")
_SESSION_LINE = re.compile(r"^\s+session folder:\s+(\S+)")


class ClusterNode:
    """One node of a :class:`Cluster` (what Ray's ``add_node`` returns, a
    ``ray._private.node.Node``): its ``node_id`` (hex, as ``tpuray.nodes()`` names it;
    ``unique_id`` is the same), ``node_ip_address``, ``address`` (its node agent's
    ``HOST:PORT``), ``gcs_address`` (the cluster head's), ``session_dir`` and whether it
    is the ``head``."""

    def __init__(self, node_id, node_ip_address, address, gcs_address, session_dir, head):
        self.node_id = node_id
        self.unique_id = node_id
        self.node_ip_address = node_ip_address
        self.address = address
        self.gcs_address = gcs_address
        self.session_dir = session_dir
        self.head = head

    def __repr__(self):
        kind = "head" if self.head else "worker"
        return f"ClusterNode({kind}, node_id={self.node_id!r}, address={self.address!r})"

    def _entries(self, registry: str) -> list[dict]:
        """The registry entries of this node's processes (its agent, workers and, for the
        head node, the head), live or not."""
        out: list[dict] = []
        try:
            names = os.listdir(registry)
        except OSError:
            return out
        for name in names:
            if not (name.startswith("proc-") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(registry, name)) as f:
                    e = json.load(f)
            except (OSError, ValueError):
                continue
            if e.get("session_dir") == self.session_dir:
                e["_file"] = os.path.join(registry, name)
                out.append(e)
        return out


def _alive(entry: dict) -> bool:
    """Whether the registered process still runs (same pid and start time, not a zombie)."""
    try:
        with open(f"/proc/{entry['pid']}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    # fields[0] is the state (field 3); fields[19] the start time (field 22).
    return fields[0] not in ("Z", "X") and int(fields[19]) == int(entry.get("start_time", -1))


class Cluster:
    """Ray's ``ray.cluster_utils.Cluster``: nodes on this machine added and removed one by
    one (see the module's docstring).

    :param initialize_head: start the head node at once (with ``head_node_args``).
    :param connect: with ``initialize_head``, ``tpuray.init`` to it at once.
    :param head_node_args: the head node's arguments (as :meth:`add_node` takes).
    :param shutdown_at_exit: stop every node when this process exits.
    :raises RuntimeError: ``connect`` without ``initialize_head`` (Ray's message).
    """

    def __init__(
        self,
        initialize_head: bool = False,
        connect: bool = False,
        head_node_args: Optional[dict] = None,
        shutdown_at_exit: bool = True,
    ):
        self.head_node: Optional[ClusterNode] = None
        self.worker_nodes: set[ClusterNode] = set()
        self.connected = False
        self._dir = tempfile.mkdtemp(prefix="tpuray-cluster-")
        self._registry = os.path.join(self._dir, "registry")
        self._saved_env: Optional[dict] = None
        self._count = 0
        if shutdown_at_exit:
            atexit.register(self.shutdown)
        if not initialize_head and connect:
            raise RuntimeError("Cannot connect to uninitialized cluster.")
        if initialize_head:
            self.add_node(**(head_node_args or {}))
            if connect:
                self.connect()

    @property
    def gcs_address(self) -> Optional[str]:
        """The head's ``HOST:PORT`` (``None`` before the head is added)."""
        return self.head_node.gcs_address if self.head_node else None

    @property
    def address(self) -> Optional[str]:
        """What ``tpuray.init(address=...)`` takes: the head's ``HOST:PORT``."""
        return self.gcs_address

    def _head_address(self) -> str:
        """The head's ``HOST:PORT``, for the steps that run once the head was added.

        :raises RuntimeError: the cluster has no head node yet.
        """
        if self.head_node is None:
            raise RuntimeError("Cluster: no head node yet (add_node() the head first)")
        return self.head_node.gcs_address

    def connect(self, namespace: Optional[str] = None):
        """``tpuray.init`` this process to the cluster as a driver.

        :raises AssertionError: no head yet, or already connected (as Ray's asserts).
        """
        import tpuray

        assert self.address is not None
        assert not self.connected
        info = tpuray.init(address=self.address, namespace=namespace, ignore_reinit_error=True)
        self.connected = True
        return info

    def _env(self) -> dict:
        env = dict(os.environ)
        env["TPURAY_REGISTRY_DIR"] = self._registry
        env.pop("TPURAY_ADDRESS", None)
        return env

    def add_node(self, wait: bool = True, **node_args) -> ClusterNode:
        """Starts a node (the head first) and returns it.

        :param wait: return once the node is registered with the head (``tpuray start``
            returns then anyway; kept for Ray's signature).
        :param node_args: the node's arguments (module docstring), over Ray's defaults.
        :raises ValueError: an argument tpuray's nodes do not take, named; a head-only one
            on a worker node.
        :raises RuntimeError: ``tpuray start`` failed (its output is in the message).
        """
        unknown = sorted(set(node_args) - _NODE_ARGS)
        if unknown:
            raise ValueError(
                f"Cluster.add_node: tpuray nodes do not take {', '.join(unknown)} "
                f"(they take {', '.join(sorted(_NODE_ARGS))})"
            )
        head = self.head_node is None
        if not head:
            extra = sorted(set(node_args) & _HEAD_ONLY)
            if extra:
                raise ValueError(f"Cluster.add_node: {', '.join(extra)} is for the head node only")
        a = {**_DEFAULTS, **node_args}
        ip = a.pop("node_ip_address", None) or "127.0.0.1"
        self._count += 1
        temp = os.path.join(self._dir, f"node{self._count}")
        args = ["start", "--node-ip-address", ip, "--temp-dir", temp]
        if head:
            args += ["--head", "--port", "0"]
        else:
            args += ["--address", self.gcs_address]
        for key, flag in (
            ("num_cpus", "--num-cpus"), ("num_gpus", "--num-gpus"), ("memory", "--memory"),
            ("object_store_memory", "--object-store-memory"),
            ("dashboard_port", "--dashboard-port"), ("dashboard_host", "--dashboard-host"),
            ("metrics_export_port", "--metrics-export-port"),
        ):
            v = a.get(key)
            if v is not None:
                args += [flag, str(int(v) if key in ("object_store_memory", "memory") else v)]
        if a.get("resources"):
            args += ["--resources", json.dumps(a["resources"])]
        if a.get("labels"):
            labels = a["labels"]
            if not isinstance(labels, dict):
                raise ValueError(f"Cluster.add_node: labels must be a dict, got {labels!r}")
            args += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        out = subprocess.run(
            [sys.executable, "-m", "tpuray", *args],
            env=self._env(), capture_output=True, text=True, timeout=_START_TIMEOUT,
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"Cluster.add_node: `tpuray {' '.join(args)}` failed:\n{out.stderr}{out.stdout}"
            )
        node = self._parse(out.stdout, ip, head)
        if head:
            self.head_node = node
            self._point_here()
        else:
            self.worker_nodes.add(node)
        return node

    def _parse(self, stdout: str, ip: str, head: bool) -> ClusterNode:
        node_id = gcs = address = session = None
        for line in stdout.splitlines():
            if m := _HEAD_LINE.match(line):
                gcs, node_id = m.group(1), m.group(2)
            elif m := _NODE_LINE.match(line):
                node_id, gcs = m.group(1), m.group(2)
            elif m := _ADDR_LINE.match(line):
                address = m.group(1)
            elif m := _SESSION_LINE.match(line):
                session = m.group(1)
        if not (node_id and gcs and session):
            raise RuntimeError(f"Cluster.add_node: cannot read `tpuray start`'s output:\n{stdout}")
        node = ClusterNode(node_id, ip, address, gcs, session, head)
        if address is None:  # the head's own node: its agent's address is in the registry
            agents = [e for e in node._entries(self._registry) if e.get("kind") == "agent"]
            node.address = agents[0]["address"] if agents else None
        return node

    def _point_here(self) -> None:
        """``tpuray.init()`` and ``tpuray`` commands from this process reach this cluster
        (Ray's ``Cluster`` writes its current-cluster file to the same end)."""
        ours = {"TPURAY_ADDRESS": self._head_address(), "TPURAY_REGISTRY_DIR": self._registry}
        self._saved_env = {k: (os.environ.get(k), v) for k, v in ours.items()}
        os.environ.update(ours)

    def _restore_env(self) -> None:
        for k, (before, ours) in (self._saved_env or {}).items():
            if os.environ.get(k) != ours:
                continue  # changed since by someone else: theirs stays
            if before is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = before
        self._saved_env = None

    def remove_node(self, node: ClusterNode, allow_graceful: bool = True) -> None:
        """Stops every process of ``node``: its agent first, then what is left of its
        workers (they exit with their agent) and, for the head node, the head, in the order
        Ray's ``Node.kill_all_processes`` kills the raylet first. Graceful (SIGTERM, as
        ``tpuray stop``: the agent drains for its grace period) when ``allow_graceful``,
        else SIGKILL at once (a node lost as a crash: a task running there with no retries
        left fails with ``NodeDiedError``, as in Ray).

        :raises ValueError: a node this cluster does not hold.
        :raises RuntimeError: a process that did not exit (named by pid).
        """
        if node is not self.head_node and node not in self.worker_nodes:
            raise ValueError(f"{node!r} is not a node of this cluster")
        entries = [e for e in node._entries(self._registry) if _alive(e)]
        rank = {"agent": 0, "worker": 1, "head": 2}
        left = []
        for kind in sorted({e.get("kind", "") for e in entries}, key=lambda k: rank.get(k, 3)):
            group = [e for e in entries if e.get("kind") == kind]
            sig = signal.SIGTERM if allow_graceful else signal.SIGKILL
            for e in group:
                try:
                    os.kill(e["pid"], sig)
                except ProcessLookupError:
                    pass
            left += self._wait_gone(group, 40.0 if allow_graceful else 10.0)
        for e in left:
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        stubborn = [e["pid"] for e in self._wait_gone(left, 10.0)]
        for e in node._entries(self._registry):
            if not _alive(e):
                try:
                    os.remove(e["_file"])
                except OSError:
                    pass
        if node is self.head_node:
            self.head_node = None
        else:
            self.worker_nodes.discard(node)
        if stubborn:
            raise RuntimeError(f"these processes of {node!r} did not exit: {stubborn}")

    @staticmethod
    def _wait_gone(entries: list[dict], timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        alive = list(entries)
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [e for e in alive if _alive(e)]
        return alive

    def _live_node_ids(self) -> set[str]:
        out = subprocess.run(
            [sys.executable, "-m", "tpuray", "list", "nodes", "--format", "json",
             "--address", self._head_address()],
            env=self._env(), capture_output=True, text=True, timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"Cluster: cannot list the nodes: {out.stderr.strip()}")
        rows = json.loads(out.stdout or "[]")
        return {r.get("node_id") for r in rows if r.get("state") == "ALIVE"}

    def wait_for_nodes(self, timeout: float = 30) -> None:
        """Waits until the head counts exactly as many live nodes as this cluster added
        and did not remove (Ray's rule: a node that died without ``remove_node`` makes
        this time out).

        :raises TimeoutError: Ray's message, after ``timeout`` seconds.
        """
        expected = {n.node_id for n in self.list_all_nodes()}
        deadline = time.monotonic() + timeout
        while self.head_node is not None and time.monotonic() < deadline:
            if self._live_node_ids() == expected:
                return
            time.sleep(0.1)
        raise TimeoutError("Timed out while waiting for nodes to join.")

    def list_all_nodes(self) -> list[ClusterNode]:
        """Every node added and not removed, the head first."""
        nodes = list(self.worker_nodes)
        return ([self.head_node] if self.head_node else []) + nodes

    def remaining_processes_alive(self) -> bool:
        """Whether every node's agent (and the head) still runs."""
        for node in self.list_all_nodes():
            kinds = {e.get("kind") for e in node._entries(self._registry) if _alive(e)}
            if "agent" not in kinds or (node.head and "head" not in kinds):
                return False
        return True

    def shutdown(self) -> None:
        """Disconnects this process's driver if :meth:`connect` made it, removes every
        node (workers first, then the head) and the cluster's folder."""
        if self.connected:
            import tpuray

            tpuray.shutdown()
            self.connected = False
        for node in list(self.worker_nodes):
            self.remove_node(node)
        if self.head_node is not None:
            self.remove_node(self.head_node)
        # Sweeps the object stores of agents that were killed (tpuray stop does).
        subprocess.run([sys.executable, "-m", "tpuray", "stop"], env=self._env(),
                       capture_output=True, timeout=120, check=False)
        self._restore_env()
        shutil.rmtree(self._dir, ignore_errors=True)
