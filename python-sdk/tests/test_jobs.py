"""The Jobs API end to end: a real two-node cluster (head + one node, started with the
`tpuray` CLI, its own HOME, token, registry and ports), driven by tpuray's own clients
(``tpuray.job_submission.JobSubmissionClient`` and ``tpuray job ...``) and by Ray 2.60's
(``ray.job_submission.JobSubmissionClient`` and ``ray job ...``, from PyPI in a venv of
their own, ``.ray-client-venv``, which scripts/python-tests.sh makes).

Covered: a job from a fresh folder with ``working_dir`` and a ``pip`` package the base
environment lacks, whose tasks on both nodes import it; ``job logs -f`` of a job printing
a line a second for 30 s sees every line in order and ends after the last; ``job stop``
stops a running job and its actor's process; a package that does not exist fails the job
fast with pip's error; tokens through ``--headers`` and through Ray's ``RAY_AUTH_MODE=token``
+ ``RAY_AUTH_TOKEN``, a wrong or missing token refused; the same folder gets the same
package URI from both clients; the CLI's address forms (``http://``, the head's gRPC
``HOST:PORT``, this machine's cluster) and exit codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tpuray.exceptions import AuthenticationError
from tpuray.job_submission import JobDetails, JobStatus, JobSubmissionClient, JobType

ROOT = Path(__file__).resolve().parents[2]
#: Ray 2.60's client, from PyPI (scripts/python-tests.sh installs it).
RAY_VENV = Path(os.environ.get("RAY_CLIENT_VENV", ROOT / ".ray-client-venv"))
RAY = RAY_VENV / "bin" / "ray"
RAY_PYTHON = RAY_VENV / "bin" / "python"
TPURAY = str(Path(sys.executable).parent / "tpuray")

#: A tiny pure-Python package this environment lacks, installed into the jobs' venvs.
PIP_PACKAGE = "termcolor"
PIP_REQUIREMENT = "termcolor==2.4.0"
#: Seconds a job with a pip environment may take to end (the venv is built per node).
PIP_JOB_TIMEOUT = 240


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


def _until(what: str, fn, timeout: float, every: float = 0.5):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - reported on timeout
            last = e
        time.sleep(every)
    raise TimeoutError(f"not within {timeout} s: {what} (last error: {last!r})")


class Cluster:
    """A head (resource ``node_a``) and a node (resource ``node_b``) on 127.0.0.1."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        home = tmp / "home"
        home.mkdir()
        self.env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("TPURAY_", "RAY_")) and k != "HOME"
        }
        self.env.update(
            HOME=str(home),
            TPURAY_REGISTRY_DIR=str(tmp / "registry"),
            # Entrypoints run `python` from PATH: this interpreter, which has tpuray.
            PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        )
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_port = _free_port()
        self.url = f"http://127.0.0.1:{self.dashboard_port}"
        self.token = ""
        self.head_out = ""

    def tpuray(self, *args, env=None, timeout=120, cwd=None) -> subprocess.CompletedProcess:
        return subprocess.run([TPURAY, *args], env=env or self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=cwd)

    def start(self) -> None:
        r = self.tpuray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
                        "--dashboard-port", str(self.dashboard_port), "--num-cpus", "3",
                        "--resources", '{"node_a": 10}', "--temp-dir", str(self.tmp / "head"))
        assert r.returncode == 0, r.stdout + r.stderr
        self.head_out = r.stdout
        self.token = (Path(self.env["HOME"]) / ".tpuray" / "auth_token").read_text().strip()
        r = self.tpuray("start", "--address", self.address, "--num-cpus", "3",
                        "--resources", '{"node_b": 10}', "--temp-dir", str(self.tmp / "node"))
        assert r.returncode == 0, r.stdout + r.stderr

    def stop(self) -> None:
        self.tpuray("stop", "--force", timeout=120)

    def log_tails(self, lines: int = 40) -> str:
        out = []
        for f in sorted(self.tmp.glob("*/session_*/logs/*")):
            try:
                text = f.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if text:
                out.append(f"--- {f}\n" + "\n".join(text))
        return "\n".join(out)

    def ray_env(self, **extra) -> dict:
        """An environment for Ray's client: no tpuray variables, Ray's HOME apart."""
        env = {k: v for k, v in self.env.items() if not k.startswith(("TPURAY_", "RAY_"))}
        env["HOME"] = str(self.tmp / "ray-home")
        env.update(extra)
        return env

    def ray(self, *args, env=None, timeout=120, auth=True) -> subprocess.CompletedProcess:
        """Ray's CLI (`ray job ...`) against this cluster's dashboard, with the token in
        --headers unless `auth` is False."""
        head = ["--headers", json.dumps({"Authorization": f"Bearer {self.token}"})] if auth else []
        verb, rest = args[0], list(args[1:])
        return subprocess.run([str(RAY), "job", verb, "--address", self.url, *head, *rest],
                              env=env or self.ray_env(), capture_output=True, text=True, timeout=timeout)

    def ray_sdk(self, script: str, *args, env=None, timeout=PIP_JOB_TIMEOUT) -> dict:
        """Runs `script` with Ray's Python; it prints one JSON line prefixed RESULT."""
        r = subprocess.run([str(RAY_PYTHON), "-c", script, self.url, *args],
                           env=env or self.ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token),
                           capture_output=True, text=True, timeout=timeout)
        found = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        assert r.returncode == 0 and found, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
        return json.loads(found[-1][len("RESULT "):])


