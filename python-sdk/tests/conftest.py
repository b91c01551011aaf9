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
