"""Whole driver scripts run as users run them (``python script.py``), each starting its
own local cluster through ``tpuray.init()``: worker output reaching the driver, runtime
environments shipped through the cluster, Ctrl-C interrupting a blocked ``get``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e["HOME"] = str(tmp_path / "home")
    e["TPURAY_REGISTRY_DIR"] = str(tmp_path / "registry")
    e.pop("TPURAY_ADDRESS", None)
    os.makedirs(e["HOME"], exist_ok=True)
    return e


def run_script(tmp_path, env, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=timeout,
    )


def test_worker_prints_reach_the_driver_prefixed_like_ray(tmp_path, env):
    r = run_script(tmp_path, env, """
        import tpuray as ray
        ray.init(num_cpus=2)

        @ray.remote
        def f(x):
            print("hello from f", x)
            return x

        @ray.remote
        class Greeter:
            def hi(self):
                print("actor says hi")
                return 1

        print(ray.get(f.remote(7)))
        g = Greeter.remote()
        print(ray.get(g.hi.remote()))
        ray.shutdown()
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    hello = [l for l in lines if l.endswith("hello from f 7")]
    assert hello and hello[0].startswith("(f pid="), r.stdout
    assert any(l.startswith("(Greeter pid=") and l.endswith("actor says hi") for l in lines), r.stdout
    # Printed before the result the driver got from the same task.
    assert lines.index(hello[0]) < lines.index("7"), r.stdout