@contextlib.contextmanager
def _token_env(token: str):
    """This process sees `token` as the cluster token while the block runs, and no Ray
    address variable (which would override the client's address, Ray's rule)."""
    names = ("TPURAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    old = {k: os.environ.get(k) for k in names}
    for k in names[1:]:
        os.environ.pop(k, None)
    os.environ["TPURAY_AUTH_TOKEN"] = token
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not RAY.exists():
        pytest.fail(f"Ray 2.60's client is not installed at {RAY_VENV}: run scripts/python-tests.sh, "
                    "which makes it (pip install 'ray[default]==2.60.0' into a venv of its own)")
    c = Cluster(tmp_path_factory.mktemp("jobs"))
    try:
        c.start()
        yield c
    except BaseException:
        print(c.log_tails())
        raise
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with _token_env(cluster.token):
        yield JobSubmissionClient(cluster.url)


def _wait_end(client, job_id: str, timeout: float) -> JobDetails:
    def ended():
        info = client.get_job_info(job_id)
        return info if info.status.is_terminal() else None

    return _until(f"job {job_id} ends", ended, timeout)


def _folder(tmp: Path, files: dict) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(textwrap.dedent(text))
    return tmp


#: The job of the pip test: tasks pinned to each node import the package and a module
#: of the working dir.
TWO_NODE_JOB = """
import importlib.metadata
import tpuray as ray

import helper
import termcolor

ray.init()


@ray.remote
def where():
    import helper
    import termcolor
    return (ray.get_runtime_context().get_node_id(), importlib.metadata.version("termcolor"),
            termcolor.colored("x", "red") != "", helper.VALUE, open("data.txt").read().strip())


a = ray.get(where.options(resources={"node_a": 1}).remote())
b = ray.get(where.options(resources={"node_b": 1}).remote())
print("RESULT", a[0], b[0], a[1], b[1], a[2] and b[2], a[3], b[3], a[4], b[4], helper.VALUE, flush=True)
"""


def test_the_address_is_printed_and_the_pip_package_is_absent_here(cluster):
    assert f"Dashboard: {cluster.url}" in cluster.head_out, cluster.head_out
    assert importlib.util.find_spec(PIP_PACKAGE) is None, f"{PIP_PACKAGE} must not be installed in {sys.prefix}"


def test_a_working_dir_job_with_pip_runs_tasks_on_both_nodes_that_import_the_package(cluster, client, tmp_path):
    wd = _folder(tmp_path / "fresh", {"job.py": TWO_NODE_JOB, "helper.py": "VALUE = 'from-helper'\n",
                                      "data.txt": "from-data\n", ".git/HEAD": "ignored\n"})
    assert client.get_version()
    assert client.get_address() == cluster.url
    job_id = client.submit_job(entrypoint="python job.py",
                               runtime_env={"working_dir": str(wd), "pip": [PIP_REQUIREMENT]},
                               metadata={"case": "pip"})
    info = _wait_end(client, job_id, PIP_JOB_TIMEOUT)
    logs = client.get_job_logs(job_id)
    assert info.status == JobStatus.SUCCEEDED, f"{info}\n{logs}"
    line = next(li for li in logs.splitlines() if li.startswith("RESULT "))
    _, node_a, node_b, v_a, v_b, colored, h_a, h_b, d_a, d_b, h_driver = line.split()
    assert node_a != node_b, line
    assert v_a == v_b == PIP_REQUIREMENT.split("==")[1], line
    assert (colored, h_a, h_b, d_a, d_b, h_driver) == ("True", *["from-helper"] * 2, *["from-data"] * 2, "from-helper")
    assert info.type == JobType.SUBMISSION
    assert info.submission_id == job_id and info.metadata == {"case": "pip"}
    assert info.runtime_env["working_dir"].startswith("gcs://_ray_pkg_")
    assert info.message == "Job finished successfully."
    assert info.start_time and info.end_time and info.end_time >= info.start_time
    assert any(j.submission_id == job_id for j in client.list_jobs())

    # Ray's own client: the same folder gets the same package URI (so no second upload),
    # and its job with the same pip list runs in the venvs already built.
    script = textwrap.dedent("""
        import json, sys, time
        from ray.job_submission import JobSubmissionClient, JobStatus
        c = JobSubmissionClient(sys.argv[1])
        sid = c.submit_job(entrypoint="python job.py", runtime_env={"working_dir": sys.argv[2], "pip": [sys.argv[3]]})
        while not c.get_job_status(sid).is_terminal():
            time.sleep(0.5)
        info = c.get_job_info(sid)
        print("RESULT " + json.dumps({"status": str(info.status), "wd": info.runtime_env["working_dir"],
                                      "logs": c.get_job_logs(sid), "version": c.get_version(),
                                      "listed": [j.submission_id for j in c.list_jobs()]}))
    """)
    r = cluster.ray_sdk(script, str(wd), PIP_REQUIREMENT)
    assert r["status"] == "SUCCEEDED", r["logs"]
    assert r["wd"] == info.runtime_env["working_dir"]
    assert "RESULT " in r["logs"] and job_id in r["listed"]


def test_logs_follow_sees_all_30_lines_in_order_and_ends_after_the_last(cluster, client):
    body = "import time\nfor i in range(30):\n    print(f'line {i}', flush=True)\n    time.sleep(1)\n"
    r = cluster.ray("submit", "--no-wait", "--submission-id", "follow-30", "--", "python", "-u", "-c", body)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Job 'follow-30' submitted successfully" in r.stdout, r.stdout
    # Ray's `ray job logs -f` and tpuray's `tpuray job logs -f`, side by side.
    ray_f = subprocess.Popen([str(RAY), "job", "logs", "-f", "follow-30", "--address", cluster.url, "--headers",
                              json.dumps({"Authorization": f"Bearer {cluster.token}"})],
                             env=cluster.ray_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ours = subprocess.Popen([TPURAY, "job", "logs", "--follow", "follow-30", "--address", cluster.url],
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    expected = [f"line {i}" for i in range(30)]
    for name, p in (("ray", ray_f), ("tpuray", ours)):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"{name}: {out}\n{err}"
        lines = [li for li in out.splitlines() if li.startswith("line ")]
        assert lines == expected, f"{name}:\n{out}\n{err}"
        assert "Job 'follow-30' succeeded" in out, f"{name}: {out}"
        # The follower ended because the job did, after its last line.
        assert out.index("line 29") < out.index("Job 'follow-30' succeeded")
    assert client.get_job_status("follow-30") == JobStatus.SUCCEEDED

    async def tail():
        return "".join([chunk async for chunk in client.tail_job_logs("follow-30")])

    # A tail of a job that ended returns everything, then stops.
    text = asyncio.run(asyncio.wait_for(tail(), 60))
    assert [li for li in text.splitlines() if li.startswith("line ")] == expected


STOP_JOB = """
import os, time
import tpuray as ray

ray.init()


@ray.remote
class Sleeper:
    def pid(self):
        return os.getpid()


s = Sleeper.remote()
print("PIDS", os.getpid(), ray.get(s.pid.remote()), flush=True)
time.sleep(600)
"""


def test_stop_stops_a_running_job_and_its_actor(cluster, client, tmp_path):
    wd = _folder(tmp_path / "stop", {"job.py": STOP_JOB})
    job_id = client.submit_job(entrypoint="python job.py", runtime_env={"working_dir": str(wd)})
    line = _until("the job prints its pids",
                  lambda: next((li for li in client.get_job_logs(job_id).splitlines() if li.startswith("PIDS")), None),
                  90)
    driver_pid, actor_pid = (int(x) for x in line.split()[1:])
    assert _alive(driver_pid) and _alive(actor_pid)
    assert client.get_job_status(job_id) == JobStatus.RUNNING
    r = cluster.ray("stop", job_id, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Attempting to stop job '{job_id}'" in r.stdout and f"Job '{job_id}' was stopped" in r.stdout, r.stdout
    info = client.get_job_info(job_id)
    assert info.status == JobStatus.STOPPED and info.message == "Job was intentionally stopped.", info
    _until("the entrypoint's process is gone", lambda: not _alive(driver_pid), 30)
    _until("the job's actor's process is gone", lambda: not _alive(actor_pid), 30)
    # Stopping again: the job is no longer running.
    assert client.stop_job(job_id) is False
    # A job that ended can be deleted, once.
    r = cluster.tpuray("job", "delete", job_id, "--address", cluster.url)
    assert r.returncode == 0 and f"Job '{job_id}' deleted successfully" in r.stdout, r.stdout + r.stderr
    with pytest.raises(RuntimeError, match="status code 404"):
        client.get_job_info(job_id)


def test_a_package_that_does_not_exist_fails_the_job_fast_with_pips_error(cluster, client):
    start = time.time()
    job_id = client.submit_job(entrypoint="python -c 'print(1)'",
                               runtime_env={"pip": ["tpuray-no-such-package-3141592==0.0.1"]})
    info = _wait_end(client, job_id, 120)
    took = time.time() - start
    assert info.status == JobStatus.FAILED, info
    assert re.search(r"No matching distribution|Could not find a version", info.message or ""), info.message
    assert "tpuray-no-such-package-3141592" in info.message
    assert took < 90, f"took {took:.0f} s"
    # Ray's CLI says the same.
    r = cluster.ray("status", job_id)
    assert r.returncode == 0 and f"Job '{job_id}' failed" in r.stdout and "Status message:" in r.stdout, r.stdout


def test_tokens_through_headers_and_rays_auth_env_and_wrong_or_missing_ones_are_refused(cluster):
    r = cluster.ray("list")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "JobDetails(" in r.stdout, r.stdout
    r = cluster.ray("list", auth=False, env=cluster.ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=cluster.token))
    assert r.returncode == 0, r.stdout + r.stderr
    r = cluster.ray("list", auth=False)
    assert r.returncode != 0 and "Authentication required" in r.stdout + r.stderr, r.stdout + r.stderr
    r = cluster.ray("list", auth=False, env=cluster.ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="wrong"))
    assert r.returncode != 0 and "Authentication failed" in r.stdout + r.stderr, r.stdout + r.stderr
    r = subprocess.run([str(RAY), "job", "list", "--address", cluster.url, "--headers",
                        json.dumps({"Authorization": "Bearer wrong"})],
                       env=cluster.ray_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Authentication failed" in r.stdout + r.stderr, r.stdout + r.stderr

    # tpuray's client: the token of the environment, or --headers/headers=, which win.
    with _token_env("wrong"):
        with pytest.raises(AuthenticationError, match="403"):
            JobSubmissionClient(cluster.url)
        ok = JobSubmissionClient(cluster.url, headers={"Authorization": f"Bearer {cluster.token}"})
        assert isinstance(ok.list_jobs(), list)
    env = dict(cluster.env, TPURAY_AUTH_TOKEN="wrong")
    r = cluster.tpuray("job", "list", "--address", cluster.url, env=env)
    assert r.returncode == 1 and "authentication failed (403" in r.stderr, r.stderr
    r = cluster.tpuray("job", "list", "--address", cluster.url, "--headers",
                       json.dumps({"Authorization": f"Bearer {cluster.token}"}), env=env)
    assert r.returncode == 0, r.stderr


def test_the_tpuray_cli_submits_waits_and_exits_as_rays(cluster, tmp_path):
    wd = _folder(tmp_path / "cli", {"ok.py": "print('hello from ok')\n",
                                    "bad.py": "import sys\nprint('about to fail')\nsys.exit(3)\n"})
    # The head's gRPC address: its dashboard is asked of it.
    r = cluster.tpuray("job", "submit", "--address", cluster.address, "--working-dir", ".",
                       "--submission-id", "cli-ok", "--", "python", "ok.py", cwd=wd)
    assert r.returncode == 0, r.stdout + r.stderr
    for want in (f"Job submission server address: {cluster.url}", "Job 'cli-ok' submitted successfully",
                 "Tailing logs until the job exits (disable with --no-wait):", "hello from ok",
                 "Job 'cli-ok' succeeded"):
        assert want in r.stdout, f"{want!r} missing:\n{r.stdout}"
    # No address: this machine's cluster (the registry `tpuray start` wrote).
    r = cluster.tpuray("job", "submit", "--working-dir", str(wd), "--submission-id", "cli-bad", "--",
                       "python", "bad.py")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "about to fail" in r.stdout and "Job 'cli-bad' failed" in r.stdout, r.stdout
    assert "Status message: Job entrypoint command failed with exit code 3" in r.stdout, r.stdout
    r = cluster.tpuray("job", "status", "cli-bad")
    assert r.returncode == 0 and "Job 'cli-bad' failed" in r.stdout, r.stdout + r.stderr
    r = cluster.tpuray("job", "logs", "cli-ok", "--address", cluster.url)
    assert r.returncode == 0 and "hello from ok" in r.stdout, r.stdout + r.stderr
    # Ray's `ray logs job --id`: the driver's log read from the node that ran it.
    r = cluster.tpuray("logs", "job", "--id", "cli-ok", "--address", cluster.url)
    assert r.returncode == 0 and "hello from ok" in r.stdout, r.stdout + r.stderr
    r = cluster.tpuray("job", "list", "--address", cluster.url)
    assert r.returncode == 0 and "submission_id='cli-ok'" in r.stdout, r.stdout + r.stderr
    # The same submission id again is the server's error, told as such.
    r = cluster.tpuray("job", "submit", "--no-wait", "--submission-id", "cli-ok", "--", "true")
    assert r.returncode == 1 and "tpuray: request failed with status code" in r.stderr, r.stderr
    # Unsupported options are refused by name; bad JSON says what was expected.
    r = cluster.tpuray("job", "submit", "--no-such-flag", "--", "true")
    assert r.returncode == 2 and "--no-such-flag" in r.stderr, r.stderr
    r = cluster.tpuray("job", "submit", "--runtime-env-json", "[1]", "--", "true")
    assert r.returncode == 1 and "--runtime-env-json must be an object" in r.stderr, r.stderr
    r = cluster.tpuray("job", "status", "cli-ok", "--address", "ray://127.0.0.1:10001")
    assert r.returncode == 1 and "Ray Client (ray://) addresses are not supported" in r.stderr, r.stderr
