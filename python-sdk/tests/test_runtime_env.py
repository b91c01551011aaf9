"""Runtime environments end to end on a real two-node cluster (a head with resource
``node_a`` and a second node agent with ``node_b``, started with the ``tpuray`` CLI, its
own HOME, registry and ports), driven by drivers in subprocesses and by the Jobs API
CLI.

Covered: a job with ``uv`` and a package the base environment lacks succeeds (uv comes
from PyPI into this venv, scripts/python-tests.sh); a task with its own ``pip`` and
``env_vars`` merged over the job's sees both (Ray's merge: the task's fields win,
``env_vars`` merged per variable), and a task without one does not see the package; a
``py_modules`` folder imports on the other node; ``excludes`` keeps a 200 MiB data
folder out of the upload (the upload's size is printed); a package that does not exist
gives ``RuntimeEnvSetupError`` with pip's message at ``get`` and at an actor's first
call, within ``setup_timeout_seconds``; an index that never answers runs into
``setup_timeout_seconds`` and says so; on a node whose pip cache limit is 0 GB
(``RAY_RUNTIME_ENV_PIP_CACHE_SIZE_GB``) an environment stays while a worker uses it and
is removed once none does (AGENT-15); ``RuntimeEnv``/``RuntimeEnvConfig`` keep Ray's
shapes and checks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import CliCluster
from tpuray.runtime_env import RuntimeEnv, RuntimeEnvConfig

#: A tiny pure-Python package this environment lacks (test_jobs.py uses it too).
PACKAGE = "termcolor"
REQUIREMENT = "termcolor==2.4.0"
#: Seconds a driver may take (venvs are built per node, from PyPI).
DRIVER_TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rtenv")
    c = CliCluster(tmp)
    c.dashboard_port = _free_port()
    # Entrypoints and drivers run `python` from PATH: this interpreter, which has
    # tpuray (and uv beside it).
    c.env["PATH"] = f"{Path(sys.executable).parent}:{c.env.get('PATH', '')}"
    c._start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(c.port), "--num-cpus", "2",
              "--resources", '{"node_a": 10}', "--dashboard-port", str(c.dashboard_port),
              "--temp-dir", str(tmp / "head")])
    c.node("--num-cpus", "2", "--resources", '{"node_b": 10}')
    # A node keeping no unused pip environment (Ray's cache limit variable at 0 GB).
    c.node("--num-cpus", "2", "--resources", '{"node_c": 10}', env={"RAY_RUNTIME_ENV_PIP_CACHE_SIZE_GB": "0"})
    try:
        yield c
    except BaseException:
        for f in sorted(tmp.glob("*/session_*/logs/runtime_env_setup*")):
            print(f"--- {f}\n{f.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        c.stop()


def _driver(cluster, tmp_path: Path, body: str, timeout: float = DRIVER_TIMEOUT) -> dict:
    """Runs ``body`` as a driver of the cluster (cwd ``tmp_path``); it prints one JSON
    line prefixed RESULT, which is returned."""
    script = tmp_path / "driver.py"
    script.write_text("import json, os, sys, time\nimport tpuray as ray\n" + textwrap.dedent(body))
    env = dict(cluster.env, TPURAY_ADDRESS=cluster.address)
    r = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=timeout)
    found = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and found, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    print(r.stdout)
    return json.loads(found[-1][len("RESULT "):])


def test_the_package_is_absent_here():
    import importlib.util

    assert importlib.util.find_spec(PACKAGE) is None, f"{PACKAGE} must not be in the base environment"
    assert shutil.which("uv", path=str(Path(sys.executable).parent)), "uv must be beside this interpreter"


def test_a_job_with_uv_and_a_package_the_base_lacks_succeeds(cluster, tmp_path):
    # Through the Jobs API, with py_modules too: the entrypoint and its tasks on both
    # nodes import the uv-installed package and the uploaded module.
    wd, mod = tmp_path / "wd", tmp_path / "jobmod_rt"
    wd.mkdir()
    mod.mkdir()
    (mod / "__init__.py").write_text("VALUE = 'jobmod'\n")
    (wd / "job.py").write_text(textwrap.dedent(f"""
        import importlib.metadata, os, sys
        import tpuray as ray
        import {PACKAGE}
        import jobmod_rt

        ray.init()

        @ray.remote
        def where():
            import {PACKAGE}
            import jobmod_rt
            return (ray.get_runtime_context().get_node_id(), importlib.metadata.version("{PACKAGE}"), sys.prefix,
                    jobmod_rt.VALUE)

        a = ray.get(where.options(resources={{"node_a": 1}}).remote())
        b = ray.get(where.options(resources={{"node_b": 1}}).remote())
        print("RESULT", a[0] != b[0], a[1], b[1], "/uv/" in a[2] and "/uv/" in b[2], a[3], b[3], flush=True)
    """))
    env = dict(cluster.env)
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "tpuray", "job", "submit", "--address", f"http://127.0.0.1:{cluster.dashboard_port}",
         "--working-dir", str(wd), "--runtime-env-json", json.dumps({"uv": [REQUIREMENT], "py_modules": [str(mod)]}),
         "--", "python", "job.py"],
        env=env, capture_output=True, text=True, timeout=DRIVER_TIMEOUT)
    print(r.stdout[-3000:], r.stderr[-3000:], f"({time.time() - t0:.1f} s)")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RESULT True 2.4.0 2.4.0 True jobmod jobmod" in r.stdout, r.stdout


def test_a_task_with_its_own_pip_and_env_vars_merged_over_the_jobs_sees_both(cluster, tmp_path):
    """AGENT-3: the runtime env is part of the pool key: a plain task after the one with its
    own pip and env_vars never runs in that task's worker (sees neither)."""
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "helper.py").write_text("VALUE = 'from-the-jobs-working-dir'\n")
    got = _driver(cluster, tmp_path, f"""
        ray.init(runtime_env={{"working_dir": "wd", "env_vars": {{"JOB_VAR": "job", "SHARED": "job"}}}})

        @ray.remote
        def probe():
            import importlib.util
            import helper
            spec = importlib.util.find_spec("{PACKAGE}")
            version = None
            if spec is not None:
                import importlib.metadata
                version = importlib.metadata.version("{PACKAGE}")
            return {{"version": version, "job": os.environ.get("JOB_VAR"), "task": os.environ.get("TASK_VAR"),
                     "shared": os.environ.get("SHARED"), "helper": helper.VALUE}}

        own = probe.options(runtime_env={{"pip": ["{REQUIREMENT}"],
                                          "env_vars": {{"TASK_VAR": "task", "SHARED": "task"}}}}).remote()
        print("RESULT", json.dumps({{"own": ray.get(own), "plain": ray.get(probe.remote())}}))
    """)
    assert got["own"] == {"version": "2.4.0", "job": "job", "task": "task", "shared": "task",
                          "helper": "from-the-jobs-working-dir"}, got
    assert got["plain"] == {"version": None, "job": "job", "task": None, "shared": "job",
                            "helper": "from-the-jobs-working-dir"}, got


