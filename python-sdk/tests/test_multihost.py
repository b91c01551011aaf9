"""A cluster over several simulated hosts: drivers, objects, the cluster token, host
failures (partition, crash, freeze) and three heads.

Each host (``hosts.py``: a network namespace with its own 198.18 address, ``/dev/shm``,
``/tmp``, ``HOME`` and hostname) runs what a real machine would: ``tpuray start`` with no
``--node-ip-address`` (a head advertises its default-route interface, a node the address
that routes to its head), the cluster token copied from the head's home (or given as
``TPURAY_AUTH_TOKEN``), and drivers as ``python -c SCRIPT`` calling
``tpuray.init(address=HEAD)``. The README's "A cluster over several machines" and
ARCHITECTURE.md's NET-3 (addresses) and CORE-10 (owners acting on node deaths) are what
is checked.

- The non-destructive tests share one six-host cluster (``cluster``): ``host0`` head,
  ``host1`` a node, ``host2`` a node with a 64 MiB object store, ``host3`` no node (a
  driver only), ``host4``/``host5`` for the token tests.
- ``test_soft_node_affinity_...`` checks, on hosts of its own, what the failure tests'
  placement relies on: soft node affinity to a node that joined a moment ago.
- Each failure test makes its own hosts. The partition and freeze tests run the head with
  a 200 ms heartbeat and a 2 s death timeout; the crash test keeps the defaults (1 s / 5 s).
- A driver that outlives a fault talks with the test line by line: it prints
  ``TAG {json}`` lines and waits for a line on its stdin.

Every wait is bounded by a generous timeout; nothing here asserts how fast anything is.
Needs root (namespaces).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import queue
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hosts import Hosts

PORT = 6379
# The interpreter running the tests: the checkout (and its venvs) is shared with the hosts.
PY = sys.executable
CLI = [PY, "-m", "tpuray"]
#: Bound for one ``tpuray start`` (s).
START_TIMEOUT = 120
#: Bound for one driver run (s).
DRIVER_TIMEOUT = 240
#: Bound for any single condition the tests wait for (s).
WAIT = 60
#: Head environment for fast failure detection (most failure tests).
FAST = {"TPURAY_HEARTBEAT_INTERVAL_MS": "200", "TPURAY_NODE_DEATH_TIMEOUT_MS": "2000"}
#: ``--object-store-memory`` of the small store (host2 of the shared cluster).
SMALL_STORE = 64 << 20
#: Size of each object spilled from the small store.
SPILL_OBJECT = 24 << 20
SPILL_COUNT = 5
NETWORK = ipaddress.ip_network("198.18.0.0/15")


# ---------------------------------------------------------------------------------------
# Helpers: the CLI, tokens, processes of a host, drivers.


def tpuray(host, *args, env=None, timeout=60, check=True) -> subprocess.CompletedProcess:
    """``python -m tpuray ARGS`` in ``host``; raises with its output when it fails."""
    p = host.run(CLI + [str(a) for a in args], env=env, capture_output=True, text=True,
                 timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{host.name}: tpuray {' '.join(map(str, args))} exited {p.returncode}\n"
            f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
        )
    return p


def start_head(host, *extra, env=None) -> str:
    """``tpuray start --head`` in ``host``; returns the address it printed."""
    p = tpuray(host, "start", "--head", "--port", PORT, "--num-cpus", "2", *extra, env=env,
               timeout=START_TIMEOUT)
    m = re.search(r"tpuray head started at (\S+)", p.stdout)
    assert m, f"no address in the output of tpuray start --head:\n{p.stdout}\n{p.stderr}"
    assert m.group(1) == f"{host.address}:{PORT}", (
        f"the head on {host.name} advertises {m.group(1)}, not its eth0 address {host.address}"
    )
    return m.group(1)


def token_of(host) -> str:
    return (host.home / ".tpuray" / "auth_token").read_text().strip()


def put_token(host, token: str) -> None:
    """Writes ``token`` as ``host``'s ``~/.tpuray/auth_token`` (0600), as a user's scp would."""
    d = host.home / ".tpuray"
    d.mkdir(parents=True, exist_ok=True)
    f = d / "auth_token"
    f.write_text(token)
    f.chmod(0o600)


def start_node(host, address, *extra, env=None, check=True) -> subprocess.CompletedProcess:
    return tpuray(host, "start", "--address", address, "--num-cpus", "2", *extra, env=env,
                  timeout=START_TIMEOUT, check=check)


def list_json(host, kind, address, env=None, timeout=60) -> list[dict]:
    p = tpuray(host, "list", kind, "--format", "json", "--limit", "0", "--address", address,
               env=env, timeout=timeout)
    return json.loads(p.stdout)


def wait_for(what: str, fn, timeout: float = WAIT, every: float = 0.5):
    """Calls ``fn`` until it returns something truthy (returned) or ``timeout`` passes;
    the last exception ``fn`` raised, if any, is in the failure message."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - reported below when it never succeeds
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}"
                                 + (f" (last error: {last!r})" if last else ""))
        time.sleep(every)


