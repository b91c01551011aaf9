"""Worker output at the driver and ``tpuray logs``: Ray's repeated-line deduplication
compared with Ray 2.60's recorded driver output (``compat/logs_dedup.driver-lines``),
``RAY_DEDUP_LOGS=0``, ``init(log_to_driver=False)``, and the log files of workers read
back through the head (``tpuray logs``, ``tpuray.util.state.get_log``/``list_logs``,
and Ray's own ``ray.util.state.get_log`` against tpuray's head)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

COMPAT = Path(__file__).parent / "compat"
sys.path.insert(0, str(COMPAT))
from clean_output import driver_lines  # noqa: E402

REPEATED = re.compile(r" \[repeated (\d+)x across cluster\]")


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    for k in ("TPURAY_ADDRESS", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_DEDUP_LOGS"):
        e.pop(k, None)
    e["HOME"] = str(tmp_path / "home")
    e["TPURAY_REGISTRY_DIR"] = str(tmp_path / "registry")
    os.makedirs(e["HOME"])
    return e


def run_compat(name: str, env: dict, **extra) -> subprocess.CompletedProcess:
    env = dict(env, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(COMPAT / "shim")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return subprocess.run(
        [sys.executable, f"{name}.py"], cwd=COMPAT, env=env, capture_output=True, text=True,
        timeout=180,
    )


def shape(lines: str) -> tuple[set[str], int, int]:
    """(distinct lines with counts written K, lines printed plain, occurrences counted)."""
    distinct, plain, counted = set(), 0, 0
    for line in lines.splitlines():
        m = REPEATED.search(line)
        if m:
            counted += int(m.group(1))
        else:
            plain += 1
        distinct.add(REPEATED.sub(" [repeated Kx across cluster]", line))
    return distinct, plain, counted


def test_100_identical_lines_from_10_tasks_reach_the_driver_deduplicated_as_rays(env):
    r = run_compat("logs_dedup", env)
    assert r.returncode == 0, r.stderr
    got = driver_lines(r.stdout)
    want = (COMPAT / "logs_dedup.driver-lines").read_text()
    got_distinct, got_plain, got_counted = shape(got)
    want_distinct, want_plain, want_counted = shape(want)
    # Ray's recording: every line is accounted for, printed or counted, with Ray's text.
    assert want_plain + want_counted == 100, want
    assert got_distinct == want_distinct, f"tpuray:\n{got}\nRay 2.60:\n{want}"
    assert got_plain + got_counted == 100, got
    assert got_counted > 0 and got_plain < 100, got
    # The note on how to turn it off comes once.
    assert got.count("Set RAY_DEDUP_LOGS=0") == 1, got
    # The script's own lines stay in order around them.
    assert r.stdout.splitlines()[-1] == "done", r.stdout


def test_worker_lines_carry_rays_prefixes_an_actors_repr_included(env):
    r = run_compat("logs_prefixes", env)
    assert r.returncode == 0, r.stderr
    got = sorted(driver_lines(r.stdout).splitlines())
    want = sorted((COMPAT / "logs_prefixes.driver-lines").read_text().splitlines())
    assert got == want, f"tpuray:\n{r.stdout}\nRay 2.60:\n{want}"
    # Lines a worker writes to stderr go to the driver's stderr.
    assert driver_lines(r.stderr).splitlines() == ["(task pid=N) from the task, on stderr"], r.stderr


def test_ray_dedup_logs_0_prints_every_line(env):
    r = run_compat("logs_dedup", env, RAY_DEDUP_LOGS="0")
    assert r.returncode == 0, r.stderr
    got = driver_lines(r.stdout).splitlines()
    assert got == ["(f pid=N) hello from the tasks"] * 100, r.stdout


def test_a_bad_dedup_regex_is_refused_at_init_by_name(env):
    r = run_compat("logs_dedup", env, RAY_DEDUP_LOGS_SKIP_REGEX="(unclosed")
    assert r.returncode != 0
    assert "RAY_DEDUP_LOGS_SKIP_REGEX" in r.stderr and "(unclosed" in r.stderr, r.stderr[-2000:]
    # The local cluster init started for it stopped with the failed init.
    assert heads_started_from(COMPAT) == [], "init left its local cluster running"


def heads_started_from(cwd: Path) -> list[int]:
    """Pids of tpuray heads this interpreter's package started with ``cwd`` as their
    working directory (a local cluster of a compat script)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            here = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if here == str(cwd) and cmd[0] == sys.executable.encode() and b"_head" in cmd:
            found.append(int(pid))
    return found


