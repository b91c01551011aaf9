"""Every keyword of Ray 2.60's ``ray.init`` is honoured or refused by name, never dropped.

The keyword list is data recorded from Ray 2.60's source (``ray/_private/worker.py``,
``def init``: its named parameters, then the hidden keywords it pops from ``**kwargs``:
``_enable_object_reconstruction`` ... ``_skip_env_hook``, and the two it refuses,
``allow_multiple`` and ``storage``). Each test runs its drivers in subprocesses (the
pytest process shares one cluster, conftest.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

#: Ray 2.60's ``init`` keywords, in its order (ray/_private/worker.py, ``def init``).
RAY_260_INIT_PARAMETERS = (
    "address", "num_cpus", "num_gpus", "resources", "labels", "object_store_memory",
    "local_mode", "ignore_reinit_error", "include_dashboard", "dashboard_host",
    "dashboard_port", "job_config", "configure_logging", "logging_level", "logging_format",
    "logging_config", "log_to_driver", "namespace", "runtime_env",
    "enable_resource_isolation", "cgroup_path", "system_reserved_cpu",
    "system_reserved_memory", "proxy_server_url",
)
#: The hidden keywords Ray 2.60's ``init`` pops from ``**kwargs`` (same function).
RAY_260_INIT_HIDDEN = (
    "_enable_object_reconstruction", "_plasma_directory", "object_spilling_directory",
    "_node_ip_address", "_driver_object_store_memory", "_memory", "_redis_username",
    "_redis_password", "_temp_dir", "_metrics_export_port", "_system_config",
    "_tracing_startup_hook", "_node_name", "_skip_env_hook",
)
#: Keywords Ray 2.60's ``init`` refuses itself (``allow_multiple`` outside Ray Client,
#: ``storage`` since 2.48).
RAY_260_INIT_REFUSED = ("allow_multiple", "storage")

#: A value other than Ray's default for each keyword refused by tpuray, and why.
REFUSED = {
    "include_dashboard": False,
    "logging_config": object(),
    "enable_resource_isolation": True,
    "cgroup_path": "/sys/fs/cgroup/ray",
    "system_reserved_cpu": 1.0,
    "system_reserved_memory": 1 << 30,
    "proxy_server_url": "http://proxy:1",
    "_plasma_directory": "/tmp/plasma",
    "_driver_object_store_memory": 1 << 20,
    "_redis_username": "user",
    "_redis_password": "secret",
    "_system_config": {"num_heartbeats_timeout": 10},
    "_tracing_startup_hook": "mod:hook",
    "_node_name": "n1",
}


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e["HOME"] = str(tmp_path / "home")
    e["TPURAY_REGISTRY_DIR"] = str(tmp_path / "registry")
    e.pop("TPURAY_ADDRESS", None)
    e.pop("RAY_ADDRESS", None)
    os.makedirs(e["HOME"], exist_ok=True)
    return e


def run(tmp_path, env, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)


def test_every_ray_init_keyword_is_known_to_tpuray():
    import inspect

    from tpuray._private import worker

    own = set(inspect.signature(worker.init).parameters) - {"kwargs"}
    handled = own | set(worker._RAY_INIT_EXTRAS) | {"local_mode"}
    ray_all = RAY_260_INIT_PARAMETERS + RAY_260_INIT_HIDDEN
    assert not [k for k in ray_all if k not in handled], "Ray init keywords tpuray lacks"
    assert not [k for k in worker._RAY_INIT_EXTRAS if k not in ray_all], "not Ray's keywords"
    assert set(REFUSED) == {k for k, how in worker._RAY_INIT_EXTRAS.items() if how == "refuse"}


def test_refused_keywords_are_refused_by_name_before_anything_starts(tmp_path, env):
    cases = {k: (repr(v) if k != "logging_config" else "object()") for k, v in REFUSED.items()}
    cases.update({"local_mode": "True", "allow_multiple": "True", "storage": "'/tmp/s'",
                  "num_cpu": "2"})
    r = run(tmp_path, env, f"""
        import tpuray as ray
        for k, v in {cases!r}.items():
            try:
                ray.init(**{{k: eval(v)}})
                print(k, "ACCEPTED")
            except (RuntimeError, ValueError, TypeError) as e:
                print(k, type(e).__name__, e)
        print("initialized", ray.is_initialized())
    """)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    for k in cases:
        assert "ACCEPTED" not in lines[k], (k, lines[k])
        if k in REFUSED:
            assert lines[k].startswith("ValueError") and f"{k}=" in lines[k], (k, lines[k])
    assert lines["local_mode"].startswith("RuntimeError `local_mode` is no longer supported")
    assert "allow_multiple" in lines["allow_multiple"] and "storage" in lines["storage"]
    assert lines["num_cpu"] == "RuntimeError Unknown keyword argument(s): num_cpu"
    assert lines["initialized"] == "False"
    # Ray's defaults change nothing and are accepted: checked by the next test's init.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_cluster_keywords_set_up_the_new_cluster_and_are_refused_when_joining(
    tmp_path, env
):
    dash, metrics = _free_port(), _free_port()
    temp = tmp_path / "ray-temp"
    spill = tmp_path / "spill"
    r = run(tmp_path, env, f"""
        import json, os, subprocess, sys, logging
        import tpuray as ray
        from tpuray.job_config import JobConfig
        ctx = ray.init(
            num_cpus=1, labels={{"zone": "z9"}}, dashboard_host="127.0.0.1",
            dashboard_port={dash}, _temp_dir={str(temp)!r}, _metrics_export_port={metrics},
            object_spilling_directory={str(spill)!r}, _memory=3 << 30,
            _node_ip_address="127.0.0.1", job_config=JobConfig(
                runtime_env={{"env_vars": {{"FROM_JOB_CONFIG": "yes"}}}}, ray_namespace="jc"),
            # Ray's defaults of the refused keywords are accepted as they change nothing.
            include_dashboard=None, enable_resource_isolation=False, _system_config={{}},
            _redis_password="", _enable_object_reconstruction=True, _skip_env_hook=True,
            configure_logging=False, log_to_driver=False, ignore_reinit_error=False,
        )

        @ray.remote
        def probe():
            c = ray.get_runtime_context()
            return os.environ.get("FROM_JOB_CONFIG"), c.get_node_labels().get("zone"), c.namespace

        node = ray.nodes()[0]
        print(json.dumps({{
            "dashboard_url": ctx.dashboard_url,
            "metrics": node["MetricsExportPort"],
            "memory": node["Resources"].get("memory"),
            "probe": ray.get(probe.remote(), timeout=120),
            "temp_used": bool(os.listdir({str(temp)!r})),
            "handlers": len(logging.getLogger("tpuray").handlers),
        }}))
        address = ctx.address_info["address"]
        joins = {{}}
        for k, v in (("labels", {{"a": "b"}}), ("dashboard_port", 1), ("_temp_dir", "/tmp/x"),
                     ("_memory", 1), ("object_spilling_directory", "/tmp/s"),
                     ("_metrics_export_port", 1), ("_node_ip_address", "127.0.0.1"),
                     ("dashboard_host", "0.0.0.0")):
            p = subprocess.run([sys.executable, "-c",
                "import sys, tpuray as ray\\n"
                "try:\\n    ray.init(address=sys.argv[1], **{{sys.argv[2]: eval(sys.argv[3])}})\\n"
                "    print('JOINED')\\n"
                "except ValueError as e:\\n    print(e)", address, k, repr(v)],
                capture_output=True, text=True, timeout=120)
            joins[k] = p.stdout.strip() or p.stderr[-300:]
        print(json.dumps(joins))
        ray.shutdown()
    """)
    assert r.returncode == 0, r.stderr
    first, joins = (json.loads(line) for line in r.stdout.splitlines()[-2:])
    assert first["dashboard_url"] == f"127.0.0.1:{dash}", first
    assert first["metrics"] == metrics, first
    assert first["memory"] == float(3 << 30), first
    assert first["probe"] == ["yes", "z9", "jc"], first
    assert first["temp_used"] and first["handlers"] == 0, first
    for k, msg in joins.items():
        assert msg.startswith(f"When connecting to an existing cluster, {k} must not be provided"), (k, msg)


def test_address_auto_with_no_cluster_running_raises_rays_connection_error(tmp_path, env):
    # Ray's: "auto" joins a running cluster and never starts one.
    env = dict(env, TPURAY_REGISTRY_DIR=str(tmp_path / "empty-registry"))
    env.pop("TPURAY_ADDRESS", None)
    env.pop("RAY_ADDRESS", None)
    code = textwrap.dedent("""
        import tpuray
        try:
            tpuray.init(address="auto")
        except ConnectionError as e:
            print("ConnectionError:", e)
        print("initialized:", tpuray.is_initialized())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "ConnectionError: Could not find any running Ray instance. Please specify the one "
        "to connect to by setting `--address` flag or `RAY_ADDRESS` environment variable.",
        "initialized: False",
    ], r.stdout
