"""Tests of the ``tpuray`` console script installed by the Python package.

They run the installed script as a user would, so they test the wheel: the
console script, the extension module, and the processes that ``tpuray
start`` spawns through ``TPURAY_SELF_COMMAND`` (``python -m tpuray ...``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tpuray


def _tpuray_script() -> str:
    """Returns the path of the installed ``tpuray`` console script."""
    beside = Path(sys.executable).parent / "tpuray"
    if beside.exists():
        return str(beside)
    found = shutil.which("tpuray")
    if found is None:
        pytest.fail("the tpuray console script is not installed")
    return found


TPURAY = _tpuray_script()


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 90):
    return subprocess.run(
        [TPURAY, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _registry_entries(registry: Path) -> list[dict]:
    entries = []
    for p in sorted(registry.glob("proc-*.json")):
        try:
            entries.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return entries


def test_help():
    r = _run(["--help"])
    assert r.returncode == 0, r.stderr
    for verb in ("start", "status", "list", "stop"):
        assert verb in r.stdout
    # Hidden verbs stay hidden.
    assert "_head" not in r.stdout


def test_version():
    r = _run(["--version"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"tpuray {tpuray.__version__}"


def test_usage_error_exit_code():
    r = _run(["no-such-verb"])
    assert r.returncode == 2
    assert "no-such-verb" in r.stderr


def test_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "tpuray", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"tpuray {tpuray.__version__}"


def test_worker_verb_runs_through_python():
    """``python -m tpuray _worker`` reaches the Rust worker (which needs the
    agent's environment and says so) rather than failing in Python."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPURAY_")}
    r = subprocess.run(
        [sys.executable, "-m", "tpuray", "_worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("tpuray: worker process"), r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def cluster_env(tmp_path: Path):
    """An environment whose cluster state (auth token, registry, sessions)
    lives under `tmp_path`; stops whatever was started there afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    registry = tmp_path / "registry"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TPURAY_SELF_COMMAND", "TPURAY_ADDRESS", "TPURAY_AUTH_TOKEN")
    }
    env.update(HOME=str(home), TPURAY_REGISTRY_DIR=str(registry))
    try:
        yield env, registry, tmp_path / "sessions"
    finally:
        _run(["stop", "--force"], env=env, timeout=60)
        for e in _registry_entries(registry):
            pid = e.get("pid")
            if pid and _alive(pid) and "tpuray" in " ".join(_cmdline(pid)):
                os.kill(pid, 9)


def test_start_status_list_stop(cluster_env):
    env, registry, temp_dir = cluster_env
    port = _free_port()
    r = _run(
        [
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "1",
            "--temp-dir",
            str(temp_dir),
        ],
        env=env,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert f"127.0.0.1:{port}" in r.stdout

    # The head and the agent were started through the Python interpreter:
    # `python -m tpuray _head|_agent ...`, as TPURAY_SELF_COMMAND says.
    entries = _registry_entries(registry)
    kinds = sorted(e["kind"] for e in entries)
    assert kinds == ["agent", "head"], entries
    for e in entries:
        assert _alive(e["pid"]), e
        argv = _cmdline(e["pid"])
        # The console script's interpreter: the same Python, possibly under
        # another name (python3 vs python).
        assert os.path.realpath(argv[0]) == os.path.realpath(sys.executable), argv
        assert argv[1:3] == ["-m", "tpuray"], argv
        assert argv[3] == "_" + e["kind"], argv
        assert "python" in os.path.basename(os.readlink(f"/proc/{e['pid']}/exe"))
        # The spawned processes see the same self command, so the agent's
        # workers also start as `python -m tpuray _worker`.
        environ = Path(f"/proc/{e['pid']}/environ").read_bytes().split(b"\0")
        self_cmd = [v for v in environ if v.startswith(b"TPURAY_SELF_COMMAND=")]
        assert self_cmd, "TPURAY_SELF_COMMAND not passed on"
        value = self_cmd[0].split(b"=", 1)[1].decode()
        assert json.loads(value) == argv[:3]

    r = _run(["status"], env=env)
    assert r.returncode == 0, r.stderr
    assert "1 alive" in r.stdout, r.stdout

    # On a closed pipe the CLI dies of SIGPIPE, as the native binary does,
    # instead of panicking in println!.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run(
            [TPURAY, "status"],
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert r.returncode == -signal.SIGPIPE, r.stderr
    assert "panicked" not in r.stderr, r.stderr

    r = _run(["list", "nodes", "--format", "json"], env=env)
    assert r.returncode == 0, r.stderr
    nodes = json.loads(r.stdout)
    assert isinstance(nodes, list)
    assert [n["state"] for n in nodes] == ["ALIVE"], nodes
    assert nodes[0]["is_head_node"] is True

    pids = [e["pid"] for e in _registry_entries(registry)]
    r = _run(["stop"], env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]
    for e in _registry_entries(registry):
        assert not _alive(e["pid"]), e


def test_a_killed_driver_takes_its_private_cluster_with_it(cluster_env, tmp_path):
    """A driver whose init() started a private cluster (no address, no cluster here) and
    that dies by SIGKILL leaves no head or node agent behind (Ray's fate sharing)."""
    env, registry, _ = cluster_env
    script = tmp_path / "private.py"
    script.write_text(
        "import os, signal, tpuray as ray\n"
        "from tpuray._private import worker\n"
        "ray.init(num_cpus=1)\n"
        "print(worker.state.local_cluster['dir'], flush=True)\n"
        "print(ray.get(ray.remote(lambda: 'ran').remote()), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    private_dir, ran = p.stdout.split()
    assert ran == "ran"

    def left() -> list[int]:
        return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
                and _alive(int(d.name)) and private_dir in " ".join(_cmdline_or_empty(int(d.name)))]

    deadline = time.time() + 30
    while (left() or Path(private_dir).exists()) and time.time() < deadline:
        time.sleep(0.5)
    assert left() == [], f"processes of the killed driver's cluster still run: {left()}"
    assert not Path(private_dir).exists()


def _cmdline_or_empty(pid: int) -> list[str]:
    try:
        return _cmdline(pid)
    except OSError:
        return []


def test_a_killed_driver_s_job_ends_with_its_actor_and_placement_group(cluster_env, tmp_path):
    """HEAD-12: a driver killed with SIGKILL (no FinishJob) is noticed by the head: its job
    ends, its actor dies and its placement group goes, so a rerun can take the names."""
    env, _, temp_dir = cluster_env
    port = _free_port()
    r = _run(["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
              "--dashboard-port", "0", "--num-cpus", "2", "--temp-dir", str(temp_dir)], env=env)
    assert r.returncode == 0, r.stderr
    script = tmp_path / "held.py"
    script.write_text(
        "import time, tpuray as ray\n"
        "from tpuray.util.placement_group import placement_group\n"
        "ray.init()\n"
        "@ray.remote\n"
        "class Holder:\n"
        "    def ping(self):\n"
        "        return 'pong'\n"
        "h = Holder.options(name='holder').remote()\n"
        "pg = placement_group([{'CPU': 0.5}], name='held-pg')\n"
        "ray.get(pg.ready())\n"
        "print(ray.get(h.ping.remote()), flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "pong"
        p.kill()
        p.wait(timeout=30)

        def state():
            jobs = json.loads(_run(["list", "jobs", "--format", "json"], env=env).stdout)
            actors = json.loads(_run(["list", "actors", "--format", "json"], env=env).stdout)
            groups = json.loads(_run(["list", "placement-groups", "--format", "json"], env=env).stdout)
            return jobs, actors, groups

        deadline = time.time() + 30
        while True:
            jobs, actors, groups = state()
            done = (
                [j["state"] for j in jobs if "held.py" in j["entrypoint"]] == ["FINISHED"]
                and [a["state"] for a in actors if a["name"] == "holder"] == ["DEAD"]
                and [g["state"] for g in groups if g["name"] == "held-pg"] == ["REMOVED"]
            )
            if done or time.time() > deadline:
                break
            time.sleep(0.5)
        assert done, (jobs, actors, groups)
    finally:
        if p.poll() is None:
            p.kill()