def test_a_py_modules_folder_imports_on_another_node(cluster, tmp_path):
    lib = tmp_path / "src" / "mylib_rt"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("VALUE = 41 + 1\n")
    (lib / "notes.tmp").write_text("left out by excludes\n")
    got = _driver(cluster, tmp_path, f"""
        ray.init(runtime_env={{"py_modules": [{str(lib)!r}], "excludes": ["*.tmp"]}})

        @ray.remote(resources={{"node_b": 1}})
        def use():
            import mylib_rt
            here = os.path.dirname(mylib_rt.__file__)
            return ray.get_runtime_context().get_node_id(), mylib_rt.VALUE, here, sorted(os.listdir(here))

        node, value, where, files = ray.get(use.remote())
        me = ray.get_runtime_context().get_node_id()
        print("RESULT", json.dumps({{"other_node": node != me, "value": value, "where": where, "files": files}}))
    """)
    assert got["other_node"] and got["value"] == 42, got
    assert "py_modules_files" in got["where"] and str(tmp_path) not in got["where"], got
    # (the import itself may add __pycache__ there)
    assert [f for f in got["files"] if f != "__pycache__"] == ["__init__.py"], got


def test_excludes_keep_a_200_mib_data_folder_out_of_the_upload(cluster, tmp_path):
    wd = tmp_path / "project"
    (wd / "data").mkdir(parents=True)
    (wd / "main_code.py").write_text("ANSWER = 'code arrived'\n")
    big = wd / "data" / "big.bin"
    with open(big, "wb") as f:
        f.truncate(200 * 1024 * 1024)  # sparse: written in no time
    try:
        got = _driver(cluster, tmp_path, f"""
            from tpuray._private import runtime_env as rt
            from tpuray._private import worker
            ray.init(runtime_env={{"working_dir": {str(wd)!r}, "excludes": ["data/"]}})
            uri = worker.state.runtime_env["working_dir"]
            size = rt.package_size(uri)
            print(f"upload of {{uri}}: {{size}} bytes", flush=True)

            @ray.remote(resources={{"node_b": 1}})
            def look():
                import main_code
                return main_code.ANSWER, sorted(os.listdir("."))

            answer, listing = ray.get(look.remote())
            print("RESULT", json.dumps({{"size": size, "answer": answer, "listing": listing}}))
        """)
    finally:
        big.unlink()
    print(f"upload size with excludes: {got['size']} bytes (the data folder: {200 * 1024 * 1024} bytes)")
    assert got["size"] < 64 * 1024, got
    assert got["answer"] == "code arrived" and got["listing"] == ["main_code.py"], got


