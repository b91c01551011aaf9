#!/usr/bin/env python3
"""Host loss on the multi-host harness, tpuray against Ray (issue: a silent host
recovered within 15 s).

Each round makes three simulated hosts (network namespaces, `python-sdk/tests/hosts.py`):
``host0`` runs the head and the driver, ``host1`` a worker node, ``host2`` the victim.
The driver puts three things on the victim (soft node affinity, so they may move):
a running task (5 s of work, ``max_retries=3``), the only copy of a 2 MiB task result,
and an actor (``max_restarts=1, max_task_retries=-1``). Then the victim's link is cut
(its processes keep running) and four times are measured from the cut, concurrently:

- ``dead``: the victim shows ``Alive: False`` in ``nodes()``;
- ``task``: the task's result is back (run again elsewhere);
- ``object``: the 2 MiB object is read back byte-exact (rebuilt from lineage);
- ``actor``: the actor answers a call again (restarted elsewhere).

Anything not done within ``--limit`` seconds (default 120) counts as the limit and is
marked with ``>``. Needs root (namespaces). The same driver code runs under both
systems (``import tpuray as ray`` or ``import ray``).

    python3 bench/host_failover.py --rounds 3     # both systems, as root
    python3 bench/host_failover.py --system tpuray --rounds 5

tpuray comes from ``--tpuray-python`` (default: bench/.tpuray-venv, a release build made
by bench/compare.py's recipe when missing); Ray 2.60 from PyPI in bench/.ray-venv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python-sdk" / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from hosts import Hosts  # noqa: E402

PORT = 6379
MEASURES = ("dead", "task", "object", "actor")

# The driver, run in host0 as `python - MODULE HEAD VICTIM_IP LIMIT`. It prints READY
# once everything sits on the victim, reads the cut's wall-clock time from stdin, and
# prints one JSON line of seconds from the cut.
DRIVER = r"""
import importlib, json, sys, threading, time
mod, head, victim_ip, limit = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
ray = importlib.import_module(mod)
from importlib import import_module
strategies = import_module(mod + ".util.scheduling_strategies")
ray.init(address=head)
victim = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == victim_ip]
assert victim, f"no live node at {victim_ip}: {ray.nodes()}"
on_victim = strategies.NodeAffinitySchedulingStrategy(victim[0], soft=True)
PAYLOAD = bytes(range(256)) * 8192  # 2 MiB: stored, never inline

@ray.remote(max_retries=3, scheduling_strategy=on_victim)
def long_task():
    time.sleep(5)
    return "task-ok"

@ray.remote(max_retries=3, scheduling_strategy=on_victim)
def make_object():
    return PAYLOAD

@ray.remote(max_restarts=1, max_task_retries=-1, scheduling_strategy=on_victim)
class Pinger:
    def ping(self):
        return "pong"

obj = make_object.remote()
ray.wait([obj], timeout=60, fetch_local=False)
actor = Pinger.remote()
assert ray.get(actor.ping.remote(), timeout=60) == "pong"
task = long_task.remote()
time.sleep(1.5)  # the task is running on the victim
print("READY", flush=True)
cut = float(sys.stdin.readline())
done = {}

def measure(name, fn):
    try:
        fn()
        done[name] = time.time() - cut
    except Exception as e:  # recorded, the others go on
        done[name + "_error"] = f"{type(e).__name__}: {e}"[:300]

def dead():
    while time.time() - cut < limit:
        if not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == victim[0]):
            return
        time.sleep(0.1)
    raise TimeoutError("still alive")

def task_back():
    assert ray.get(task, timeout=limit) == "task-ok"

def object_back():
    assert ray.get(obj, timeout=limit) == PAYLOAD

def actor_back():
    while True:
        left = limit - (time.time() - cut)
        if left <= 0:
            raise TimeoutError("no answer")
        try:
            if ray.get(actor.ping.remote(), timeout=left) == "pong":
                return
        except ray.exceptions.GetTimeoutError:
            raise
        except Exception:
            time.sleep(0.1)

threads = [threading.Thread(target=measure, args=(n, f), daemon=True)
           for n, f in (("dead", dead), ("task", task_back), ("object", object_back),
                        ("actor", actor_back))]
for t in threads:
    t.start()
for t in threads:
    t.join(limit + 5)