ROOT = Path(__file__).resolve().parents[2]
RAY_VENV = Path(os.environ.get("RAY_CLIENT_VENV", ROOT / ".ray-client-venv"))

HOLD = """
import json, os, sys, time
import tpuray as ray
ray.init(num_cpus=2, log_to_driver=False)


@ray.remote
class Greeter:
    def hi(self):
        print("actor line 1")
        print("actor line 2", flush=True)
        print("actor on stderr", file=sys.stderr, flush=True)
        ctx = ray.get_runtime_context()
        return ctx.get_actor_id(), os.getpid(), ctx.get_node_id()


@ray.remote
def f(text):
    print(text)
    return ray.get_runtime_context().get_task_id()


g = Greeter.remote()
actor_id, pid, node_id = ray.get(g.hi.remote())
first = ray.get(f.remote("the first task"))
second = ray.get(f.remote("the second task"))
from tpuray import _tpuray
print("OUT", json.dumps({"head": _tpuray.process_info()["head_address"], "actor": actor_id,
      "pid": pid, "node": node_id, "first": first, "second": second}), flush=True)
more, kill = sys.argv[1] + ".more", sys.argv[1] + ".kill"
while not os.path.exists(sys.argv[1]):
    if os.path.exists(more):
        os.remove(more)
        ray.get(g.hi.remote())
    if os.path.exists(kill):
        os.remove(kill)
        ray.kill(g)
        print("KILLED", flush=True)
    time.sleep(0.1)
ray.shutdown()
"""


def until_ok(fn, limit=60):
    """``fn()`` until it returns a CompletedProcess with exit 0 (task events travel in the
    background), at most ``limit`` seconds; the last one."""
    import time

    deadline = time.time() + limit
    while True:
        r = fn()
        if r.returncode == 0 or time.time() > deadline:
            return r
        time.sleep(0.3)


