"""The autoscaler (``tpuray start --head --autoscaling-config``) with the ``local``
provider and issue 32's config: ``cpu`` workers (0..4) and ``v6e-16`` slices (0..2, each
4 simulated hosts of 4 chips, topology 4x4), idle timeout 0.1 minute. The cluster starts
with the head's node alone (0 CPUs); every other node is one the autoscaler started.

Checked: a ``run_on_slice`` gang brings one whole slice (four hosts, one launch, one slice
name) and runs; once idle the four hosts go as one removal; two gangs at once bring two
slices, a third waits (reported: max_workers) and never brings a third; a ``v6e-64`` gang
is reported infeasible and starts nothing; killing one host of a busy slice removes that
slice whole, starts a new one, and the gang runs again there with
``TPURAY_GANG_GENERATION`` one higher; ``request_resources(bundles=[{"CPU": 1}] * 6)``
brings CPU workers up to ``max_workers`` (4) and no slice; stopping the head stops every
process the autoscaler started. Waits poll the cluster's state with generous bounds
(the machine is loaded); nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import CliCluster

CONFIG = """\
provider:
  type: local
idle_timeout_minutes: 0.1
available_node_types:
  cpu:
    resources: {CPU: 1}
    min_workers: 0
    max_workers: 4
  v6e-16:
    resources: {CPU: 1}
    min_workers: 0
    max_workers: 2
    tpu: {accelerator_type: v6e-16, topology: 4x4}
