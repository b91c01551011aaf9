"""Object store bandwidth from the Python SDK: put and get of numpy arrays (100 MB and
800 MB by default), next to a plain numpy copy of the same array measured in the same
run; one client and 4 clients (actors, each its own process) putting at once; a second
node agent on this machine reading an object put on the first (pulled between the two
stores over gRPC).

Starts its own two-node cluster with the CLI (in a temp dir, with its own HOME) and
stops it at the end:

    .venv/bin/python bench/objects.py [SIZE_MB ...]

Figures are the median of ROUNDS rounds (default 5); bandwidths in GB/s (10^9 bytes/s),
get times in microseconds. `put` includes serialization (pickle protocol 5, the array
written straight into the store); `get` of a local object maps it and rebuilds the array
without copying, so its time does not depend on the size.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import tpuray as ray
from tpuray._private.build import require_optimized_build

ROUNDS = int(os.environ.get("ROUNDS", "5"))
CLIENTS = 4
MB = 1 << 20
CLI = [sys.executable, "-m", "tpuray"]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median_time(fn, rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@ray.remote(num_cpus=0)
class Putter:
    """One client: puts its own array `rounds` times (each ref dropped at once)."""

    def __init__(self, size: int):
        self.arr = np.full(size // 8, 3, dtype=np.int64)

    def ready(self) -> bool:
        return True

    def run(self, rounds: int) -> float:
        t = time.perf_counter()
        for _ in range(rounds):
            ref = ray.put(self.arr)
            del ref
        return time.perf_counter() - t


@ray.remote(num_cpus=0, resources={"other": 1})
class Reader:
    """On the second node: times a get of an object that lives on the first."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def fetch(self, box) -> float:
        (ref,) = box
        t = time.perf_counter()
        arr = ray.get(ref)
        dt = time.perf_counter() - t
        assert arr.nbytes > 0
        return dt


def bench_size(size: int) -> None:
    arr = np.full(size // 8, 7, dtype=np.int64)
    label = f"{size // MB} MB"

    # memcpy: into fresh memory (what a put into new store pages competes with) and into
    # memory already touched.
    fresh = median_time(lambda: arr.copy())
    dst = np.empty_like(arr)
    reused = median_time(lambda: np.copyto(dst, arr))
    del dst
    print(f"{label}: memcpy (numpy copy) {gbps(size, fresh):.2f} GB/s into new memory, "
          f"{gbps(size, reused):.2f} GB/s into reused memory", flush=True)

    def put_once():
        ref = ray.put(arr)
        del ref

    put_once()
    put = median_time(put_once)
    print(f"{label}: put, 1 client {gbps(size, put):.2f} GB/s "
          f"({100 * reused / put:.0f}% of memcpy into reused memory, "
          f"{100 * fresh / put:.0f}% of memcpy into new memory)", flush=True)

    ref = ray.put(arr)
    got = ray.get(ref)
    assert got.nbytes == size and not got.flags.writeable
    del got
    gets = []
    for _ in range(max(ROUNDS, 20)):
        t = time.perf_counter()
        got = ray.get(ref)
        gets.append(time.perf_counter() - t)
        del got
    print(f"{label}: get of a local object {statistics.median(gets) * 1e6:.0f} us "
          f"(median; min {min(gets) * 1e6:.0f} us), zero-copy", flush=True)
    del ref

    putters = [Putter.remote(size) for _ in range(CLIENTS)]
    ray.get([p.ready.remote() for p in putters])
    ray.get([p.run.remote(1) for p in putters])  # warm-up
    walls = []
    for _ in range(max(1, ROUNDS // 2)):
        t = time.perf_counter()
        ray.get([p.run.remote(2) for p in putters])
        walls.append(time.perf_counter() - t)
    wall = statistics.median(walls)
    print(f"{label}: put, {CLIENTS} clients at once {gbps(CLIENTS * 2 * size, wall):.2f} GB/s "
          f"aggregate", flush=True)
    for p in putters:
        ray.kill(p)
    del putters

    reader = Reader.remote()
    assert reader.node.remote() is not None
    here = ray.get_runtime_context().get_node_id()
    assert ray.get(reader.node.remote()) != here, "the reader must run on the second node"
    times = []
    for _ in range(ROUNDS):
        ref = ray.put(arr)
        times.append(ray.get(reader.fetch.remote([ref])))
        del ref
    ray.kill(reader)
    print(f"{label}: node-to-node get (pull into the second node's store) "
          f"{gbps(size, statistics.median(times)):.2f} GB/s", flush=True)


def main() -> None:
    require_optimized_build("bench/objects.py")
    sizes = [int(a) * MB for a in sys.argv[1:]] or [100 * MB, 800 * MB]
    tmp = tempfile.mkdtemp(prefix="tpuray-objbench-")
    env = dict(os.environ)
    env["HOME"] = os.path.join(tmp, "home")
    env["TPURAY_REGISTRY_DIR"] = os.path.join(tmp, "registry")
    env.pop("TPURAY_ADDRESS", None)
    os.makedirs(env["HOME"])
    os.environ.update({k: env[k] for k in ("HOME", "TPURAY_REGISTRY_DIR")})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    store = str(max(sizes) * (CLIENTS + 3))

    def start(args):
        subprocess.run(CLI + ["start", *args], env=env, check=True, capture_output=True,
                       timeout=120)

    try:
        start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2", "--object-store-memory", store,
               "--temp-dir", os.path.join(tmp, "head")])
        start(["--address", addr, "--num-cpus", "1", "--resources", '{"other": 1}',
               "--object-store-memory", store, "--temp-dir", os.path.join(tmp, "other")])
        ray.init(addr)
        for size in sizes:
            bench_size(size)
        ray.shutdown()
    finally:
        subprocess.run(CLI + ["stop"], env=env, capture_output=True, timeout=120)


if __name__ == "__main__":
    main()
