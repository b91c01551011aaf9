"""The state API (``tpuray.util.state``, ``tpuray list --filter``/``get``/``summary``, and
Ray 2.60's own ``ray list``/``ray.util.state`` against tpuray's head): filters applied to
every row before the limit (ray#50378), Ray's classes and field names, summaries.

One driver script runs 10,000 tasks, starts 5 that stay running, runs 10,000 more, and
then asks for the running ones: exactly those 5 come back, from a head holding 20,005
tasks, with the default limit of 100.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY_VENV = Path(os.environ.get("RAY_CLIENT_VENV", ROOT / ".ray-client-venv"))


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e["HOME"] = str(tmp_path / "home")
    e["TPURAY_REGISTRY_DIR"] = str(tmp_path / "registry")
    for k in ("TPURAY_ADDRESS", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        e.pop(k, None)
    os.makedirs(e["HOME"], exist_ok=True)
    return e


SCRIPT = """
import json, os, sys, time
import tpuray as ray
from tpuray.util.state import (
    list_tasks, list_actors, list_nodes, list_workers, list_jobs, list_placement_groups,
    get_actor, get_node, get_task, summarize_tasks, summarize_actors, TaskState,
)
ray.init(num_cpus=8)
release = sys.argv[1]

@ray.remote
def tiny(i):
    return i

@ray.remote
def hold(i):
    while not os.path.exists(release):
        time.sleep(0.05)
    return i

@ray.remote
class Keeper:
    def ping(self):
        return "pong"

keeper = Keeper.options(name="keeper").remote()
ray.get(keeper.ping.remote())
assert sum(ray.get([tiny.remote(i) for i in range(10_000)])) == sum(range(10_000))
held = [hold.remote(i) for i in range(5)]
assert sum(ray.get([tiny.remote(i) for i in range(10_000)])) == sum(range(10_000))

deadline = time.time() + 60
while True:
    running = list_tasks(filters=[("state", "=", "RUNNING")])
    if len(running) == 5 or time.time() > deadline:
        break
    time.sleep(0.5)
out = {
    "running": sorted(t.name for t in running),
    "running_is_taskstate": all(isinstance(t, TaskState) for t in running),
    "by_key": running[0]["state"], "by_get": running[0].get("func_or_class_name"),
    "default_limit": len(list_tasks()),
    "tiny_counts": summarize_tasks()["cluster"]["summary"]["tiny"]["state_counts"],
    "limit_cut": len(list_tasks(filters=[("name", "=", "tiny")], limit=10_000, raise_on_missing_output=False)),
    "keeper": [(a.name, a.state, a.class_name) for a in list_actors(filters=[("name", "=", "keeper")])],
    "keeper_by_id": get_actor(list_actors()[0].actor_id).state,
    "nodes": [(n.state, n.is_head_node) for n in list_nodes()],
    "node_by_id": get_node(list_nodes()[0].node_id).state,
    "task_by_id": get_task(running[0].task_id).name,
    "workers": len(list_workers()) > 0,
    "jobs": [j.type for j in list_jobs()],
    "summary": summarize_tasks()["cluster"]["summary"]["hold"]["state_counts"],
    "actor_summary": summarize_actors()["cluster"]["summary"]["Keeper"]["state_counts"],
}
try:
    list_tasks(filters=[("bogus", "=", "1")])
except Exception as e:
    out["bad_filter"] = f"{type(e).__name__}: {e}"
from tpuray import _tpuray
head = _tpuray.process_info()["head_address"]
print("HEAD", head, flush=True)
print("OUT", json.dumps(out), flush=True)
# Hold the cluster while the test asks the CLI and Ray's own client.
while not os.path.exists(release + ".done"):
    time.sleep(0.1)
open(release, "w").close()
ray.get(held)
ray.shutdown()
"""


def test_filters_apply_before_the_limit_and_rays_tools_read_the_same_rows(tmp_path, env):
    """STATE-1: rows come back as Ray's classes with Ray's field names, read alike by Ray's
    own client; STATE-2: filters apply to every row before the limit."""
    script = tmp_path / "state.py"
    script.write_text(textwrap.dedent(SCRIPT))
    release = tmp_path / "release"
    p = subprocess.Popen(
        [sys.executable, str(script), str(release)], env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        head = out = None
        deadline = time.time() + 600
        while out is None and time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                p.wait(timeout=30)
                break
            if line.startswith("HEAD "):
                head = line.split()[1]
            if line.startswith("OUT "):
                out = json.loads(line[4:])
        assert out is not None, p.stderr.read() if p.poll() is not None else "no output"
        assert out["running"] == ["hold"] * 5, out
        assert out["running_is_taskstate"] and out["by_key"] == "RUNNING" and out["by_get"] == "hold"
        assert out["default_limit"] == 100, out
        assert out["tiny_counts"] == {"FINISHED": 20_000}, out
        assert out["limit_cut"] == 10_000, out
        assert out["keeper"] == [["keeper", "ALIVE", "Keeper"]], out
        assert out["keeper_by_id"] == "ALIVE" and out["node_by_id"] == "ALIVE"
        assert out["task_by_id"] == "hold"
        assert out["nodes"] == [["ALIVE", True]] and out["workers"]
        assert out["jobs"] == ["DRIVER"], out
        assert out["summary"] == {"RUNNING": 5}, out
        assert out["actor_summary"] == {"ALIVE": 1}, out
        assert "bogus" in out["bad_filter"] and "not supported" in out["bad_filter"], out

        cli = [sys.executable, "-m", "tpuray"]
        r = subprocess.run(cli + ["list", "tasks", "--filter", "state=RUNNING", "--format", "json",
                                  "--address", head], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert [t["name"] for t in json.loads(r.stdout)] == ["hold"] * 5
        r = subprocess.run(cli + ["summary", "tasks", "--address", head], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "total_tasks: 20006" in r.stdout, r.stdout  # 20,005 tasks and the actor's call
        assert any(l.split()[:3] == ["hold", "RUNNING:", "5"] for l in r.stdout.splitlines()), r.stdout

        ray = RAY_VENV / "bin" / "ray"
        if not ray.exists():
            pytest.fail(f"Ray 2.60's client is missing at {ray}: run scripts/python-tests.sh, which installs it")
        url = subprocess.run(
            [sys.executable, "-c", "import sys; from tpuray.job_submission import JobSubmissionClient as C; "
             "print(C(sys.argv[1]).get_address())", head], env=env, capture_output=True, text=True,
        ).stdout.strip()
        assert url.startswith("http://"), url
        token = (Path(env["HOME"]) / ".tpuray" / "auth_token").read_text().strip()
        renv = dict(env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        r = subprocess.run(
            [str(RAY_VENV / "bin" / "python"), "-c", textwrap.dedent(f"""
                from ray.util.state import list_tasks, summarize_tasks
                t = list_tasks(address={url!r}, filters=[("state", "=", "RUNNING")])
                print(sorted(x.name for x in t), summarize_tasks(address={url!r})["cluster"]["total_tasks"])
            """)], env=renv, capture_output=True, text=True, timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "['hold', 'hold', 'hold', 'hold', 'hold'] 20006", r.stdout
        r = subprocess.run([str(ray), "list", "tasks", "--address", url, "--filter", "state=RUNNING",
                            "--format", "json"], env=renv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert [t["name"] for t in json.loads(r.stdout)] == ["hold"] * 5
    finally:
        (tmp_path / "release.done").touch()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