"""

#: Bound for one slice to come up and its gang to start (s): four agents on a loaded machine.
SLICE_TIMEOUT = 240
INSTANCE = "tpuray.io/autoscaler-instance"
NODE_TYPE = "tpuray.io/autoscaler-node-type"


def wait_for(what, cond, timeout):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autoscaler")
    c = CliCluster(tmp)
    cfg = tmp / "autoscaling.yaml"
    cfg.write_text(CONFIG)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        c.dashboard_port = s.getsockname()[1]
    c._start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(c.port), "--num-cpus", "0",
              "--temp-dir", str(tmp / "head"), "--autoscaling-config", str(cfg),
              "--dashboard-port", str(c.dashboard_port)])
    try:
        yield c
    finally:
        c.stop()
        # Nothing the autoscaler started is left (AUTOSCALE-8).
        left = [l for l in ps() if str(tmp) in l]
        for line in left:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        assert not left, left


def ps():
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [l.strip() for l in out.splitlines()[1:]]


def cli(c, *args):
    r = subprocess.run(CliCluster.CLI + list(args) + ["--address", c.address], env=c.env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def alive(c):
    return [n for n in json.loads(cli(c, "list", "nodes", "--format", "json"))
            if n["state"] == "ALIVE"]


def scaled_nodes(c, node_type=None):
    return [n for n in alive(c) if NODE_TYPE in n.get("labels", {})
            and (node_type is None or n["labels"][NODE_TYPE] == node_type)]


def report(c):
    return cli(c, "status")


def autoscaler_section(c):
    text = report(c)
    return text[text.index("Autoscaler\n"):] if "Autoscaler\n" in text else ""


def driver(c, body, *args):
    script = c.tmp / f"driver-{time.monotonic_ns()}.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(script), c.address, *args], env=c.env, cwd=c.tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


GANG = """
    import json, os, sys, time
    import tpuray as ray
    from tpuray.util import tpu

    address, name, hold, topology = sys.argv[1:5]

    @ray.remote
    def member():
        env = os.environ
        gen, worker = env["TPURAY_GANG_GENERATION"], env["TPU_WORKER_ID"]
        if hold != "-":
            path = os.path.join(hold, f"{name}-{worker}-{gen}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getppid()))
            os.rename(path + ".tmp", path)
            while not os.path.exists(os.path.join(hold, "release")):
                time.sleep(0.2)
        return {"gen": gen, "worker": worker, "slice": env["TPU_NAME"],
                "node": ray.get_runtime_context().get_node_id()}

    ray.init(address)
    refs = tpu.run_on_slice(member, topology=topology, accelerator_version="v6e", name=name,
                            timeout=900)
    print("JSON " + json.dumps(ray.get(refs, timeout=900)), flush=True)
"""


def results(p, timeout):
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out
    return [json.loads(l[5:]) for l in out.splitlines() if l.startswith("JSON ")][0]


def held(hold):
    return sorted(f for f in os.listdir(hold) if not f.endswith(".tmp") and f != "release")


def test_a_gang_brings_one_whole_slice_that_goes_whole_once_idle(scaled):
    c = scaled
    assert [n["is_head_node"] for n in alive(c)] == [True], "only the head's node at first"
    p = driver(c, GANG, "one", "-", "4x4")
    members = results(p, SLICE_TIMEOUT + 120)
    assert sorted(m["worker"] for m in members) == ["0", "1", "2", "3"]
    assert len({m["slice"] for m in members}) == 1 and len({m["node"] for m in members}) == 4
    hosts = scaled_nodes(c, "v6e-16")
    assert len(hosts) == 4, hosts
    assert len({h["labels"][INSTANCE] for h in hosts}) == 1, "one launch for the four hosts"
    assert {h["labels"]["tpuray.io/tpu-slice-name"] for h in hosts} == {members[0]["slice"]}
    ids = {h["node_id"] for h in hosts}
    # Idle for 6 s: the slice goes, all four hosts, as one removal.
    wait_for("the idle slice to be removed", lambda: not scaled_nodes(c, "v6e-16"), 120)
    dead = [n for n in json.loads(cli(c, "list", "nodes", "--format", "json"))
            if n["node_id"] in ids]
    assert all(n["state"] == "DEAD" for n in dead), dead
    wait_for("the totals", lambda: "v6e-16: 1 launched, 1 removed" in autoscaler_section(c), 30)
    # The head's /metrics counts them by node type.
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{c.dashboard_port}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    for family in ("tpuray_autoscaler_launches_total", "tpuray_autoscaler_removals_total"):
        line = [l for l in metrics.splitlines() if l.startswith(family) and 'NodeType="v6e-16"' in l]
        assert len(line) == 1 and line[0].endswith(" 1"), (family, line)


def test_two_gangs_two_slices_a_third_waits_v6e_64_is_infeasible_and_a_lost_host_replaces_the_slice(scaled):
    c = scaled
    hold = c.tmp / "hold"
    hold.mkdir()
    a = driver(c, GANG, "ga", str(hold), "4x4")
    b = driver(c, GANG, "gb", str(hold), "4x4")
    big = driver(c, GANG, "big", "-", "8x8")
    third = None
    try:
        wait_for("both gangs to start", lambda: len(held(hold)) == 8, SLICE_TIMEOUT * 2)
        slices = {n["labels"][INSTANCE] for n in scaled_nodes(c, "v6e-16")}
        assert len(slices) == 2, slices
        third = driver(c, GANG, "gc", str(hold), "4x4")
        text = wait_for("the third gang to be reported waiting",
                        lambda: (lambda s: s if "gang:gc" in s and "max_workers" in s else "")(
                            autoscaler_section(c)), 120)
        assert "v6e-16: 3 launched" in text, "the first test's slice and these two: " + text
        assert "Infeasible (never scaled for):" in text and "v6e-64" in text, text
        assert len(scaled_nodes(c, "v6e-16")) == 8, "no third slice"
        assert not any("v6e-64" in json.dumps(n["labels"]) for n in alive(c)), "nothing for v6e-64"
        assert third.poll() is None and not [f for f in held(hold) if f.startswith("gc-")]
        third.kill()
        third.wait()
        # Kill one host of gang ga's slice: the slice is removed whole and replaced whole.
        victim = int((hold / "ga-2-0").read_text())
        lost_slice = [n["labels"][INSTANCE] for n in scaled_nodes(c, "v6e-16")
                      if n["pid"] == victim]
        assert len(lost_slice) == 1, lost_slice
        old = {n["node_id"] for n in scaled_nodes(c, "v6e-16")
               if n["labels"][INSTANCE] != lost_slice[0]}
        assert len(old) == 4, old
        os.kill(victim, signal.SIGKILL)
        wait_for("gang ga to run again", lambda: len([f for f in held(hold) if f.startswith("ga-") and f.endswith("-1")]) == 4,
                 SLICE_TIMEOUT * 2)
        wait_for("the lost slice's other hosts to go",
                 lambda: not [n for n in scaled_nodes(c, "v6e-16")
                              if n["labels"][INSTANCE] == lost_slice[0]], 120)
        now = scaled_nodes(c, "v6e-16")
        assert len(now) == 8, now
        assert old <= {n["node_id"] for n in now}, "gang gb's slice was left alone"
        (hold / "release").write_text("")
        ga, gb = results(a, 300), results(b, 300)
        assert {m["gen"] for m in ga} == {"1"} and {m["gen"] for m in gb} == {"0"}
        assert len({m["slice"] for m in ga}) == 1 and ga[0]["slice"] != lost_slice[0]
        assert "v6e-16: 4 launched" in autoscaler_section(c)
    finally:
        (hold / "release").write_text("")
        for p in (a, b, big, third):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_request_resources_brings_cpu_workers_up_to_max_workers(scaled):
    c = scaled
    # The last test's slices go once idle; none comes back for CPU work.
    wait_for("the idle slices to go", lambda: not scaled_nodes(c, "v6e-16"), 120)
    script = """
        import sys
        import tpuray as ray
        from tpuray.autoscaler.sdk import request_resources
        ray.init(sys.argv[1])
        for bad, exc in ((1.5, TypeError), (-1, ValueError)):
            try:
                request_resources(num_cpus=bad)
            except exc:
                pass
            else:
                raise SystemExit(f"num_cpus={bad} was accepted")
        request_resources(bundles=[{"CPU": 1}] * int(sys.argv[2]))
        print("REQUESTED", flush=True)
    """
    p = driver(c, script, "6")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and "REQUESTED" in out, out
    wait_for("four CPU workers", lambda: len(scaled_nodes(c, "cpu")) == 4, SLICE_TIMEOUT)
    text = wait_for("the unmet part to be reported",
                    lambda: (lambda s: s if "{CPU: 1} x 2 not held" in s else "")(autoscaler_section(c)), 60)
    assert "cpu: 4 launched" in text, text
    assert len(scaled_nodes(c, "cpu")) == 4, "never above max_workers"
    assert not scaled_nodes(c, "v6e-16"), "CPU demand launches no slice"
    # The request replaced by an empty one: the idle workers go.
    p = driver(c, script, "0")
    assert p.wait(timeout=120) == 0
    wait_for("the CPU workers to be removed", lambda: not scaled_nodes(c, "cpu"), 120)


def test_the_head_stopping_stops_every_node_the_autoscaler_started(scaled):
    c = scaled
    script = """
        import sys
        import tpuray as ray
        from tpuray.autoscaler.sdk import request_resources
        ray.init(sys.argv[1])
        request_resources(num_cpus=2)
    """
    assert driver(c, script).wait(timeout=120) == 0
    wait_for("two CPU workers", lambda: len(scaled_nodes(c, "cpu")) == 2, SLICE_TIMEOUT)
    started = [l for l in ps() if "/autoscaler/" in l and str(c.tmp) in l]
    assert started, ps()
    head = [l for l in ps() if " _head " in f" {l} " and str(c.tmp) in l]
    assert len(head) == 1, head
    os.kill(int(head[0].split()[0]), signal.SIGTERM)
    wait_for("every process the autoscaler started to exit",
             lambda: not [l for l in ps() if "/autoscaler/" in l and str(c.tmp) in l], 120)
