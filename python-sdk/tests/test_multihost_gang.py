"""A slice gang across four simulated hosts running ``torch.distributed`` (gloo).

Five simulated hosts (``hosts.py``: network namespaces, each with its own 198.18 address,
``/dev/shm``, ``/tmp``, ``HOME`` and hostname): ``host0`` runs the head, ``host1..host4``
are the four TPU hosts of one simulated v6e-16 slice, each started exactly as TPU.md's
line (``TPU_*`` environment plus ``--resources '{"TPU": 4}'``) with the cluster token
copied from the head's home. A driver on ``host0`` calls ``run_on_slice``; every member
sets up a gloo process group from the gang environment alone (``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK``, ``NNODES``) and all-reduces its rank + 1. That only works
when ``MASTER_ADDR`` and ``TPU_WORKER_HOSTNAMES`` are addresses the other hosts can reach
(not 127.0.0.1), one member runs on each host, and the ranks agree. Needs root (the hosts)
and torch (``scripts/python-tests.sh`` installs the CPU build).
"""

from __future__ import annotations

import json
import sys
import time

from hosts import hosts_fixture

PORT = 6379
# The interpreter running the tests: the checkout (and its venvs) is shared with the hosts.
PY = sys.executable
#: Bound for one ``tpuray start`` (s).
START_TIMEOUT = 120
#: Bound for the whole driver run (s): four torch imports and a gloo rendezvous.
DRIVER_TIMEOUT = 420

five_hosts = hosts_fixture(5)

DRIVER = r"""
import json, sys
import tpuray as ray
from tpuray.util import tpu


@ray.remote
def member(head_ip):
    import os, socket
    import torch
    import torch.distributed as dist

    env = os.environ
    master, port = env["MASTER_ADDR"], env["MASTER_PORT"]
    rank, world = int(env["NODE_RANK"]), int(env["NNODES"])
    # The address this host reaches the head from: its own eth0 address.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((head_ip, 9))
    own = probe.getsockname()[0]
    probe.close()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://{master}:{port}")
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        reduced = t.item()
    finally:
        dist.destroy_process_group()
    return {
        "hostname": socket.gethostname(),
        "worker_id": int(env["TPU_WORKER_ID"]),
        "node_rank": rank,
        "nnodes": world,
        "master_addr": master,
        "master_port": port,
        "worker_hostnames": env["TPU_WORKER_HOSTNAMES"],
        "reduced": reduced,
        "address": own,
    }


head = sys.argv[1]
ray.init(head)
refs = tpu.run_on_slice(member, head.rsplit(":", 1)[0], topology="4x4", accelerator_version="v6e")
results = ray.get(refs, timeout=360)
print("RESULTS " + json.dumps(results), flush=True)
ray.shutdown()
"""


def _start(host, args, env=None):
    r = host.run([PY, "-m", "tpuray", "start", *args], env=env, capture_output=True, text=True,
                 timeout=START_TIMEOUT)
    assert r.returncode == 0, (
        f"tpuray start {args} on {host.name} failed ({r.returncode}):\n"
        f"{r.stdout}\n{r.stderr}\n{host.log_tails()}")
    return r.stdout + r.stderr


def test_run_on_slice_over_four_hosts_all_reduces_with_gloo_over_reachable_addresses(five_hosts):
    hs = five_hosts
    head, tpu_hosts = hs[0], hs.hosts[1:]
    t0 = time.monotonic()
    out = _start(head, ["--head", "--port", str(PORT), "--num-cpus", "1"])
    assert f"{head.address}:{PORT}" in out, f"the head does not advertise {head.address}: {out}"
    token = head.home / ".tpuray" / "auth_token"
    assert token.is_file(), f"no token at {token}"
    for w, h in enumerate(tpu_hosts):
        # The cluster token goes to every other host by file copy (0600), as a user would.
        (h.home / ".tpuray").mkdir(parents=True, exist_ok=True)
        dst = h.home / ".tpuray" / "auth_token"
        dst.write_bytes(token.read_bytes())
        dst.chmod(0o600)
        _start(h, ["--address", f"{head.address}:{PORT}", "--num-cpus", "1",
                   "--resources", json.dumps({"TPU": 4})],
               env={"TPU_ACCELERATOR_TYPE": "v6e-16", "TPU_NAME": "sa",
                    "TPU_WORKER_ID": str(w), "TPU_TOPOLOGY": "4x4"})
    started = time.monotonic() - t0

    r = head.run([PY, "-c", DRIVER, f"{head.address}:{PORT}"], capture_output=True, text=True,
                 timeout=DRIVER_TIMEOUT)
    ran = time.monotonic() - t0 - started
    print(f"cluster of 5 hosts started in {started:.1f}s, gang driver ran in {ran:.1f}s")
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULTS ")]
    assert r.returncode == 0 and lines, (
        f"driver failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-6000:]}\n{hs.log_tails()}")
    results = json.loads(lines[-1][len("RESULTS "):])

    by_name = {h.name: h for h in tpu_hosts}
    assert len(results) == 4, results
    # One member on each simulated TPU host, each reporting that host's own address.
    assert sorted(m["hostname"] for m in results) == sorted(by_name), results
    for m in results:
        assert m["address"] == by_name[m["hostname"]].address, m
    assert sorted(m["worker_id"] for m in results) == [0, 1, 2, 3], results
    ordered = sorted(results, key=lambda m: m["worker_id"])
    # Worker ids follow the TPU_WORKER_ID each host was started with.
    assert [m["hostname"] for m in ordered] == [h.name for h in tpu_hosts], ordered
    assert [m["node_rank"] for m in ordered] == [0, 1, 2, 3], ordered
    assert all(m["nnodes"] == 4 for m in results), results
    # MASTER_ADDR is worker 0's reachable address, the same for every member.
    w0 = ordered[0]["address"]
    assert w0.startswith("198.18.") and w0 != "127.0.0.1", w0
    for m in results:
        assert m["master_addr"] == w0, m
    assert len({m["master_port"] for m in results}) == 1, results
    # TPU_WORKER_HOSTNAMES: the four hosts' reachable addresses in worker-id order.
    want = ",".join(m["address"] for m in ordered)
    assert want == ",".join(h.address for h in tpu_hosts)
    for m in results:
        assert m["worker_hostnames"] == want, m
    # gloo all-reduced 1 + 2 + 3 + 4 across the four hosts.
    assert [m["reduced"] for m in results] == [10.0] * 4, results
