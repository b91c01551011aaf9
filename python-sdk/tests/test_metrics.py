"""Prometheus metrics (issue 27, METRICS-1..5): ``/metrics`` of the head (dashboard port)
and of the node agents (``MetricsExportPort``), parsed with ``prometheus_client``'s text
parser, against the cluster's true state while a workload holds it (running tasks on
known nodes, chips busy on a simulated v6e-16 slice, an actor, a placement group, an
object in the store, user metrics from ``tpuray.util.metrics``); a real Prometheus
(Debian's ``prometheus``) that finds the targets through the service-discovery file and
answers the PromQL of Ray 2.60's default dashboard (``ray_dashboard_panels.py``);
counts that fall to zero read 0 instead of vanishing; a slice gang's generation and
restarts; three heads' Raft positions; and Ray's ``ray.util.metrics`` argument rules."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request

import pytest
from conftest import CliCluster
from prometheus_client.parser import text_string_to_metric_families

import ray_dashboard_panels

WORKLOAD = r"""
import json, os, sys, time
import numpy as np
import tpuray as ray
from tpuray.util.metrics import Counter, Gauge, Histogram
from tpuray.util.placement_group import placement_group, placement_group_table
from tpuray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

addr, run_dir = sys.argv[1], sys.argv[2]
ray.init(addr)

def out(tag, x):
    print(tag + " " + json.dumps(x), flush=True)

def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.05)

# The node of each host, by role.
nodes = {}
for n in ray.nodes():
    w = n["Labels"].get("ray.io/tpu-worker-id")
    nodes["w" + w if w is not None else "head"] = n["NodeID"]

def on(role):
    return NodeAffinitySchedulingStrategy(nodes[role], soft=False)

@ray.remote
def quick(i):
    return i

@ray.remote(max_retries=2)
def flaky(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)  # the first attempt dies; the retry runs
    time.sleep(1.5)  # long enough for the executor's agent to see it running
    return "retried"

@ray.remote
def block(tag):
    open(os.path.join(run_dir, "running-" + tag), "w").write(ray.get_runtime_context().get_node_id())
    wait_for(os.path.join(run_dir, "release"))
    return tag

@ray.remote(num_cpus=0, resources={"TPU": 4})
def tpu_block(tag, record):
    if record:
        Counter("tpuray_test_requests", "requests", tag_keys=("route",)).inc(3, tags={"route": "/a"})
        Gauge("tpuray_test_temperature", "a gauge").set(7.5)
        h = Histogram("tpuray_test_latency", "a histogram", boundaries=[1, 10])
        for v in (0.5, 3, 20):
            h.observe(v)
    open(os.path.join(run_dir, "running-" + tag), "w").write(ray.get_runtime_context().get_node_id())
    wait_for(os.path.join(run_dir, "release"))
    return tag

@ray.remote
class Holder:
    def ping(self):
        return "pong"

events = Counter("tpuray_test_driver_events", "recorded by the driver")
events.inc()
events.inc()
assert ray.get([quick.remote(i) for i in range(5)]) == list(range(5))
assert ray.get(flaky.remote(os.path.join(run_dir, "flaky-marker"))) == "retried"
holder = Holder.options(scheduling_strategy=on("head")).remote()
assert ray.get(holder.ping.remote()) == "pong"
pg = placement_group([{"CPU": 0.5}])
ray.get(pg.ready(), timeout=60)
big = ray.put(np.zeros(2 << 20, dtype=np.uint8))
refs = [
    block.options(scheduling_strategy=on("head")).remote("head-1"),
    block.options(scheduling_strategy=on("head")).remote("head-2"),
    block.options(scheduling_strategy=on("w0")).remote("w0"),
    tpu_block.options(scheduling_strategy=on("w1")).remote("w1", True),
    tpu_block.options(scheduling_strategy=on("w2")).remote("w2", False),
]
tags = ["head-1", "head-2", "w0", "w1", "w2"]
while not all(os.path.exists(os.path.join(run_dir, "running-" + t)) for t in tags):
    time.sleep(0.05)
