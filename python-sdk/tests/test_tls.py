"""Mutual TLS from Python (TLS-1..TLS-4): a driver with ``TPURAY_TLS_*`` runs tasks and
actors on a TLS cluster through the Rust core, ``JobSubmissionClient`` talks HTTPS to
its head with the CA and the driver's certificate, and a driver without them is refused
naming the mismatch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import CliCluster

DRIVER = r"""
import sys
import tpuray as ray
from tpuray.job_submission import JobSubmissionClient

ray.init(address=sys.argv[1])

@ray.remote
def square(x):
    return x * x

@ray.remote
class Counter:
    def __init__(self):
        self.n = 0
    def add(self, k):
        self.n += k
        return self.n

print("TASKS", ray.get([square.remote(i) for i in range(5)]))
c = Counter.remote()
ray.get(c.add.remote(2))
print("ACTOR", ray.get(c.add.remote(3)))
big = ray.put(b"x" * 2_000_000)
print("PUT", len(ray.get(big)))
client = JobSubmissionClient(sys.argv[1])
print("JOBS_URL", client.get_address())
print("JOBS", type(client.list_jobs()).__name__)
"""


def _cli(args, env):
    return subprocess.run([sys.executable, "-m", "tpuray", *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def tls_cluster(tmp_path):
    ca, node = tmp_path / "ca", tmp_path / "node"
    env = dict(os.environ)
    r = _cli(["tls", "make-ca", "--out", str(ca)], env)
    assert r.returncode == 0, r.stderr
    r = _cli(["tls", "make-cert", "--ca", str(ca), "--host", "node", "--out", str(node)], env)
    assert r.returncode == 0, r.stderr
    env.update({"TPURAY_TLS_CERT": str(node / "cert.pem"), "TPURAY_TLS_KEY": str(node / "key.pem"),
                "TPURAY_TLS_CA": str(ca / "ca.pem")})
    c = CliCluster(tmp_path, base_env=env).head(num_cpus=2)
    yield c
    c.stop()


def test_a_python_driver_runs_tasks_actors_and_jobs_over_tls(tls_cluster):
    r = subprocess.run([sys.executable, "-c", DRIVER, tls_cluster.address], env=tls_cluster.env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "TASKS [0, 1, 4, 9, 16]" in out, out
    assert "ACTOR 5" in out, out
    assert "PUT 2000000" in out, out
    assert "JOBS_URL https://127.0.0.1:" in out, out
    assert "JOBS list" in out, out


def test_a_plain_python_driver_is_refused_by_a_tls_cluster_naming_the_mismatch(tls_cluster):
    env = {k: v for k, v in tls_cluster.env.items() if not k.startswith("TPURAY_TLS_")}
    r = subprocess.run([sys.executable, "-c", DRIVER, tls_cluster.address], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    assert "TLS mismatch" in r.stderr and "uses TLS but this process is plain" in r.stderr, r.stderr