print(json.dumps(done), flush=True)
import os
os._exit(0)
"""


def run(host, args: list[str], timeout: float = 180) -> None:
    """Runs `args` in `host`; raises with its output when it fails."""
    r = host.run(args, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{host.name}: {' '.join(args)} failed ({r.returncode}):\n"
                           f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def start_cluster(system: str, py: str, hs: Hosts) -> None:
    head = hs.hosts[0]
    if system == "tpuray":
        cli = [py, "-m", "tpuray", "start"]
        run(head, cli + ["--head", "--port", str(PORT), "--num-cpus", "2"])
        token = head.home / ".tpuray" / "auth_token"
        for h in hs.hosts[1:]:
            # The cluster token goes to the other hosts by file copy (0600), as a user would.
            (h.home / ".tpuray").mkdir(parents=True, exist_ok=True)
            dst = h.home / ".tpuray" / "auth_token"
            dst.write_bytes(token.read_bytes())
            dst.chmod(0o600)
            run(h, cli + ["--address", f"{head.address}:{PORT}", "--num-cpus", "2"])
    else:
        ray = [py, "-m", "ray.scripts.scripts", "start", "--disable-usage-stats", "--num-cpus", "2"]
        run(head, ray + ["--head", "--include-dashboard=false", "--port", str(PORT),
                         "--node-ip-address", head.address])
        for h in hs.hosts[1:]:
            run(h, ray + ["--address", f"{head.address}:{PORT}", "--node-ip-address", h.address])


def one_round(system: str, py: str, limit: float) -> dict:
    with Hosts(3) as hs:
        start_cluster(system, py, hs)
        head, victim = hs.hosts[0], hs.hosts[2]
        module = "tpuray" if system == "tpuray" else "ray"
        env = {"RAY_ADDRESS": f"{head.address}:{PORT}"} if system == "ray" else {}
        drv = head.popen([py, "-c", DRIVER, module, f"{head.address}:{PORT}", victim.address,
                          str(limit)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        try:
            line = drv.stdout.readline()
            if line.strip() != "READY":
                drv.kill()
                raise RuntimeError(f"{system} driver did not get ready: {line!r}\n"
                                   f"{drv.stderr.read()[-3000:]}")
            cut = time.time()
            victim.partition()
            drv.stdin.write(f"{cut}\n")
            drv.stdin.flush()
            out, err = drv.communicate(timeout=limit + 60)
        finally:
            if drv.poll() is None:
                drv.kill()
        last = [l for l in out.splitlines() if l.startswith("{")]
        if not last:
            raise RuntimeError(f"{system} driver printed no result:\n{out}\n{err[-3000:]}")
        return json.loads(last[-1])


def fmt(values: list[float], limit: float) -> str:
    m = statistics.median(values)
    return f">{limit:.0f}" if m >= limit else f"{m:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system", choices=["tpuray", "ray", "both"], default="both")
    ap.add_argument("--limit", type=float, default=120.0,
                    help="seconds after the cut before a measure gives up")
    ap.add_argument("--tpuray-python", default=None,
                    help="python with tpuray installed (default: bench/.tpuray-venv, release)")
    ap.add_argument("--ray-python", default=None,
                    help="python with ray installed (default: bench/.ray-venv, ray 2.60.0)")
    a = ap.parse_args()
    if a.rounds < 1 or a.limit <= 0:
        ap.error("--rounds must be at least 1 and --limit positive")
    if os.geteuid() != 0:
        print("host_failover.py needs root (it makes network namespaces)", file=sys.stderr)
        return 2
    import compare

    systems = ["tpuray", "ray"] if a.system == "both" else [a.system]
    pys = {}
    if "tpuray" in systems:
        pys["tpuray"] = a.tpuray_python or str(compare.ensure_tpuray(ROOT / "bench/.tpuray-venv"))
        compare.require_optimized(pys["tpuray"], "bench/host_failover.py")
    if "ray" in systems:
        pys["ray"] = a.ray_python or str(compare.ensure_ray(ROOT / "bench/.ray-venv", "2.60.0"))
    results: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(a.rounds):
        for s in systems:  # interleaved, so both see the same machine
            res = one_round(s, pys[s], a.limit)
            results[s].append(res)
            print(f"round {r + 1} {s}: {json.dumps(res)}", flush=True)
    print(f"\nmedians of {a.rounds} round(s), seconds from the cut "
          f"(>{a.limit:.0f}: not done within the limit)")
    print(f"{'system':<8}" + "".join(f"{m:>10}" for m in MEASURES))
    for s in systems:
        cells = [fmt([res.get(m, a.limit) for res in results[s]], a.limit) for m in MEASURES]
        print(f"{s:<8}" + "".join(f"{c:>10}" for c in cells))
    for s in systems:
        for res in results[s]:
            for k, v in res.items():
                if k.endswith("_error"):
                    print(f"{s}: {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