running = {t: open(os.path.join(run_dir, "running-" + t)).read() for t in tags}
pg_node = placement_group_table(pg)["bundles_to_node_id"][0]
out("READY", {"nodes": nodes, "running": running, "nodes_info": ray.nodes(), "pg_node": pg_node})
assert sorted(ray.get(refs, timeout=120)) == sorted(tags)
out("RELEASED", {})
wait_for(os.path.join(run_dir, "gang"))
# A slice gang whose member dies once: generation 0, then 1 (tpuray_gang_*).
import signal
from tpuray.util import tpu

@ray.remote
class Member:
    def pid(self):
        return os.getpid()

group = tpu.SliceActorGroup(Member, topology="4x4", accelerator_version="v6e", name="metrics-gang",
                            max_restarts=2)
pids = group.call("pid")
os.kill(pids[1], signal.SIGKILL)
group.call("pid")
out("GANG", {"restarts": group.restarts})
wait_for(os.path.join(run_dir, "exit"))
group.shutdown()
del big
"""


class MetricsCluster(CliCluster):
    """A CliCluster whose head serves its dashboard on a free port it reports."""

    dashboard = ""

    def head(self, num_cpus: int = 1) -> "MetricsCluster":
        e = dict(self.env)
        r = subprocess.run(
            self.CLI + ["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
                        "--num-cpus", str(num_cpus), "--dashboard-port", "0",
                        "--temp-dir", str(self.tmp / "head")],
            env=e, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        self.dashboard = re.search(r"Dashboard: (http://\S+)", r.stdout).group(1)
        return self


def get(url: str, timeout: float = 10, headers=None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:  # not listening (yet)
        return 0, str(e)


def scrape(target: str) -> list[tuple[str, dict, float]]:
    """Every sample of `http://target/metrics`, parsed with prometheus_client."""
    status, text = get(f"http://{target}/metrics")
    assert status == 200, text
    return [(s.name, s.labels, s.value)
            for f in text_string_to_metric_families(text) for s in f.samples]


def value(samples, name, **labels) -> float:
    """The one sample of `name` whose labels include `labels`."""
    got = [v for n, l, v in samples if n == name and all(l.get(k) == w for k, w in labels.items())]
    assert len(got) == 1, f"{name}{labels}: {len(got)} samples"
    return got[0]


def total(samples, name, **labels) -> float:
    return sum(v for n, l, v in samples if n == name
               and all(re.fullmatch(w, l.get(k, "")) for k, w in labels.items()))


def eventually(check, timeout: float = 30, every: float = 0.3):
    """Calls `check` until it stops raising AssertionError (then returns its value)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(every)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    c = MetricsCluster(tmp)
    run_dir = tmp / "run"
    run_dir.mkdir()
    proc = None
    try:
        c.head(num_cpus=3).tpu_slice("sa")
        script = tmp / "workload.py"
        script.write_text(WORKLOAD)
        proc = subprocess.Popen([sys.executable, str(script), c.address, str(run_dir)], env=c.env,
                                cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = ""
        deadline = time.monotonic() + 180
        while not line.startswith("READY ") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("READY "), proc.stderr.read() if proc.poll() is not None else "no READY"
        ready = json.loads(line[6:])
        token = (tmp / "home" / ".tpuray" / "auth_token").read_text().strip()
        status, body = get(c.dashboard + "/api/version",
                           headers={"Authorization": f"Bearer {token}"})
        assert status == 200, body
        ready["session"] = json.loads(body)["session_name"]
        ready["dashboard"] = c.dashboard.removeprefix("http://")
        ready["head_address"] = c.address
        ready["discovery"] = tmp / "head" / "session_latest" / "prom_metrics_service_discovery.json"
        ready["run_dir"] = run_dir
        ready["tmp"] = tmp
        ready["proc"] = proc
        yield ready
    finally:
        if proc is not None:
            (run_dir / "release").touch()
            (run_dir / "exit").touch()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        c.stop()


def agent_target(w, role) -> str:
    node = next(n for n in w["nodes_info"] if n["NodeID"] == w["nodes"][role])
    return f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"


def test_metrics_of_the_head_and_agents_agree_with_the_cluster(workload):
    w = workload
    # nodes() carries MetricsExportPort, and the discovery file lists every node's and the head's.
    assert all(n["MetricsExportPort"] > 0 for n in w["nodes_info"])
    targets = sorted(agent_target(w, r) for r in w["nodes"]) + [w["dashboard"]]

    def discovered():
        sd = json.loads(w["discovery"].read_text())
        assert sd[0]["labels"] == {"job": "ray"}, sd
        assert sorted(sd[0]["targets"]) == sorted(targets), sd
    eventually(discovered)

    # METRICS-1: no token needed (the cluster runs with token auth); health routes too.
    for role in ("head", "w1"):
        assert get(f"http://{agent_target(w, role)}/api/healthz") == (200, "success")
        assert get(f"http://{agent_target(w, role)}/api/local_raylet_healthz") == (200, "success")

    def head_ok():
        h = scrape(w["dashboard"])
        assert value(h, "tpuray_nodes", State="ALIVE") == 5
        assert total(h, "ray_tasks", Source="owner", State="FINISHED", Name=".*quick") == 5
        assert total(h, "ray_tasks", Source="owner", State="FINISHED", Name=".*flaky", IsRetry="1") == 1
        assert total(h, "ray_actors", Source="gcs", State="ALIVE", Name=".*Holder") == 1
        assert value(h, "ray_placement_groups", State="CREATED") >= 1
        assert value(h, "tpuray_tpu_slice_intact", Slice="sa") == 1
        assert value(h, "tpuray_tpu_slice_busy", Slice="sa") == 1
        assert value(h, "tpuray_tpu_slice_chips", Slice="sa", State="USED") == 8
        assert value(h, "tpuray_tpu_slice_chips", Slice="sa", State="AVAILABLE") == 8
        assert value(h, "tpuray_tpu_slice_hosts", Slice="sa", State="ALIVE") == 4
        assert value(h, "tpuray_tpu_chips", AcceleratorType="v6e-16", State="USED") == 8
        assert value(h, "tpuray_raft_is_leader", HeadId="1") == 1
        assert value(h, "tpuray_raft_term", HeadId="1") >= 1
        assert value(h, "tpuray_raft_apply_lag", HeadId="1") >= 0
        assert value(h, "ray_component_rss_bytes", Component="gcs") > 0
        return h
    head = eventually(head_ok)
    # The head exports no running tasks: the executors' agents do (no task counts twice).
    assert total(head, "ray_tasks", State="RUNNING") == 0

    by_role = {}

    def agents_ok():
        for role in w["nodes"]:
            by_role[role] = scrape(agent_target(w, role))
        running = {role: total(s, "ray_tasks", Source="executor", State="RUNNING")
                   for role, s in by_role.items()}
        want = {role: 0 for role in w["nodes"]}
        for tag, node in w["running"].items():
            want[next(r for r, n in w["nodes"].items() if n == node)] += 1
        assert running == want, (running, want)
        assert want == {"head": 2, "w0": 1, "w1": 1, "w2": 1, "w3": 0}
        hn = by_role["head"]
        # The blocked tasks (1 CPU each) and the placement group's 0.5-CPU bundle.
        for role, s in by_role.items():
            used = want[role] * (role in ("head", "w0")) + 0.5 * (w["nodes"][role] == w["pg_node"])
            cpus = 3 if role == "head" else 1
            assert value(s, "ray_resources", Name="CPU", State="USED") == used, (
                role, [(l.get("Name"), l.get("State"), v) for n, l, v in s
                       if n == "tpuray_workers" or l.get("Name") == "CPU"])
            assert value(s, "ray_resources", Name="CPU", State="AVAILABLE") == cpus - used, role
        assert value(hn, "ray_object_store_memory", Location="MMAP_SHM", ObjectState="SEALED") >= 2 << 20
        assert total(hn, "ray_actors", Source="executor", State="IDLE", Name=".*Holder") == 1
        assert value(hn, "ray_tpuray_test_driver_events_total") == 2
        for role, busy in (("w1", True), ("w2", True), ("w3", False)):
            s = by_role[role]
            assert value(s, "ray_resources", Name="TPU", State="USED") == (4 if busy else 0)
            for i in range(4):
                assert value(s, "tpuray_tpu_chip_allocated", TpuIndex=str(i), Slice="sa") == int(busy)
                assert value(s, "tpuray_tpu_chip_busy", TpuIndex=str(i), TpuType="v6e-16") == int(busy)
        s1 = by_role["w1"]
        assert value(s1, "ray_tpuray_test_requests_total", route="/a") == 3
        assert value(s1, "ray_tpuray_test_temperature") == 7.5
        assert value(s1, "ray_tpuray_test_latency_bucket", le="1") == 1
        assert value(s1, "ray_tpuray_test_latency_bucket", le="10") == 2
        assert value(s1, "ray_tpuray_test_latency_bucket", le="+Inf") == 3
        assert value(s1, "ray_tpuray_test_latency_sum") == 23.5
        assert value(s1, "ray_tpuray_test_latency_count") == 3
        for role, s in by_role.items():
            kind = "head" if role == "head" else "worker"
            assert value(s, "ray_node_cpu_count", RayNodeType=kind) > 0
            assert value(s, "ray_node_mem_total_host", RayNodeType=kind) > 0
            assert value(s, "ray_component_rss_bytes", Component="raylet") > 0
            assert value(s, "tpuray_workers", State="LEASED") >= (1 if want[role] else 0)
    eventually(agents_ok)

    # Every series carries the cluster's SessionName; and (ray#63131) a scrape right after
    # another lacks none of its series.
    for t in targets:
        first = scrape(t)
        assert first and all(l.get("SessionName") == w["session"] for _, l, _ in first), t
        again = {(n, tuple(sorted(l.items()))) for n, l, _ in scrape(t)}
        missing = {(n, tuple(sorted(l.items()))) for n, l, _ in first} - again
        assert not missing, (t, sorted(missing)[:5])


def test_a_taken_metrics_export_port_is_an_error_naming_the_flag(workload):
    w = workload
    taken = agent_target(w, "w3").rsplit(":", 1)[1]
    env = dict(os.environ, HOME=str(w["tmp"] / "home"), TPURAY_REGISTRY_DIR=str(w["tmp"] / "registry"))
    env.pop("TPURAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-m", "tpuray", "start", "--address", w["head_address"],
                        "--num-cpus", "1", "--metrics-export-port", taken,
                        "--temp-dir", str(w["tmp"] / "taken")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--metrics-export-port" in r.stderr, r.stderr


def prometheus_binary() -> str:
    """Debian's prometheus, installed with apt-get when missing (as root)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("needs Debian's prometheus: run as root (the test installs it) or "
                    "apt-get install prometheus")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
    if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    return shutil.which("prometheus")


def promql(expr: str, session: str) -> str:
    """A panel target as Ray's dashboard factory and Grafana (variables set to All) make it."""
    filters = ",".join(ray_dashboard_panels.STANDARD_GLOBAL_FILTERS)
    q = expr.format(global_filters=filters)
    for var, val in (("$SessionName", session), ("$Instance", ".+"), ("$Cluster", ".*"),
                     ("$RayNodeType", "(head|worker)")):
        q = q.replace(var, val)
    return q


def test_prometheus_answers_rays_default_dashboard_panels(workload):
    w = workload
    binary = prometheus_binary()
    tmp = w["tmp"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp / "prometheus.yml").write_text(textwrap.dedent(f"""\
        global:
          scrape_interval: 1s
          evaluation_interval: 1s
        scrape_configs:
        - job_name: 'ray'
          file_sd_configs:
          - files:
            - '{w["discovery"]}'
            refresh_interval: 1s
        """))
    log = open(tmp / "prometheus.log", "w")
    prom = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'prom-data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        def targets_up():
            status, body = get(f"{api}/targets")
            assert status == 200, body
            active = json.loads(body)["data"]["activeTargets"]
            assert len(active) == 6 and all(t["health"] == "up" for t in active), active
        eventually(targets_up, timeout=60, every=0.5)

        def query(q):
            status, body = get(f"{api}/query?" + urllib.parse.urlencode({"query": q}))
            assert status == 200, (q, body)
            return json.loads(body)["data"]["result"]

        empty = []
        for pid, title, panel_targets in ray_dashboard_panels.PANELS:
            for expr, wanted in panel_targets:
                if not wanted:
                    continue
                q = promql(expr, w["session"])
                try:
                    eventually(lambda q=q: query(q) or (_ for _ in ()).throw(AssertionError(q)),
                               timeout=20, every=0.5)
                except AssertionError:
                    empty.append(f"{pid} {title}: {q}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
        # The running tasks, by node, as Prometheus sees them.
        by_node = {r["metric"]["instance"]: float(r["value"][1]) for r in query(promql(
            'sum(ray_tasks{{State=~"RUNNING*",Source="executor",{global_filters}}}) by (instance)',
            w["session"]))}
        want = {agent_target(w, r): n for r, n in (("head", 2), ("w0", 1), ("w1", 1), ("w2", 1))}
        # w3 ran nothing: it has no series of running tasks at all, or a 0.
        assert {t: v for t, v in by_node.items() if v} == want, by_node
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        log.close()


def test_counts_that_fall_to_zero_are_exported_as_zero(workload):
    w = workload
    (w["run_dir"] / "release").touch()
    line = w["proc"].stdout.readline()
    assert line.startswith("RELEASED"), line + w["proc"].stderr.read()

    def settled():
        for role in ("head", "w0", "w1", "w2"):
            s = scrape(agent_target(w, role))
            running = [v for n, l, v in s if n == "ray_tasks" and l["State"] == "RUNNING"
                       and re.search("block", l["Name"])]
            # METRICS-2: the series stay, at 0.
            assert running and all(v == 0 for v in running), (role, running)
            if role in ("w1", "w2"):
                assert value(s, "ray_resources", Name="TPU", State="USED") == 0
                assert all(value(s, "tpuray_tpu_chip_busy", TpuIndex=str(i)) == 0 for i in range(4))
        h = scrape(w["dashboard"])
        assert total(h, "ray_tasks", Source="owner", State="FINISHED", Name=".*block") == 5
        assert value(h, "tpuray_tpu_slice_busy", Slice="sa") == 0
        assert value(h, "tpuray_tpu_chips", AcceleratorType="v6e-16", State="USED") == 0
    eventually(settled, timeout=30)

    # A gang on the slice, restarted once after a member died.
    (w["run_dir"] / "gang").touch()
    line = w["proc"].stdout.readline()
    assert line.startswith("GANG ") and json.loads(line[5:])["restarts"] == 1, line

    def gang():
        h = scrape(w["dashboard"])
        assert value(h, "tpuray_gang_generation", Gang="metrics-gang") == 1
        assert value(h, "tpuray_gang_restarts_total", Gang="metrics-gang") == 1
        assert value(h, "tpuray_gang_reserved", Gang="metrics-gang") == 1
        assert value(h, "tpuray_tpu_slice_busy", Slice="sa") == 1
        assert value(h, "tpuray_tpu_slice_chips", Slice="sa", State="USED") == 16
        assert value(h, "ray_placement_groups", State="REMOVED") >= 1  # generation 0's group
    eventually(gang, timeout=30)


# ---- tpuray.util.metrics: Ray's API rules (no cluster needed) ----

def test_util_metrics_checks_arguments_as_rays_does():
    import pickle
    import warnings

    from tpuray.util.metrics import Counter, Gauge, Histogram

    with pytest.raises(ValueError, match="Empty name"):
        Counter("")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = Counter("1bad")
        bad.inc()  # discarded, as Ray's
    assert any("Invalid metric name" in str(c.message) for c in caught)
    with pytest.raises(TypeError, match="tuple"):
        Counter("t_api_list_keys", tag_keys=["a"])
    c = Counter("t_api_counter", "d", tag_keys=("a", "b"))
    with pytest.raises(ValueError, match=">0"):
        c.inc(0, tags={"a": "x", "b": "y"})
    with pytest.raises(TypeError, match="int or float"):
        c.inc("1", tags={"a": "x", "b": "y"})
    with pytest.raises(ValueError, match="Missing value for tag key"):
        c.inc(1, tags={"a": "x"})
    with pytest.raises(ValueError, match="Unrecognized tag key"):
        c.set_default_tags({"z": "1"})
    with pytest.raises(TypeError, match="Tag values must be str"):
        c.inc(1, tags={"a": 1, "b": "y"})
    assert c.set_default_tags({"a": "x"}) is c
    c.inc(2, tags={"b": "y"})
    assert c.info == {"name": "t_api_counter", "description": "d", "tag_keys": ("a", "b"),
                      "default_tags": {"a": "x"}}
    assert pickle.loads(pickle.dumps(c)).info["name"] == "t_api_counter"
    with pytest.raises(ValueError, match="boundaries argument should be provided"):
        Histogram("t_api_h")
    with pytest.raises(ValueError, match="Use positive values"):
        Histogram("t_api_h", boundaries=[1, 0])
    h = Histogram("t_api_h", boundaries=[5, 1])  # Prometheus buckets ascend
    h.observe(3)
    assert h.info["boundaries"] == [5, 1]
    Gauge("t_api_g").set(None)  # a no-op, as Ray's
    # A name is one metric: defined again differently is refused, naming both.
    with pytest.raises(ValueError, match="already defined as a Counter"):
        Gauge("t_api_counter", tag_keys=("a", "b"))
    Counter("t_api_counter", "another description", tag_keys=("a", "b")).inc(tags={"a": "1", "b": "2"})


def test_every_head_exports_its_raft_position_and_only_the_leader_the_cluster(tmp_path):
    """METRICS-3 on three heads: each exports its own Raft term, indexes and apply lag;
    only the serving leader exports cluster series (so sums over heads count once); the
    discovery file lists every head's dashboard and the node."""
    env = dict(os.environ, HOME=str(tmp_path / "home"), TPURAY_REGISTRY_DIR=str(tmp_path / "registry"))
    env.pop("TPURAY_ADDRESS", None)
    os.makedirs(env["HOME"])
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    cli = [sys.executable, "-m", "tpuray"]
    dashboards = []
    try:
        for i in (1, 2, 3):
            r = subprocess.run(cli + ["start", "--head", "--head-only", "--head-peers", peers,
                                      "--head-id", str(i), "--dashboard-port", "0",
                                      "--temp-dir", str(tmp_path / f"h{i}")],
                               env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            dashboards.append(re.search(r"Dashboard: http://(\S+)", r.stdout).group(1))
        r = subprocess.run(cli + ["start", "--address", peers, "--num-cpus", "1",
                                  "--temp-dir", str(tmp_path / "n1")],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr

        def heads_ok():
            scrapes = [scrape(d) for d in dashboards]
            leaders = [i for i, s in enumerate(scrapes)
                       if value(s, "tpuray_head_serving", HeadId=str(i + 1)) == 1]
            assert len(leaders) == 1, leaders
            terms = {value(s, "tpuray_raft_term", HeadId=str(i + 1)) for i, s in enumerate(scrapes)}
            assert len(terms) == 1, terms
            for i, s in enumerate(scrapes):
                hid = str(i + 1)
                assert value(s, "tpuray_raft_apply_lag", HeadId=hid) == 0
                assert value(s, "tpuray_raft_is_leader", HeadId=hid) == int(i == leaders[0])
                nodes = [v for n, l, v in s if n == "tpuray_nodes" and l["State"] == "ALIVE"]
                assert nodes == ([1] if i == leaders[0] else []), (hid, nodes)
        eventually(heads_ok, timeout=60)
        sd = tmp_path / "h1" / "session_latest" / "prom_metrics_service_discovery.json"

        def discovered():
            targets = json.loads(sd.read_text())[0]["targets"]
            assert set(dashboards) <= set(targets) and len(targets) == 4, (targets, dashboards)
        eventually(discovered, timeout=30)
    finally:
        subprocess.run(cli + ["stop"], env=env, capture_output=True, timeout=120)
