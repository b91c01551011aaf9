"""One in-process cluster for the whole session: the Rust core starts once per process (as
Ray's ``init``), so every module that calls the API from the pytest process itself
(test_core, test_data) shares it through the ``cluster`` fixture. Modules that need a
cluster of another shape run their scripts in subprocesses."""

from __future__ import annotations

import os

import pytest

import tpuray as ray

#: CPUs of the shared in-process cluster.
CLUSTER_CPUS = 4


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    old = {k: os.environ.get(k) for k in ("HOME", "TPURAY_REGISTRY_DIR", "TPURAY_ADDRESS")}
    os.environ["HOME"] = str(home)
    os.environ["TPURAY_REGISTRY_DIR"] = str(home / "registry")
    os.environ.pop("TPURAY_ADDRESS", None)
    info = ray.init(num_cpus=CLUSTER_CPUS)
    yield info
    ray.shutdown()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class CliCluster:
    """A cluster started with the `tpuray` CLI in subprocesses, with its own HOME, registry
    and port; stop it with :meth:`stop`. ``env`` is the environment its drivers use."""

    CLI = None

    def __init__(self, tmp, base_env=None):
        import socket
        import sys

        CliCluster.CLI = [sys.executable, "-m", "tpuray"]
        self.tmp = tmp
        self.env = dict(base_env or os.environ)
        self.env["HOME"] = str(tmp / "home")
        self.env["TPURAY_REGISTRY_DIR"] = str(tmp / "registry")
        self.env.pop("TPURAY_ADDRESS", None)
        os.makedirs(self.env["HOME"], exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._nodes = 0

    def _start(self, args, extra_env=None):
        import subprocess

        e = dict(self.env)
        e.update(extra_env or {})
        r = subprocess.run(self.CLI + ["start", *args], env=e, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr

    def head(self, num_cpus: int = 1) -> "CliCluster":
        self._start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port), "--num-cpus", str(num_cpus),
                     "--temp-dir", str(self.tmp / "head")])
        return self

    def node(self, *args: str, env=None) -> "CliCluster":
        self._nodes += 1
        self._start(["--address", self.address, *args, "--temp-dir",
                     str(self.tmp / f"node{self._nodes}")], env)
        return self

    def tpu_slice(self, name: str, accelerator_type: str = "v6e-16", topology: str = "4x4",
                  hosts: int = 4, chips: int = 4) -> "CliCluster":
        """Simulated TPU hosts of one slice, started as TPU.md says (TPU_* env + chips)."""
        for w in range(hosts):
            self.node("--num-cpus", "1", "--resources", f'{{"TPU": {chips}}}', env={
                "TPU_ACCELERATOR_TYPE": accelerator_type, "TPU_NAME": name,
                "TPU_TOPOLOGY": topology, "TPU_WORKER_ID": str(w)})
        return self

    def stop(self) -> None:
        import subprocess

        subprocess.run(self.CLI + ["stop"], env=self.env, capture_output=True, timeout=120)