def test_a_bad_package_gives_runtime_env_setup_error_with_pips_message_within_the_timeout(cluster, tmp_path):
    got = _driver(cluster, tmp_path, """
        from tpuray.exceptions import RuntimeEnvSetupError
        ray.init()
        bad = {"pip": ["tpuray-no-such-package-3141592==0.0.1"], "config": {"setup_timeout_seconds": 120}}

        @ray.remote
        def f():
            return 1

        @ray.remote
        class A:
            def ping(self):
                return "pong"

        out = {}
        t0 = time.time()
        try:
            ray.get(f.options(runtime_env=bad).remote(), timeout=150)
            out["task"] = "no error"
        except RuntimeEnvSetupError as e:
            out["task"] = str(e)
        out["task_s"] = time.time() - t0
        t0 = time.time()
        a = A.options(runtime_env=bad).remote()
        try:
            ray.get(a.ping.remote(), timeout=150)
            out["actor"] = "no error"
        except RuntimeEnvSetupError as e:
            out["actor"] = str(e)
        out["actor_s"] = time.time() - t0
        # The node agent lives on: a plain task runs after the failures.
        out["after"] = ray.get(f.remote(), timeout=60)
        print("RESULT", json.dumps(out))
    """)
    for where in ("task", "actor"):
        msg = got[where]
        assert msg.startswith("Failed to set up runtime environment."), got
        assert "tpuray-no-such-package-3141592" in msg and (
            "No matching distribution" in msg or "Could not find a version" in msg), got
        assert got[f"{where}_s"] < 120, got
    assert got["after"] == 1