def test_tpuray_logs_prints_actor_task_and_worker_output_and_log_to_driver_false_stops_forwarding(
    tmp_path, env
):
    import json
    import time

    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(HOLD))
    release = tmp_path / "release"
    p = subprocess.Popen([sys.executable, str(script), str(release)], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = None
        head_out: list[str] = []
        deadline = time.time() + 120
        while out is None and time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            head_out.append(line)
            if line.startswith("OUT "):
                out = json.loads(line[4:])
        assert out is not None, p.stderr.read() if p.poll() is not None else "no output"
        head = out["head"]
        cli = [sys.executable, "-m", "tpuray", "logs"]

        def run(*args, timeout=60):
            return subprocess.run(cli + list(args) + ["--address", head], env=env,
                                  capture_output=True, text=True, timeout=timeout)

        r = run("actor", "--id", out["actor"])
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("--- Log has been truncated to last 1000 lines."), r.stdout
        assert "actor line 1\nactor line 2\n" in r.stdout, r.stdout
        assert "actor on stderr" not in r.stdout
        r = run("actor", "--id", out["actor"], "--err", "--tail", "-1")
        assert r.returncode == 0 and "actor on stderr" in r.stdout and "truncated" not in r.stdout, r
        r = run("actor", "--id", out["actor"], "--tail", "1")
        assert r.stdout.splitlines()[2:] == ["actor line 2"], r.stdout
        r = run("worker", "--pid", str(out["pid"]))
        assert r.returncode == 0 and "actor line 2" in r.stdout, r
        # A task's part of its worker's log: its own line, not the other task's.
        r = until_ok(lambda: run("task", "--id", out["second"], "--tail", "-1"))
        assert r.returncode == 0, r.stderr
        assert r.stdout == "the second task\n", r.stdout
        r = run("task", "--id", out["first"], "--attempt-number", "3")
        assert r.returncode != 0 and "attempt" in r.stderr, r
        # The listing groups the files as Ray's does; a glob naming one prints it.
        r = run("--node-id", out["node"])
        assert r.returncode == 0 and "worker_out:" in r.stdout and f"-{out['pid']}.out" in r.stdout, r
        r = run("cluster", f"*-{out['pid']}.err", "--tail", "-1")
        assert r.returncode == 0 and r.stdout.strip().endswith("actor on stderr"), r
        r = run("actor")
        assert r.returncode != 0 and "--pid" in r.stderr, r
        r = run("actor", "--id", "ffffffffffffffff")
        assert r.returncode != 0 and "not found" in r.stderr, r

        # --follow prints what the actor writes later.
        f = subprocess.Popen(cli + ["actor", "--id", out["actor"], "--follow", "--tail", "0",
                                    "--address", head], env=env, stdout=subprocess.PIPE, text=True)
        try:
            import queue
            import threading

            followed: queue.Queue = queue.Queue()
            threading.Thread(target=lambda: [followed.put(l) for l in f.stdout], daemon=True).start()
            time.sleep(1.0)
            (tmp_path / "release.more").touch()
            seen = []
            while "actor line 2\n" not in seen:
                seen.append(followed.get(timeout=30))
            assert seen == ["actor line 1\n", "actor line 2\n"], seen
        finally:
            f.kill()
            f.wait(timeout=10)

        # A dead actor's log stays readable (its last node and pid name the file).
        (tmp_path / "release.kill").touch()
        while (line := p.stdout.readline()).strip() != "KILLED":
            assert line, "the driver ended before killing its actor"
        r = until_ok(lambda: run("actor", "--id", out["actor"], "--tail", "2"))
        assert r.returncode == 0 and r.stdout.splitlines()[2:] == ["actor line 1", "actor line 2"], r

        # tpuray.util.state's get_log and list_logs, Ray's signatures.
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import json
            from tpuray.util.state import get_log, list_logs
            logs = list_logs(address={head!r}, node_id={out['node']!r}, glob_filter="*worker*")
            actor = "".join(get_log(address={head!r}, actor_id={out['actor']!r}, tail=-1))
            task = "".join(get_log(address={head!r}, task_id={out['first']!r}))
            raw = b"".join(get_log(address={head!r}, task_id={out['first']!r}, encoding=None))
            try:
                list(get_log(address={head!r}, actor_id={out['actor']!r}, suffix="log"))
            except ValueError as e:
                bad = str(e)
            print(json.dumps(dict(logs=logs, actor=actor, task=task, raw=raw.decode(), bad=bad)))
        """)], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert any(n.endswith(f"-{out['pid']}.out") for n in got["logs"]["worker_out"]), got
        assert "actor line 1\nactor line 2\n" in got["actor"], got
        assert got["task"] == got["raw"] == "the first task\n", got
        assert "suffix" in got["bad"], got
        # Ray 2.60's own get_log/list_logs read the same log from tpuray's head: Ray's
        # requests and its handling of the answers. Ray finds the API server's URL in
        # its GCS (ray_address_to_api_server_url), which tpuray does not speak: the URL
        # is given to it directly.
        ray_py = RAY_VENV / "bin" / "python"
        if not ray_py.exists():
            pytest.fail(f"Ray 2.60's client is missing at {ray_py}: run scripts/python-tests.sh, which installs it")
        url = subprocess.run(
            [sys.executable, "-c", "import sys; from tpuray.job_submission import JobSubmissionClient as C; "
             "print(C(sys.argv[1]).get_address())", head], env=env, capture_output=True, text=True,
        ).stdout.strip()
        token = (Path(env["HOME"]) / ".tpuray" / "auth_token").read_text().strip()
        renv = dict(env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        r = subprocess.run(
            [str(ray_py), "-c", textwrap.dedent(f"""
                import ray.util.state.api as api
                from ray.util.state import get_log, list_logs
                api.ray_address_to_api_server_url = lambda address: address
                print("".join(get_log(address={url!r}, actor_id={out['actor']!r}, tail=1)), end="")
                print(sorted(list_logs(address={url!r}, node_id={out['node']!r}, glob_filter="*{out['pid']}*")))
            """)], env=renv, capture_output=True, text=True, timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout == "actor line 2\n['worker_err', 'worker_out']\n", r.stdout
    finally:
        release.touch()
        try:
            rest, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            rest, err = p.communicate()
    # log_to_driver=False: nothing the workers printed reached the driver.
    printed = "".join(head_out) + rest
    assert "actor line" not in printed and "the first task" not in printed, printed
    assert "actor on stderr" not in err, err[-2000:]