def alive_nodes_at(host, address, ips, env=None) -> dict:
    """``{ip: node_id}`` once a node at every one of ``ips`` is ALIVE (``tpuray list nodes``)."""

    def check():
        rows = list_json(host, "nodes", address, env=env)
        alive = {r["address"].rsplit(":", 1)[0]: r["node_id"] for r in rows
                 if r["state"] == "ALIVE"}
        return alive if all(ip in alive for ip in ips) else None

    return wait_for(f"a live node at each of {sorted(ips)}", check)


def _netns(pid) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _stat(pid) -> tuple[str, int] | None:
    """``(state, ppid)`` of ``pid``, None when it is gone."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = s[s.rfind(")") + 2:].split()
    return rest[0], int(rest[1])


def _comm(pid) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def host_processes(host) -> dict[int, str]:
    """``{pid: command line}`` of every live process in ``host`` but its holders (the
    ``unshare`` and its ``sleep``). PIDs are the machine's: hosts share a PID namespace."""
    ns = _netns(host.pid)
    out = {}
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        pid = int(e)
        if pid == host.pid or _netns(pid) != ns:
            continue
        st = _stat(pid)
        if st is None or (st[1] == host.pid and _comm(pid) == "sleep"):
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        out[pid] = cmd.strip()[:200]
    return out


def exited(pid: int) -> bool:
    """``pid`` is gone, or is a zombie whose parent is PID 1 (this container's PID 1 does
    not reap orphans; such a zombie has exited and holds nothing). A zombie whose parent
    is another live process is NOT counted: its parent failed to reap it."""
    st = _stat(pid)
    return st is None or (st[0] == "Z" and st[1] == 1)


def find_files(root: Path, part: str) -> list[Path]:
    """Files under ``root`` with a folder named ``part`` in their path."""
    return [p for p in root.rglob("*") if p.is_file() and part in p.relative_to(root).parts]


@contextlib.contextmanager
def logs_on_failure(hs):
    """Prints every host's log tails when the body raises (pytest shows it)."""
    try:
        yield
    except BaseException:
        print(hs.log_tails(60))
        raise