def test_a_setup_past_setup_timeout_seconds_fails_with_the_timeout_named(cluster, tmp_path):
    # An index that accepts connections and never answers: pip waits, the setup times out.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        got = _driver(cluster, tmp_path, f"""
            from tpuray.exceptions import RuntimeEnvSetupError
            from tpuray.runtime_env import RuntimeEnv, RuntimeEnvConfig
            ray.init()
            env = RuntimeEnv(pip={{"packages": ["{REQUIREMENT}"],
                                   "pip_install_options": ["--index-url", "http://127.0.0.1:{port}/simple",
                                                           "--timeout", "100", "--retries", "0"]}},
                             config=RuntimeEnvConfig(setup_timeout_seconds=3))

            @ray.remote
            def f():
                return 1

            t0 = time.time()
            try:
                ray.get(f.options(runtime_env=env).remote(), timeout=60)
                msg = "no error"
            except RuntimeEnvSetupError as e:
                msg = str(e)
            print("RESULT", json.dumps({{"msg": msg, "s": time.time() - t0}}))
        """)
    finally:
        silent.close()
    assert "setup_timeout_seconds = 3" in got["msg"], got
    assert got["s"] < 30, got


def test_agent_15_an_environment_is_kept_while_a_worker_uses_it_and_removed_unused_past_the_limit(cluster, tmp_path):
    got = _driver(cluster, tmp_path, f"""
        @ray.remote(resources={{"node_c": 1}}, runtime_env={{"pip": ["{REQUIREMENT}"]}})
        class Holder:
            def prefix(self):
                import sys
                import {PACKAGE}
                return sys.prefix

        ray.init()
        a, b = Holder.remote(), Holder.remote()
        pa, pb = ray.get([a.prefix.remote(), b.prefix.remote()])
        out = {{"same": pa == pb, "prefix": pa, "exists": os.path.isdir(pa)}}
        ray.kill(a)
        time.sleep(3)
        out["kept_while_b_uses_it"] = os.path.isdir(pa)
        ray.kill(b)
        deadline = time.time() + 30
        while os.path.isdir(pa) and time.time() < deadline:
            time.sleep(0.2)
        out["removed_when_unused"] = not os.path.isdir(pa)
        print("RESULT", json.dumps(out))
    """)
    assert got["same"] and got["exists"] and "/runtime_resources/pip/" in got["prefix"], got
    assert got["kept_while_b_uses_it"], got
    assert got["removed_when_unused"], got


def test_runtime_env_classes_have_rays_shapes_and_checks(tmp_path):
    env = RuntimeEnv(pip=["six"], env_vars={"A": "1"}, config=RuntimeEnvConfig(setup_timeout_seconds=5))
    assert env["pip"] == ["six"] and env["env_vars"] == {"A": "1"}
    assert env["config"] == {"setup_timeout_seconds": 5, "eager_install": True, "log_files": []}
    assert isinstance(env, dict) and RuntimeEnv.deserialize(env.serialize()) == env
    uv = RuntimeEnv(uv={"packages": ["six"], "uv_pip_install_options": ["--no-cache"]})
    assert uv["uv"] == {"packages": ["six"], "uv_pip_install_options": ["--no-cache"], "uv_check": False}
    with pytest.raises(ValueError, match="cannot be specified at the same time"):
        RuntimeEnv(pip=["a"], uv=["b"])
    with pytest.raises(ValueError, match="'conda' is not supported"):
        RuntimeEnv(conda="env")
    with pytest.raises(ValueError, match="must include field 'packages'"):
        RuntimeEnv(uv={"uv_check": True})
    with pytest.raises(ValueError, match="greater than zero or equals to -1"):
        RuntimeEnvConfig(setup_timeout_seconds=0)
    with pytest.raises(TypeError, match="eager_install must be a boolean"):
        RuntimeEnvConfig(eager_install="yes")
    with pytest.raises(ValueError, match="neither an existing path nor a URI"):
        RuntimeEnv(py_modules=[str(tmp_path / "missing")])
    with pytest.warns(UserWarning, match="unknown entries"):
        assert RuntimeEnvConfig.parse_and_validate_runtime_env_config({"bogus": 1})["setup_timeout_seconds"] == 600