def test_runtime_env_vars_and_working_dir_travel_through_the_cluster(tmp_path, env):
    wd = tmp_path / "project"
    wd.mkdir()
    (wd / "helper_mod.py").write_text("VALUE = 'from the working dir'\n")
    (wd / "data.txt").write_text("shipped file\n")
    r = run_script(tmp_path, env, f"""
        import os
        import tpuray as ray
        ray.init(num_cpus=2, runtime_env={{"env_vars": {{"JOB_VAR": "job"}}}})

        @ray.remote
        def read_env():
            return os.environ.get("JOB_VAR"), os.environ.get("TASK_VAR")

        @ray.remote
        def use_working_dir():
            import helper_mod
            return helper_mod.VALUE, open("data.txt").read().strip(), os.getcwd() != {str(wd)!r}

        print(ray.get(read_env.remote()))
        opts = {{"runtime_env": {{"env_vars": {{"TASK_VAR": "task"}}}}}}
        print(ray.get(read_env.options(**opts).remote()))
        print(ray.get(use_working_dir.options(runtime_env={{"working_dir": {str(wd)!r}}}).remote()))
        try:
            read_env.options(runtime_env={{"conda": "myenv"}}).remote()
        except ValueError as e:
            print("refused:", e)
        ray.shutdown()
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "('job', None)" in out, r.stdout
    assert "('job', 'task')" in out, r.stdout
    assert "('from the working dir', 'shipped file', True)" in out, r.stdout
    assert any(l.startswith("refused:") and "'conda' is not supported" in l for l in out), r.stdout


def test_a_jobs_pip_environment_is_built_for_its_workers(tmp_path, env):
    # A small pure-Python package the test environment lacks (pip fetches it from PyPI).
    assert subprocess.run([sys.executable, "-c", "import tinydb"], capture_output=True).returncode != 0
    (tmp_path / "reqs.txt").write_text("# a comment\ntinydb\n")
    r = run_script(tmp_path, env, """
        import sys
        import tpuray as ray
        ray.init(num_cpus=2, runtime_env={"pip": "reqs.txt"})

        @ray.remote
        def where():
            import tinydb
            return tinydb.__name__, "runtime_resources/pip/" in sys.executable

        print(ray.get(where.remote()))
        try:
            import tinydb  # the driver itself keeps its own interpreter, as on Ray
            print("driver has it")
        except ImportError:
            print("driver lacks it")
        ray.shutdown()
    """, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["('tinydb', True)", "driver lacks it"], r.stdout


def test_ctrl_c_interrupts_a_driver_blocked_in_get(tmp_path, env):
    """PY-2: a driver blocked in get is interrupted by Ctrl-C (SIGINT)."""
    script = tmp_path / "blocked.py"
    script.write_text(textwrap.dedent("""
        import time
        import tpuray as ray
        ray.init(num_cpus=1)

        @ray.remote
        def forever():
            time.sleep(600)

        r = forever.remote()
        print("BLOCKED", flush=True)
        try:
            ray.get(r)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        ray.shutdown()
    """))
    # A shell starts a background job with SIGINT ignored, and children inherit that (a
    # test run started with `&` would fail here): the driver gets SIGINT's default, as in
    # a terminal, where Python installs its KeyboardInterrupt handler.
    p = subprocess.Popen(
        [sys.executable, str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert p.stdout.readline().strip() == "BLOCKED"
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        # The task sleeps 600 s: only an interrupted get lets the script end within this.
        out, err = p.communicate(timeout=60)
        assert "INTERRUPTED" in out, (out, err)
    finally:
        if p.poll() is None:
            p.kill()


def test_slice_placement_group_on_simulated_tpu_hosts(tmp_path, env):
    """tpuray.util.tpu.slice_placement_group reserves every host of one v6e-16 slice
    (4 simulated hosts, TPU.md's line); bundle i runs on TPU_WORKER_ID i with its chips."""
    from conftest import CliCluster

    c = CliCluster(tmp_path, env)
    addr = c.address
    try:
        c.head().tpu_slice("sa")
        r = run_script(tmp_path, env, f"""
            import os
            import tpuray as ray
            from tpuray.util.tpu import slice_placement_group
            from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            ray.init({addr!r})
            slice_pg = slice_placement_group("4x4", "v6e")
            print("hosts", slice_pg.num_hosts, "chips", slice_pg.chips_per_host)
            ray.get(slice_pg.placement_group.ready(), timeout=60)

            @ray.remote(num_cpus=0, resources={{"TPU": 4}})
            def member():
                return os.environ["TPU_WORKER_ID"], os.environ["TPU_VISIBLE_CHIPS"], os.environ["TPU_NAME"]

            for i in range(slice_pg.num_hosts):
                s = PlacementGroupSchedulingStrategy(slice_pg.placement_group, i)
                print("bundle", i, ray.get(member.options(scheduling_strategy=s).remote(), timeout=60))
            slice_pg.shutdown()
            try:
                slice_placement_group("3x3", "v6e")
            except ValueError as e:
                print("refused:", e)
            ray.shutdown()
        """)
        assert r.returncode == 0, r.stderr
        out = r.stdout.splitlines()
        assert "hosts 4 chips 4" in out, r.stdout
        for i in range(4):
            assert f"bundle {i} ('{i}', '0,1,2,3', 'sa')" in out, r.stdout
        assert any(l.startswith("refused:") and "3x3" in l for l in out), r.stdout
    finally:
        c.stop()


def test_gpu_tasks_see_only_their_gpus(tmp_path, env):
    """AGENT-10: CUDA_VISIBLE_DEVICES isolation (as Ray): whole GPUs are exclusive, fractions
    share one GPU; GPU-2: more than one GPU must be whole."""
    r = run_script(tmp_path, env, """
        import time
        import tpuray as ray
        ray.init(num_cpus=4, num_gpus=2)

        @ray.remote
        def ids(hold):
            time.sleep(hold)
            return ray.get_gpu_ids()

        one = [ids.options(num_gpus=1).remote(1.5) for _ in range(2)]
        print("one", sorted(tuple(x) for x in ray.get(one)))
        print("two", ray.get(ids.options(num_gpus=2).remote(0)))
        half = [ids.options(num_gpus=0.5).remote(1.5) for _ in range(2)]
        print("half", ray.get(half))
        print("none", ray.get(ids.remote(0)))
        try:
            ray.get(ids.options(num_gpus=1.5).remote(0), timeout=30)
            print("fractional ok")
        except Exception as e:
            print("fractional error", type(e).__name__, e)
        ray.shutdown()
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert "one [(0,), (1,)]" in out, r.stdout
    assert "two [0, 1]" in out, r.stdout
    half = [l for l in out if l.startswith("half ")]
    assert half and half[0] in ("half [[0], [0]]", "half [[1], [1]]"), r.stdout
    assert "none []" in out, r.stdout
    frac = [l for l in out if l.startswith("fractional")]
    assert frac and "whole number" in frac[0], r.stdout


def test_soft_node_affinity_to_a_node_that_just_joined_runs_there(tmp_path, env):
    """AGENT-12: the head node's agent has not yet seen a node that joined after its last
    heartbeat's view (heartbeats every 30 s here); a task with soft affinity to that node
    still runs there instead of falling back to the head node, and hard affinity is not
    refused."""
    from conftest import CliCluster

    env = dict(env, TPURAY_HEARTBEAT_INTERVAL_MS="30000", TPURAY_NODE_DEATH_TIMEOUT_MS="600000")
    c = CliCluster(tmp_path, env)
    try:
        c.head().node("--num-cpus", "1")
        r = run_script(tmp_path, env, f"""
            import tpuray as ray
            from tpuray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On

            ray.init({c.address!r})
            me = ray.get_runtime_context().get_node_id()
            other = [n["NodeID"] for n in ray.nodes() if n["NodeID"] != me][0]

            @ray.remote
            def where():
                return ray.get_runtime_context().get_node_id()

            print("soft", ray.get(where.options(scheduling_strategy=On(other, soft=True)).remote(), timeout=60) == other)
            print("hard", ray.get(where.options(scheduling_strategy=On(other, soft=False)).remote(), timeout=60) == other)
            ray.shutdown()
        """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["soft True", "hard True"], r.stdout
    finally:
        c.stop()


def test_init_keywords_are_honoured_refused_or_named_as_ray_s(tmp_path, env):
    """init() takes Ray 2.60's keywords: an unknown one is refused as Ray refuses it, the
    sizing options are refused when joining an existing cluster (Ray's ValueError), and
    Ray's defaults (None) warn of nothing (test_init_keywords walks every keyword)."""
    r = run_script(tmp_path, env, """
        import warnings
        import tpuray as ray
        try:
            ray.init(num_cpu=2)
        except RuntimeError as e:
            print("unknown:", e)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            info = ray.init(num_cpus=1, _temp_dir=None, logging_level="WARNING")
        print("warned:", [str(x.message) for x in w])
        import logging
        print("level:", logging.getLevelName(logging.getLogger("tpuray").level))
        address = info.address_info["address"]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")

            @ray.remote(max_calls=1)
            def f():
                return 1

            @ray.remote(max_calls=0)
            def g():
                return 1

            class A:
                @ray.method(concurrency_group="io")
                def m(self):
                    return 2

            try:
                ray.method(bogus=1)
            except AssertionError as e:
                print("method:", e)
        print("unhonoured:", sorted(str(x.message).split(" option ")[1].split(" yet")[0] for x in w))
        import subprocess, sys
        for kw in ("num_cpus=2", "resources={'x': 1}", "object_store_memory=10**8"):
            p = subprocess.run([sys.executable, "-c",
                                f"import tpuray as ray\\ntry:\\n    ray.init({address!r}, {kw})\\n"
                                "except ValueError as e:\\n    print(e)"],
                               capture_output=True, text=True)
            print("existing:", p.stdout.strip() or p.stderr.strip()[-300:])
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "unknown: Unknown keyword argument(s): num_cpu" in out
    assert "warned: []" in out, out
    assert "level: WARNING" in out
    # max_calls and @method(concurrency_group=) are honoured now (issue 23): no warning.
    assert "unhonoured: []" in out, out
    assert "method: Unexpected keyword argument to @ray.method: 'bogus'" in out
    assert ("existing: When connecting to an existing cluster, num_cpus and num_gpus must not "
            "be provided.") in out
    assert "existing: When connecting to an existing cluster, resources must not be provided." in out
    assert ("existing: When connecting to an existing cluster, object_store_memory must not be "
            "provided.") in out
