"""The cost of one `/metrics` scrape: time and bytes for the head (dashboard port) and
for a node agent (`MetricsExportPort`), on a local cluster of N nodes before and after
it ran M tasks (default 7 nodes, 10,000 finished tasks, as issue 27 asks).

    python bench/metrics_scrape.py [--nodes 7] [--tasks 10000] [--scrapes 30]
        [--tpuray target/release/tpuray]

The cluster runs the `tpuray` binary given (build it with `cargo build --release -p
tpuray-cli`; benchmarks run release builds); the driver is this interpreter with the
`tpuray` package installed (its workers run the same interpreter). Each scrape is one
HTTP GET on loopback, timed from request to the last byte; the table gives the median
and the 90th percentile of `--scrapes` scrapes, the body's size and its series count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    return time.perf_counter() - t0, body


def measure(url: str, n: int) -> dict:
    fetch(url)  # warm: connections, the sampler's first readings
    times, body = [], b""
    for _ in range(n):
        t, body = fetch(url)
        times.append(t)
    times.sort()
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return {
        "median_ms": 1000 * statistics.median(times),
        "p90_ms": 1000 * times[int(0.9 * (len(times) - 1))],
        "bytes": len(body),
        "series": series,
    }


DRIVER = """
import sys, time
import tpuray as ray
ray.init(sys.argv[1])

@ray.remote
def noop(i):
    return i

n = int(sys.argv[2])
t0 = time.time()
done = 0
while done < n:
    batch = min(1000, n - done)
    assert len(ray.get([noop.remote(i) for i in range(batch)])) == batch
    done += batch
print(f"ran {n} tasks in {time.time() - t0:.1f} s", flush=True)
ray.shutdown()
"""


def main() -> None:
    from tpuray._private.build import require_optimized_build

    require_optimized_build("bench/metrics_scrape.py")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=7)
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--scrapes", type=int, default=30)
    ap.add_argument("--tpuray", default=str(Path(__file__).resolve().parents[1] / "target/release/tpuray"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tpuray-metrics-bench-"))
    env = dict(os.environ, HOME=str(tmp / "home"), TPURAY_REGISTRY_DIR=str(tmp / "registry"))
    env.pop("TPURAY_ADDRESS", None)
    os.makedirs(env["HOME"])
    port = free_port()
    address = f"127.0.0.1:{port}"

    def start(*args: str) -> str:
        r = subprocess.run([a.tpuray, "start", *args], env=env, capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            sys.exit(r.stderr)
        return r.stdout

    try:
        out = start("--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "2", "--dashboard-port", "0", "--temp-dir", str(tmp / "head"))
        dashboard = re.search(r"Dashboard: (http://\S+)", out).group(1)
        for i in range(1, a.nodes):
            start("--address", address, "--num-cpus", "2", "--temp-dir", str(tmp / f"node{i}"))
        sd = tmp / "head" / "session_latest" / "prom_metrics_service_discovery.json"
        deadline = time.time() + 30
        while True:
            targets = json.loads(sd.read_text())[0]["targets"] if sd.exists() else []
            if len(targets) == a.nodes + 1 or time.time() > deadline:
                break
            time.sleep(0.2)
        head_url = dashboard + "/metrics"
        agents = [f"http://{t}/metrics" for t in targets if t not in dashboard]
        agent_url = agents[0]
        rows = [("head, idle", measure(head_url, a.scrapes)),
                ("agent, idle", measure(agent_url, a.scrapes))]
        script = tmp / "driver.py"
        script.write_text(textwrap.dedent(DRIVER))
        r = subprocess.run([sys.executable, str(script), address, str(a.tasks)], env=env,
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            sys.exit(r.stderr)
        print(r.stdout.strip())
        # The task events reach the head within a second or so.
        deadline = time.time() + 60
        while time.time() < deadline:
            _, body = fetch(head_url)
            finished = sum(float(l.rsplit(" ", 1)[1]) for l in body.decode().splitlines()
                           if l.startswith("ray_tasks{") and 'State="FINISHED"' in l)
            if finished >= a.tasks:
                break
            time.sleep(0.5)
        print(f"head reports {finished:.0f} finished tasks")
        # The agent with the most series (the one whose workers ran the most kinds of work).
        agent_url = max(agents, key=lambda u: len(fetch(u)[1]))
        rows += [(f"head, {a.tasks} finished tasks", measure(head_url, a.scrapes)),
                 (f"agent, {a.tasks} finished tasks", measure(agent_url, a.scrapes))]
        print(f"\n{a.nodes} nodes, {a.scrapes} scrapes each (agent: {agent_url}, the largest after the tasks)")
        print(f"{'target':<32} {'median ms':>10} {'p90 ms':>8} {'bytes':>8} {'series':>7}")
        for name, m in rows:
            print(f"{name:<32} {m['median_ms']:>10.2f} {m['p90_ms']:>8.2f} {m['bytes']:>8} {m['series']:>7}")
    finally:
        subprocess.run([a.tpuray, "stop"], env=env, capture_output=True, timeout=120)


if __name__ == "__main__":
    main()