class Driver:
    """A driver process in a host that prints ``TAG {json}`` lines and reads lines on
    its stdin; stdout and stderr are read by threads so neither pipe fills up."""

    def __init__(self, host, script: str, *args, env=None):
        self.host = host
        self.proc = host.popen([PY, "-c", script, *map(str, args)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True).start()

    def _pump(self, f, is_out):
        for line in f:
            (self.out if is_out else self.err).append(line.rstrip("\n"))
            if is_out:
                self.lines.put(line.rstrip("\n"))
        if is_out:
            self.lines.put(None)

    def tail(self) -> str:
        return ("--- driver stdout\n" + "\n".join(self.out[-40:])
                + "\n--- driver stderr\n" + "\n".join(self.err[-80:]))

    def expect(self, tag: str, timeout: float = DRIVER_TIMEOUT) -> dict:
        """The JSON of the next ``TAG ...`` line; fails when the driver exits first or
        none comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise AssertionError(f"no {tag} line from the driver on {self.host.name} "
                                     f"within {timeout:.0f} s\n{self.tail()}") from None
            if line is None:
                self.proc.wait(timeout=30)
                time.sleep(0.2)  # let the stderr thread finish
                raise AssertionError(
                    f"the driver on {self.host.name} exited ({self.proc.returncode}) before "
                    f"printing {tag}\n{self.tail()}")
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])

    def send(self, line: str = "go") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60) -> None:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the driver on {self.host.name} did not exit within "
                                 f"{timeout:.0f} s\n{self.tail()}") from None
        time.sleep(0.2)
        assert rc == 0, f"the driver on {self.host.name} exited {rc}\n{self.tail()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_driver(host, script: str, *args, env=None, timeout=DRIVER_TIMEOUT) -> dict:
    """Runs a one-shot driver in ``host``; returns the JSON of its ``RESULT`` line."""
    p = host.run([PY, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                 timeout=timeout)
    found = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and found, (
        f"the driver on {host.name} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n"
        f"--- stderr\n{p.stderr[-6000:]}"
    )
    return json.loads(found[-1][len("RESULT "):])


# Code every driver starts with.
PRELUDE = r'''
import hashlib, json, os, random, socket, sys, time
import tpuray as ray
from tpuray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def say(tag, **kw):
    print(tag + " " + json.dumps(kw), flush=True)


def here():
    ctx = ray.get_runtime_context()
    return {"hostname": socket.gethostname(), "node_id": ctx.get_node_id(), "pid": os.getpid()}


def node_at(ip):
    ids = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip]
    assert ids, f"no live node at {ip}: {ray.nodes()}"
    return ids[0]


def on(node_id, soft=False):
    return NodeAffinitySchedulingStrategy(node_id, soft=soft)


def blob(seed, size):
    return random.Random(seed).randbytes(size)


def sha(b):
    return hashlib.sha256(b).hexdigest()


def node_alive(node_id):
    return any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_id)


def until(what, fn, limit=120):
    deadline = time.time() + limit
    while True:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:
            err = e
        else:
            err = None
        if time.time() > deadline:
            raise TimeoutError(f"not within {limit} s: {what} ({err!r})")
        time.sleep(0.1)
'''


# ---------------------------------------------------------------------------------------
# The shared cluster: host0 head, host1 node, host2 node with a small store, host3 a
# driver only, host4/host5 for the token test.


@pytest.fixture(scope="module")
def cluster():
    with Hosts(6) as hs:
        try:
            head = hs[0]
            address = start_head(head)
            token = token_of(head)
            for h in hs.hosts[1:4]:
                put_token(h, token)
            start_node(hs[1], address)
            start_node(hs[2], address, "--object-store-memory", SMALL_STORE)
            alive_nodes_at(head, address, {hs[0].address, hs[1].address, hs[2].address})
            yield hs, address, token
        finally:
            print(hs.log_tails(60))


TOUR = PRELUDE + r'''
ray.init(address=sys.argv[1])
ctx = ray.get_runtime_context()
nodes = ray.nodes()


@ray.remote
def square(x):
    return x * x


@ray.remote
def where():
    return here()


@ray.remote
def digest(x):
    return here(), sha(x), len(x)


@ray.remote
class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n

    def where(self):
        return here()


squares = ray.get([square.remote(i) for i in range(20)], timeout=120)
payload = blob(11, 2 << 20)
ref = ray.put(payload)
assert ray.get(ref, timeout=60) == payload
small = ray.put({"k": [1, 2, 3]})
placed, actors, reads = {}, {}, {}
for n in nodes:
    if not n["Alive"]:
        continue
    ip, nid = n["NodeManagerAddress"], n["NodeID"]
    placed[ip] = ray.get(where.options(scheduling_strategy=on(nid)).remote(), timeout=120)
    c = Counter.options(scheduling_strategy=on(nid)).remote()
    total = ray.get([c.add.remote(k) for k in range(1, 5)], timeout=120)[-1]
    actors[ip] = {"total": total, "where": ray.get(c.where.remote(), timeout=60)}
    h, d, size = ray.get(digest.options(scheduling_strategy=on(nid)).remote(ref), timeout=120)
    reads[ip] = {"where": h, "ok": d == sha(payload) and size == len(payload)}
say("RESULT", node_id=ctx.get_node_id(), node_ip=ctx.get_node_ip_address(),
    squares_ok=squares == [i * i for i in range(20)], small=ray.get(small, timeout=60),
    nodes=[{k: n[k] for k in ("NodeID", "Alive", "NodeManagerAddress")} for n in nodes],
    placed=placed, actors=actors, reads=reads)
ray.shutdown()
'''


@pytest.mark.parametrize("where", [0, 1], ids=["head_host", "worker_host"])
def test_a_driver_on_a_node_host_runs_tasks_actors_and_objects_and_sees_every_node_at_its_address(
    cluster, where
):
    hs, address, _ = cluster
    host = hs[where]
    by_ip = {h.address: h for h in hs.hosts}
    with logs_on_failure(hs):
        r = run_driver(host, TOUR, address)
        nodes = r["nodes"]
        assert all(n["Alive"] for n in nodes), f"a node is not alive: {nodes}"
        ips = {n["NodeManagerAddress"] for n in nodes}
        assert {hs[0].address, hs[1].address, hs[2].address} <= ips, nodes
        assert all(ipaddress.ip_address(ip) in NETWORK for ip in ips), nodes
        id_at = {n["NodeManagerAddress"]: n["NodeID"] for n in nodes}
        # The driver attached to the node of its own host, at that host's address.
        assert r["node_ip"] == host.address, r
        assert r["node_id"] == id_at[host.address], r
        assert r["squares_ok"] and r["small"] == {"k": [1, 2, 3]}, r
        for ip, info in r["placed"].items():
            assert info["hostname"] == by_ip[ip].name and info["node_id"] == id_at[ip], (ip, info)
        for ip, a in r["actors"].items():
            assert a["total"] == 10, (ip, a)
            assert a["where"]["hostname"] == by_ip[ip].name, (ip, a)
        for ip, rd in r["reads"].items():
            assert rd["ok"] and rd["where"]["hostname"] == by_ip[ip].name, (ip, rd)


PRINTS = PRELUDE + r'''
ray.init(address=sys.argv[1])


@ray.remote
def shout(text):
    print(text, flush=True)
    return ray.get_runtime_context().get_task_id()


ids = {ip: ray.get(shout.options(scheduling_strategy=on(node_at(ip))).remote(f"hello from {ip}"),
                   timeout=120) for ip in sys.argv[2:]}
time.sleep(1.5)  # the lines travel to the driver in the background
say("RESULT", ids=ids)
ray.shutdown()
'''


def test_a_line_printed_on_another_host_reaches_the_driver_with_its_ip_and_tpuray_logs_reads_it_there(
    cluster,
):
    hs, address, _ = cluster
    head, other = hs[0], hs[1]
    with logs_on_failure(hs):
        p = head.run([PY, "-c", PRINTS, address, head.address, other.address],
                     capture_output=True, text=True, timeout=DRIVER_TIMEOUT)
        assert p.returncode == 0, p.stderr[-4000:]
        lines = p.stdout.splitlines()
        far, near = re.escape(other.address), re.escape(head.address)
        # Ray's prefix: ip= only for a line from a host other than the driver's.
        assert any(re.fullmatch(rf"\(shout pid=\d+, ip={far}\) hello from {far}", l) for l in lines), p.stdout
        assert any(re.fullmatch(rf"\(shout pid=\d+\) hello from {near}", l) for l in lines), p.stdout
        ids = json.loads([l for l in lines if l.startswith("RESULT ")][-1][len("RESULT "):])["ids"]
        # The task's part of its worker's log, read from the other host's agent through
        # the head (LOGS-3, LOGS-5).
        deadline = time.time() + WAIT
        while True:
            r = head.run(CLI + ["logs", "task", "--id", ids[other.address], "--address", address],
                         capture_output=True, text=True, timeout=WAIT)
            if r.returncode == 0 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert r.returncode == 0, r.stderr
        assert f"hello from {other.address}" in r.stdout, r.stdout
        assert f"hello from {head.address}" not in r.stdout, r.stdout


NO_NODE = PRELUDE + r'''
ray.init(address=sys.argv[1])
payload = blob(5, 1 << 20)
back = ray.get(ray.put(payload), timeout=60)


@ray.remote
def make(seed, size):
    return here(), blob(seed, size)


info, made = ray.get(make.remote(6, 1 << 20), timeout=120)
say("RESULT", put_ok=back == payload, task_ok=made == blob(6, 1 << 20), task_host=info["hostname"])
ray.shutdown()
'''


def test_a_driver_on_a_host_without_a_node_puts_gets_and_runs_a_task(cluster):
    hs, address, _ = cluster
    with logs_on_failure(hs):
        assert not host_processes(hs[3]), "host3 must run no node"
        r = run_driver(hs[3], NO_NODE, address)
        assert r["put_ok"], r
        assert r["task_ok"], r
        assert r["task_host"] in {hs[0].name, hs[1].name, hs[2].name}, r


DIRECTIONS = PRELUDE + r'''
ray.init(address=sys.argv[1])
nb, nc = node_at(sys.argv[2]), node_at(sys.argv[3])


@ray.remote
def echo(x):
    # Read on B, and a 2 MiB result made there (stored, not inline) for A to read.
    return here(), sha(x), x[::-1]


@ray.remote
def make(seed, size):
    return blob(seed, size)


@ray.remote
def digest(x):
    return here(), sha(x)


payload = blob(1, 2 << 20)
ref = ray.put(payload)
b_info, b_sha, back = ray.get(echo.options(scheduling_strategy=on(nb)).remote(ref), timeout=120)
made = make.options(scheduling_strategy=on(nb)).remote(2, 2 << 20)
ray.wait([made], timeout=120, fetch_local=False)
# C reads B's result first (only B has it), then A does.
c_info, c_sha = ray.get(digest.options(scheduling_strategy=on(nc)).remote(made), timeout=120)
a_value = ray.get(made, timeout=120)
expected = blob(2, 2 << 20)
say("RESULT", b_host=b_info["hostname"], b_read_ok=b_sha == sha(payload),
    back_ok=back == payload[::-1], c_host=c_info["hostname"], c_read_ok=c_sha == sha(expected),
    a_read_ok=a_value == expected)
ray.shutdown()
'''


def test_objects_move_between_hosts_in_every_direction(cluster):
    hs, address, _ = cluster
    with logs_on_failure(hs):
        r = run_driver(hs[0], DIRECTIONS, address, hs[1].address, hs[2].address)
        assert r["b_host"] == hs[1].name and r["b_read_ok"], f"put on A, read on B: {r}"
        assert r["back_ok"], f"made on B, read back on A: {r}"
        assert r["c_host"] == hs[2].name and r["c_read_ok"], f"made on B, read on C: {r}"
        assert r["a_read_ok"], f"made on B, read on A: {r}"


SPILL_PRODUCE = PRELUDE + r'''
ray.init(address=sys.argv[1])
small, count, size = node_at(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


@ray.remote
def make(seed, size):
    return here()["hostname"], blob(seed, size)


refs = [make.options(scheduling_strategy=on(small)).remote(100 + i, size) for i in range(count)]
ready, _ = ray.wait(refs, num_returns=count, timeout=180, fetch_local=False)
say("PRODUCED", ready=len(ready))
sys.stdin.readline()
ok = []
for i, r in enumerate(refs):
    host, value = ray.get(r, timeout=180)
    ok.append({"host": host, "exact": value == blob(100 + i, size)})
    del value
say("RESULT", ok=ok)
ray.shutdown()
'''

SPILL_PUT = PRELUDE + r'''
ray.init(address=sys.argv[1])
reader, count, size = node_at(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
me = ray.get_runtime_context().get_node_id()


@ray.remote
def digest(x):
    return here()["hostname"], sha(x), len(x)


refs, digests = [], []
for i in range(count):
    value = blob(200 + i, size)
    digests.append(sha(value))
    refs.append(ray.put(value))
    del value
say("PUT", node_id=me)
sys.stdin.readline()
ok = []
for r, d in zip(refs, digests):
    host, got, n = ray.get(digest.options(scheduling_strategy=on(reader)).remote(r), timeout=180)
    ok.append({"host": host, "exact": got == d and n == size})
say("RESULT", ok=ok)
ray.shutdown()
'''


def test_objects_spilled_by_a_host_with_a_small_store_are_read_back_byte_exact_elsewhere(cluster):
    """host2's store is 64 MiB; 5 x 24 MiB task results made there, then 5 x 24 MiB put
    by a driver there, must spill (to its /tmp); each is read back from another host."""
    hs, address, _ = cluster
    small = hs[2]
    with logs_on_failure(hs):
        # Task results made on host2, read by a driver on host0.
        d = Driver(hs[0], SPILL_PRODUCE, address, small.address, SPILL_COUNT, SPILL_OBJECT)
        try:
            assert d.expect("PRODUCED")["ready"] == SPILL_COUNT, d.tail()
            spilled = wait_for("spilled files on host2", lambda: find_files(small.tmp, "spill"))
            d.send()
            r = d.expect("RESULT")
            d.finish()
        finally:
            d.kill()
        assert spilled
        assert [o["host"] for o in r["ok"]] == [small.name] * SPILL_COUNT, r
        assert all(o["exact"] for o in r["ok"]), f"not byte-exact: {r}"
        # Objects put by a driver on host2, read by tasks on host1.
        d = Driver(small, SPILL_PUT, address, hs[1].address, SPILL_COUNT, SPILL_OBJECT)
        try:
            d.expect("PUT")
            wait_for("spilled files on host2", lambda: find_files(small.tmp, "spill"))
            d.send()
            r = d.expect("RESULT")
            d.finish()
        finally:
            d.kill()
        assert [o["host"] for o in r["ok"]] == [hs[1].name] * SPILL_COUNT, r
        assert all(o["exact"] for o in r["ok"]), f"not byte-exact: {r}"


def test_the_token_as_a_copied_file_or_in_the_environment_lets_a_host_join_a_wrong_one_is_refused(
    cluster,
):
    hs, address, token = cluster
    with logs_on_failure(hs):
        # host1 and host2 joined with the token copied as a file (the fixture); host1 also
        # reads the cluster's state with it.
        rows = list_json(hs[1], "nodes", address)
        alive = {r["address"].rsplit(":", 1)[0] for r in rows if r["state"] == "ALIVE"}
        assert {hs[1].address, hs[2].address} <= alive, rows
        # host4 has no token file: TPURAY_AUTH_TOKEN in its environment.
        env = {"TPURAY_AUTH_TOKEN": token}
        assert not (hs[4].home / ".tpuray" / "auth_token").exists()
        start_node(hs[4], address, env=env)
        alive_nodes_at(hs[4], address, {hs[4].address}, env=env)
        # host5 has a wrong token file: refused, saying it is the token.
        put_token(hs[5], secrets.token_hex(32))
        p = start_node(hs[5], address, check=False)
        said = (p.stdout + p.stderr)
        assert p.returncode != 0, f"a wrong token joined:\n{said}"
        assert "token" in said.lower(), f"the refusal does not name the token:\n{said}"
        # A wrong token in the environment is refused the same way.
        p = start_node(hs[5], address, env={"TPURAY_AUTH_TOKEN": secrets.token_hex(32)},
                       check=False)
        said2 = p.stdout + p.stderr
        assert p.returncode != 0, f"a wrong token joined:\n{said2}"
        assert "token" in said2.lower(), f"the refusal does not name the token:\n{said2}"
        rows = list_json(hs[0], "nodes", address)
        assert not any(r["address"].startswith(hs[5].address + ":") for r in rows), rows
        # And the CLI with a wrong token is refused too.
        p = tpuray(hs[5], "list", "nodes", "--address", address, check=False)
        assert p.returncode != 0 and "token" in (p.stdout + p.stderr).lower(), (
            p.stdout + p.stderr)
        print(f"refusal of a wrong token file:\n{said}\nof a wrong token in the env:\n{said2}")


JUST_JOINED = PRELUDE + r'''
ray.init(address=sys.argv[1])
ip = sys.argv[2]
# Waits for the node to join, then places work on it at once, as a script started
# right after `tpuray start` would.
node = until(f"a node at {ip}", lambda: node_at(ip), limit=120)


@ray.remote
def where():
    return here()["hostname"]


soft = ray.get(where.options(scheduling_strategy=on(node, soft=True)).remote(), timeout=120)
say("RESULT", soft=soft)
ray.shutdown()
'''


def test_soft_node_affinity_to_a_node_that_just_joined_runs_the_task_there():
    """Ray's soft affinity runs a task on the node named when it is alive and has the
    resources free, as a node that just joined has (AGENT-12: host0's agent may not have
    heard of it yet). The failure tests below place their work the same way."""
    with Hosts(2) as hs:
        with logs_on_failure(hs):
            address = start_head(hs[0])
            put_token(hs[1], token_of(hs[0]))
            d = Driver(hs[0], JUST_JOINED, address, hs[1].address)
            try:
                start_node(hs[1], address)
                r = d.expect("RESULT")
                d.finish()
            finally:
                d.kill()
            assert r["soft"] == hs[1].name, (
                f"a soft-affinity task for the node on {hs[1].name}, free and alive, ran on "
                f"{r['soft']}")


# ---------------------------------------------------------------------------------------
# Host failures: each test makes its own hosts. host0 runs the head and the driver,
# host1 a node, host2 the victim.


def three_host_cluster(hs, head_env=None) -> tuple[str, dict]:
    """Head on host0 (with ``head_env``), nodes on host1 and host2 (token copied as a
    file); returns the address and ``{ip: node_id}``."""
    address = start_head(hs[0], env=head_env)
    token = token_of(hs[0])
    for h in hs.hosts[1:]:
        put_token(h, token)
        start_node(h, address)
    ids = alive_nodes_at(hs[0], address, {h.address for h in hs.hosts})
    return address, ids


def node_row(host, address, node_id) -> dict:
    rows = list_json(host, "nodes", address)
    return next(r for r in rows if r["node_id"] == node_id)


VICTIM = PRELUDE + r'''
ray.init(address=sys.argv[1])
victim = node_at(sys.argv[2])
soft = on(victim, soft=True)
with_object, with_actor = sys.argv[3] == "1", sys.argv[4] == "1"


@ray.remote(max_retries=3, scheduling_strategy=soft)
def long_task():
    info = here()
    with open("/tmp/mh-long-task", "a") as f:  # this host's /tmp: the test sees where it ran
        f.write(json.dumps(info) + "\n")
    time.sleep(4)
    return info


@ray.remote(max_retries=3, scheduling_strategy=soft)
def make_object():
    info = here()
    with open("/tmp/mh-object", "a") as f:
        f.write(json.dumps(info) + "\n")
    return info, blob(3, 2 << 20)


@ray.remote(max_restarts=1, max_task_retries=-1, scheduling_strategy=soft)
class Pinger:
    def ping(self):
        return here()


obj = actor = first = None
if with_object:
    obj = make_object.remote()
    ready, _ = ray.wait([obj], timeout=120, fetch_local=False)
    assert ready, "the object was not made"
if with_actor:
    actor = Pinger.remote()
    first = ray.get(actor.ping.remote(), timeout=120)
task = long_task.remote()
say("READY", victim=victim, actor=first)
sys.stdin.readline()  # the fault is in place
t0 = time.time()
out = {"seconds": {}}
until("the victim reported dead", lambda: not node_alive(victim))
out["dead"] = True
out["seconds"]["dead"] = round(time.time() - t0, 1)
out["task"] = ray.get(task, timeout=180)
out["seconds"]["task"] = round(time.time() - t0, 1)
if with_object:
    info, value = ray.get(obj, timeout=180)
    out["object"] = {"made": info, "exact": value == blob(3, 2 << 20)}
    out["seconds"]["object"] = round(time.time() - t0, 1)


def answers():
    try:
        return ray.get(actor.ping.remote(), timeout=60)
    except ray.exceptions.GetTimeoutError:
        raise
    except Exception:
        return None


if with_actor:
    out["actor"] = until("the actor answers", answers, limit=180)
    out["seconds"]["actor"] = round(time.time() - t0, 1)
say("RECOVERED", **out)
sys.stdin.readline()  # the host is back
if with_actor:
    out["after"] = [ray.get(actor.ping.remote(), timeout=60) for _ in range(5)]
say("AFTER", **out)
ray.shutdown()
'''


def victim_ran(victim, marker: str) -> list[dict]:
    """What the driver's tasks wrote to ``/tmp/MARKER`` of ``victim`` (where they ran)."""
    f = victim.tmp / marker
    return [json.loads(l) for l in f.read_text().splitlines()] if f.exists() else []


def wait_started_on(hs, victim, marker: str) -> None:
    """Waits until the task that writes ``marker`` runs on ``victim``; the failure says
    where it ran instead."""
    try:
        wait_for(f"a task writing {marker} running on {victim.name}",
                 lambda: victim_ran(victim, marker))
    except AssertionError as e:
        ran = {h.name: victim_ran(h, marker) for h in hs.hosts}
        raise AssertionError(f"{e}; it ran on: {ran}") from None


def test_a_partitioned_host_is_declared_dead_its_work_recovers_and_once_healed_its_agent_exits():
    with Hosts(3) as hs:
        victim = hs[2]
        address, ids = three_host_cluster(hs, FAST)
        vid = ids[victim.address]
        d = Driver(hs[0], VICTIM, address, victim.address, 1, 1)
        try:
            ready = d.expect("READY")
            assert ready["victim"] == vid
            assert ready["actor"]["hostname"] == victim.name, ready
            old_actor_pid = ready["actor"]["pid"]
            made = victim_ran(victim, "mh-object")
            assert made and made[0]["node_id"] == vid, (
                f"the object was not made on the victim: {made}\n{d.tail()}")
            wait_started_on(hs, victim, "mh-long-task")
            agent_pid = node_row(hs[0], address, vid)["pid"]
            assert agent_pid and not exited(agent_pid), agent_pid

            victim.partition()
            cut = time.monotonic()
            d.send("cut")
            rec = d.expect("RECOVERED")
            print(f"recovered {time.monotonic() - cut:.1f} s after the cut (not asserted; "
                  f"each step, in order, from the driver's start: {rec['seconds']})")
            assert rec["dead"]
            assert rec["task"]["hostname"] != victim.name, f"task result from: {rec['task']}"
            assert rec["object"]["exact"], rec["object"]
            assert rec["object"]["made"]["hostname"] != victim.name, rec["object"]
            new = rec["actor"]
            assert new["hostname"] != victim.name and new["node_id"] != vid, new
            assert node_row(hs[0], address, vid)["state"] == "DEAD"

            victim.heal()
            healed = time.monotonic()
            # The healed agent learns it was declared dead and exits; meanwhile (and a
            # few seconds more) its node is never ALIVE again.
            states = []
            deadline = time.monotonic() + WAIT
            gone_at = None
            while True:
                row = node_row(hs[0], address, vid)
                states.append(row["state"])
                assert row["state"] == "DEAD", f"node {vid} came back after healing: {row}"
                if gone_at is None and exited(agent_pid):
                    gone_at = time.monotonic()
                    print(f"the healed agent exited {gone_at - healed:.1f} s after healing "
                          "(not asserted)")
                if gone_at is not None and time.monotonic() - gone_at > 3:
                    break
                assert time.monotonic() < deadline, (
                    f"the healed victim's agent (pid {agent_pid}, {_stat(agent_pid)}) did not "
                    f"exit within {WAIT} s; the host's processes: {host_processes(victim)}")
                time.sleep(0.5)
            rows = list_json(hs[0], "nodes", address)
            assert not any(r["state"] == "ALIVE" and r["node_id"] == vid for r in rows), rows
            # The old actor process went with its agent; one ALIVE instance, the new one.
            wait_for(f"the old actor process (pid {old_actor_pid}) exits",
                     lambda: exited(old_actor_pid))
            actors = [a for a in list_json(hs[0], "actors", address)
                      if a["class_name"].endswith("Pinger")]
            live = [a for a in actors if a["state"] == "ALIVE"]
            assert len(live) == 1, f"ALIVE Pinger instances: {actors}"
            assert live[0]["node_id"] == new["node_id"] and live[0]["pid"] == new["pid"], (
                live, new)
            d.send("healed")
            after = d.expect("AFTER")["after"]
            assert all(a["pid"] == new["pid"] and a["node_id"] == new["node_id"] for a in after), (
                f"calls after healing did not all go to the new instance {new}: {after}")
            d.finish()
        except BaseException:
            print(d.tail())
            raise
        finally:
            d.kill()


def test_a_crashed_host_running_a_task_is_declared_dead_and_the_task_is_retried_elsewhere():
    """On the default heartbeat interval and death timeout (1 s / 5 s)."""
    with Hosts(3) as hs:
        victim = hs[2]
        address, ids = three_host_cluster(hs)
        vid = ids[victim.address]
        d = Driver(hs[0], VICTIM, address, victim.address, 0, 0)
        try:
            d.expect("READY")
            wait_started_on(hs, victim, "mh-long-task")
            victim.crash()
            assert not host_processes(victim)
            d.send("crashed")
            rec = d.expect("RECOVERED")
            print(f"after the crash (not asserted): {rec['seconds']}")
            assert rec["dead"]
            assert rec["task"]["hostname"] != victim.name, rec
            row = node_row(hs[0], address, vid)
            assert row["state"] == "DEAD", row
            d.send("done")
            d.expect("AFTER")
            d.finish()
        except BaseException:
            print(d.tail())
            raise
        finally:
            d.kill()


def test_a_host_frozen_past_the_death_timeout_is_declared_dead_and_once_thawed_its_processes_exit():
    with Hosts(3) as hs:
        victim = hs[2]
        address, ids = three_host_cluster(hs, FAST)
        vid = ids[victim.address]
        d = Driver(hs[0], VICTIM, address, victim.address, 0, 1)
        try:
            ready = d.expect("READY")
            assert ready["actor"]["hostname"] == victim.name, ready
            wait_started_on(hs, victim, "mh-long-task")
            victim.freeze()
            frozen = host_processes(victim)
            agent_pid = node_row(hs[0], address, vid)["pid"]
            assert agent_pid in frozen, (agent_pid, frozen)
            d.send("frozen")
            rec = d.expect("RECOVERED")
            print(f"after the freeze (not asserted): {rec['seconds']}")
            assert rec["dead"]
            assert rec["task"]["hostname"] != victim.name, rec
            assert rec["actor"]["hostname"] != victim.name, rec
            victim.thaw()

            # Every process that was frozen there (agent, its workers) exits; the node
            # is never ALIVE again.
            def all_exited():
                assert node_row(hs[0], address, vid)["state"] == "DEAD", "the node came back"
                return all(exited(p) for p in frozen)

            try:
                wait_for("every process of the thawed host exits", all_exited)
            except AssertionError as e:
                left = {p: (frozen[p], _stat(p)) for p in frozen if not exited(p)}
                raise AssertionError(f"{e}; left (pid: cmd, (state, ppid))): {left}") from None
            assert not host_processes(victim), host_processes(victim)
            d.send("thawed")
            after = d.expect("AFTER")["after"]
            assert all(a["pid"] == rec["actor"]["pid"] for a in after), (rec["actor"], after)
            d.finish()
        except BaseException:
            print(d.tail())
            raise
        finally:
            d.kill()


# ---------------------------------------------------------------------------------------
# Three heads (Raft) on three hosts and a node on a fourth.

HA_PORT = 7001
LEADER = re.compile(r"Head replicas \(leader: (\d+) at (\S+), term (\d+)\)")

HA_DRIVER = PRELUDE + r'''
ray.init(address=sys.argv[1])


@ray.remote
class Keeper:
    def __init__(self):
        self.v = 0

    def incr(self):
        self.v += 1
        return self.v, here()


@ray.remote
def add(a, b):
    return a + b, here()


k = Keeper.remote()
calls = [ray.get(k.incr.remote(), timeout=120) for _ in range(3)]
s, where = ray.get(add.remote(2, 3), timeout=120)
say("RESULT", counts=[c[0] for c in calls], actor_host=calls[0][1]["hostname"], sum=s,
    task_host=where["hostname"])
ray.shutdown()
'''


def leader_of(host, addresses: str):
    """``(id, address, replica lines)`` of the leader `tpuray status` names, when it
    names one that says it is serving; else None."""
    p = tpuray(host, "status", "--address", addresses, timeout=60, check=False)
    m = LEADER.search(p.stdout)
    if p.returncode != 0 or not m:
        return None
    rows = [l for l in p.stdout.splitlines() if l.startswith(f" {m.group(1)} ")]
    if not any("leader, serving" in l for l in rows):
        return None
    return int(m.group(1)), m.group(2), p.stdout


def test_three_heads_on_three_hosts_elect_a_new_leader_when_the_leader_host_is_cut_off():
    with Hosts(4) as hs:
        heads, worker = hs.hosts[:3], hs[3]
        with logs_on_failure(hs):
            token = secrets.token_hex(32)
            for h in hs.hosts:
                put_token(h, token)
            peers = ",".join(f"{h.address}:{HA_PORT}" for h in heads)
            # All three at once: a head serves only once a majority is up.
            procs = [
                h.popen(CLI + ["start", "--head", "--head-only", "--head-peers", peers,
                               "--head-id", str(i + 1), "--head-data-dir", "/tmp/head-data",
                               "--port", str(HA_PORT)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i, h in enumerate(heads)
            ]
            for h, p in zip(heads, procs):
                try:
                    out, err = p.communicate(timeout=START_TIMEOUT)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, err = p.communicate()
                assert p.returncode == 0, f"head on {h.name}: {p.returncode}\n{out}\n{err}"
            start_node(worker, peers)
            alive_nodes_at(worker, peers, {worker.address})
            lead_id, lead_addr, text = wait_for("a leader", lambda: leader_of(worker, peers))
            old = next(h for h in heads if lead_addr == f"{h.address}:{HA_PORT}")
            assert heads.index(old) + 1 == lead_id, text
            others = ",".join(f"{h.address}:{HA_PORT}" for h in heads if h is not old)

            old.partition()
            t0 = time.monotonic()
            new_id, new_addr, text = wait_for(
                "a new leader among the other two",
                lambda: (lambda r: r if r and r[0] != lead_id else None)(leader_of(worker, others)))
            assert new_addr != lead_addr, text
            print(f"new leader {new_id} seen {time.monotonic() - t0:.1f} s after the cut "
                  "(not asserted)")
            # The cluster serves: a driver on the node's host (given all three heads)
            # creates an actor and runs a task.
            r = run_driver(worker, HA_DRIVER, peers)
            assert r["counts"] == [1, 2, 3] and r["sum"] == 5, r
            assert r["actor_host"] == worker.name and r["task_host"] == worker.name, r
            rows = list_json(worker, "nodes", peers)
            assert any(x["state"] == "ALIVE" and x["address"].startswith(worker.address + ":")
                       for x in rows), rows
            # The cut-off old leader stops serving: asked alone, from its own host.
            t0 = time.monotonic()
            p = tpuray(old, "list", "nodes", "--format", "json", "--address", lead_addr,
                       timeout=120, check=False)
            print(f"the old leader's answer took {time.monotonic() - t0:.1f} s (not asserted)")
            said = p.stdout + p.stderr
            assert p.returncode != 0 or "leader" in said.lower(), (
                f"the cut-off old leader still answers:\n{said}")
            print(f"the cut-off old leader ({lead_addr}) answered rc={p.returncode}:\n{said}")
