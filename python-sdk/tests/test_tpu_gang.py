"""Slice gangs from Python (``tpuray.util.tpu``): ``run_on_slice`` on one simulated
v6e-16 slice (4 hosts started exactly as TPU.md's line), the environment every member
gets, ``tpu_slice=`` reuse, ``SliceActorGroup`` restarting whole after a member's worker
is killed, and ``torch_device``'s fallback. The Rust suite (tests/tests/gang.rs) covers
two slices, per-chip and multislice gangs and a killed host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import CliCluster

@pytest.fixture(scope="module")
def slice_cluster(tmp_path_factory):
    c = CliCluster(tmp_path_factory.mktemp("gang"))
    try:
        c.head(num_cpus=2).tpu_slice("sa")
        yield c.address, c.env, c.tmp
    finally:
        c.stop()


def run_script(tmp, env, body: str, timeout: float = 240):
    script = tmp / "script.py"
    script.write_text(textwrap.dedent(body))
    r = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(l[5:]) for l in r.stdout.splitlines() if l.startswith("JSON ")]


MEMBER = """
    import json, os
    import tpuray as ray
    from tpuray.util import tpu

    KEYS = ("TPU_", "TORCH_TPU_", "MASTER_", "NNODES", "NODE_RANK", "JOB_COMPLETION_INDEX",
            "WORLD_SIZE", "JAX_", "TPURAY_GANG_", "RANK", "LOCAL_RANK", "MEGASCALE_")

    @ray.remote
    def member(tag):
        env = {k: v for k, v in os.environ.items() if k.startswith(KEYS)}
        env["tag"] = tag
        env["node"] = ray.get_runtime_context().get_node_id()
        return env

    def out(x):
        print("JSON " + json.dumps(x), flush=True)
"""


def test_run_on_slice_gives_every_member_tpu_md_gang_environment(slice_cluster):
    addr, env, tmp = slice_cluster
    (members, reused, err) = run_script(tmp, env, MEMBER + f"""
    ray.init({addr!r})
    out(ray.get(tpu.run_on_slice(member, "a", topology="4x4", accelerator_version="v6e"), timeout=120))
    s = tpu.slice_placement_group("4x4", "v6e")
    out(ray.get(tpu.run_on_slice(member, "b", tpu_slice=s), timeout=120))
    s.shutdown()
    try:
        tpu.run_on_slice(member, topology="3x3", accelerator_version="v6e")
        out("no error")
    except ValueError as e:
        out(str(e))
    ray.shutdown()
    """)
    for ms, tag in ((members, "a"), (reused, "b")):
        assert len(ms) == 4
        assert sorted(int(m["TPU_WORKER_ID"]) for m in ms) == [0, 1, 2, 3]
        assert len({m["node"] for m in ms}) == 4, "one member per host"
        for key in ("TPU_WORKER_HOSTNAMES", "TORCH_TPU_SLICEBUILDER_ADDRESSES",
                    "TORCH_TPU_XPROF_SESSION_ID", "MASTER_ADDR", "MASTER_PORT",
                    "JAX_COORDINATOR_ADDRESS", "TORCH_TPU_TOPOLOGY", "WORLD_SIZE", "NNODES"):
            assert len({m[key] for m in ms}) == 1, key
        m0 = ms[0]
        assert m0["TPU_WORKER_HOSTNAMES"] == ",".join(["127.0.0.1"] * 4)
        builders = m0["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        assert len(builders) == 16 and len(set(builders)) == 16
        ports = set(builders) | {f"{m0['MASTER_ADDR']}:{m0['MASTER_PORT']}", m0["JAX_COORDINATOR_ADDRESS"]}
        assert len(ports) == 18, "no host:port twice"
        assert m0["TORCH_TPU_TOPOLOGY"] == "4,4,1" and m0["NNODES"] == "4" and m0["WORLD_SIZE"] == "16"
        for m in ms:
            assert m["tag"] == tag
            assert m["NODE_RANK"] == m["TPU_WORKER_ID"] == m["JOB_COMPLETION_INDEX"]
            assert m["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
            assert m["JAX_PLATFORMS"] == "cpu"
            assert m["TPURAY_GANG_GENERATION"] == "0"
    assert "3x3" in err and "not valid for v6e" in err


def test_ray_tpu_arguments_are_honoured_or_refused_by_name(slice_cluster):
    """Ray 2.60's ``ray.util.tpu`` names on a simulated v6e-16 slice: the slice group's
    properties, ``pg_per_slice`` with ``run_on_slice(slice_index=...)``, Ray's arguments
    never reaching the user function, the cluster's slice counts, this host's facts in
    a member, and every argument tpuray cannot honour refused naming it."""
    addr, env, tmp = slice_cluster
    (props, counts, kwargs, facts, per_slice, refused, left) = run_script(tmp, env, MEMBER + f"""
    import time, warnings
    ray.init({addr!r})

    @ray.remote
    def kw(*args, **kwargs):
        return [list(args), sorted(kwargs)]

    @ray.remote
    def facts():
        return [tpu.get_current_pod_name(), tpu.get_current_pod_worker_count(),
                tpu.get_num_tpu_chips_on_node()]

    def ready_slices(want):
        for _ in range(50):
            n = tpu.get_num_ready_tpu_slices("4x4", "TPU-V6E")
            if n == want:
                return n
            time.sleep(0.2)
        return n

    s = tpu.slice_placement_group("4x4", "v6e", name="mine", resources_per_bundle={{"CPU": 1}})
    ray.get(s.placement_group.ready(), timeout=60)
    try:
        s.slice_placement_groups
        per_slice_error = "none"
    except ValueError as e:
        per_slice_error = str(e)
    out({{"hosts": s.num_hosts, "bundles": s.num_bundles, "chips": s.chips_per_host,
         "devices": s.devices_per_host, "topology": s.topology, "version": s.accelerator_version,
         "type": s.accelerator_type, "heads": s.head_placement_groups,
         "resources": s.bundle_resources, "labels": s.bundle_label_selector,
         "per_chip": s.tpu_resource_per_chip, "slices": s.num_slices,
         "name": ray.util.placement_group_table(s.placement_group)["name"],
         "per_slice_error": per_slice_error}})
    out([tpu.get_num_tpu_slices("4x4", "TPU-V6E"), ready_slices(0)])
    out(ray.get(tpu.run_on_slice(kw, 1, tpu_slice=s, pg_ready_timeout_s=30, tag="t"), timeout=120))
    out(ray.get(tpu.run_on_slice(facts, tpu_slice=s), timeout=120))
    s.release_head_pgs()
    s.shutdown()
    errors = {{}}
    try:
        tpu.run_on_slice(kw, tpu_slice=s)
    except ValueError as e:
        errors["shut down"] = str(e)
    errors["ready again"] = ready_slices(1)

    p = tpu.SlicePlacementGroup("4x4", "v6e", pg_per_slice=True)
    groups = p.slice_placement_groups
    refs = tpu.run_on_slice(kw, tpu_slice=p, slice_index=0, x=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = tpu.dispatch(kw, tpu_slice=p)
    for what, call in [
        ("slice_index 1", lambda: tpu.run_on_slice(kw, tpu_slice=p, slice_index=1)),
        ("release 5", lambda: p.release_head_pgs(5)),
        ("slice_placement_group", lambda: p.slice_placement_group),
    ]:
        try:
            call()
            errors[what] = "none"
        except ValueError as e:
            errors[what] = str(e)
    out([len(groups), ray.get(refs, timeout=120), len(ray.get(again, timeout=120)),
         [w.category.__name__ for w in caught], errors])
    p.shutdown()

    refusals = {{}}
    for arg, call in [
        ("tpu_resource_per_chip", lambda: tpu.slice_placement_group("4x4", "v6e", tpu_resource_per_chip=2)),
        ("bundle_label_selector", lambda: tpu.SlicePlacementGroup("4x4", "v6e", bundle_label_selector=[{{}}] * 4)),
        ("lifetime", lambda: tpu.slice_placement_group("4x4", "v6e", lifetime="detached")),
        ("chips_per_vm", lambda: tpu.slice_placement_group("4x4", "v6e", chips_per_vm=8)),
        ("resources_per_bundle", lambda: tpu.slice_placement_group("4x4", "v6e", resources_per_bundle={{"TPU": 1}})),
        ("strategy", lambda: tpu.slice_placement_group("4x4", "v6e", strategy="STRICT_PACK")),
        ("chips_per_vm", lambda: tpu.run_on_slice(kw, topology="4x4", accelerator_version="v6e", chips_per_vm=2)),
        ("subslice_placement_group", lambda: tpu.subslice_placement_group("2x4", "v6e")),
    ]:
        try:
            call()
            refusals.setdefault(arg, []).append("accepted")
        except (ValueError, NotImplementedError) as e:
            refusals.setdefault(arg, []).append(str(e))
    out(refusals)
    out([g["state"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"])
    ray.shutdown()
    """)
    assert props["hosts"] == props["bundles"] == 4 and props["chips"] == props["devices"] == 4
    assert (props["topology"], props["version"], props["type"]) == ("4x4", "v6e", "v6e-16")
    assert props["heads"] == [] and props["per_chip"] == 1 and props["slices"] == 1
    assert props["resources"] == {"TPU": 4.0, "CPU": 1.0}
    assert props["labels"] == [{"ray.io/tpu-slice-name": "sa"}] * 4
    assert props["name"] == "mine"
    assert "pg_per_slice=False" in props["per_slice_error"]
    assert counts == [1, 0], "one intact slice, none free while reserved"
    assert kwargs == [[[1], ["tag"]]] * 4, "Ray's arguments never reach the function"
    assert facts == [["sa", 4, 4]] * 4
    n_groups, per_slice_members, n_again, warned, errors = per_slice
    assert n_groups == 1 and per_slice_members == [[[], ["x"]]] * 4 and n_again == 4
    assert warned == ["DeprecationWarning"]
    assert "already been shut down" in errors["shut down"] and errors["ready again"] == 1
    assert "Invalid slice_index 1" in errors["slice_index 1"]
    assert "Invalid slice_index: 5" in errors["release 5"]
    assert "pg_per_slice=True" in errors["slice_placement_group"]
    for arg, messages in refused.items():
        for m in messages:
            assert arg in m and "tpuray" in m, (arg, m)
    assert refused.keys() == {"tpu_resource_per_chip", "bundle_label_selector", "lifetime",
                              "chips_per_vm", "resources_per_bundle", "strategy",
                              "subslice_placement_group"}
    assert len(refused["chips_per_vm"]) == 2
    assert left == [], "every group released"


def test_actor_group_restarts_whole_when_a_member_dies(slice_cluster):
    addr, env, tmp = slice_cluster
    (before, after, restarts) = run_script(tmp, env, MEMBER + f"""
    import signal

    @ray.remote
    class Member:
        def __init__(self, scale):
            self.scale = scale

        def info(self):
            return {{"worker": int(os.environ["TPU_WORKER_ID"]), "pid": os.getpid(),
                    "generation": int(os.environ["TPURAY_GANG_GENERATION"]),
                    "scale": self.scale, "node": ray.get_runtime_context().get_node_id()}}

    ray.init({addr!r})
    group = tpu.SliceActorGroup(Member, 3, topology="4x4", accelerator_version="v6e", max_restarts=2)
    before = group.call("info")
    out(before)
    # A member's worker process dies: the whole group is stopped and made again.
    victim = before[2]["pid"]
    os.kill(victim, signal.SIGKILL)
    after = group.call("info")
    out(after)
    out(group.restarts)
    group.shutdown()
    ray.shutdown()
    """)
    assert [m["worker"] for m in before] == [0, 1, 2, 3]
    assert all(m["generation"] == 0 and m["scale"] == 3 for m in before)
    assert [m["worker"] for m in after] == [0, 1, 2, 3]
    assert all(m["generation"] == 1 for m in after), after
    assert not {m["pid"] for m in before} & {m["pid"] for m in after}, "every member started anew"
    assert restarts == 1


def _device_and_jax_platforms(**extra_env) -> list:
    """``torch_device().type`` and the ``JAX_PLATFORMS`` it set, from a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(extra_env)
    r = subprocess.run(
        [sys.executable, "-c",
         "import os; from tpuray.util.tpu import torch_device; d = torch_device(); "
         "print(d.type, os.environ['JAX_PLATFORMS'])"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_two_tpu7x_16_hosts_form_one_v7x_slice_with_two_devices_per_chip(tmp_path_factory):
    """Ironwood (TPU.md): tpu7x-16 counts TensorCores, so it is 8 chips in 2x2x2 on two
    hosts of 4. Both hosts start as a real one would (TPU_* env + 4 chips), advertise
    TPU-V7X, the slice and one TPU-v7x-16-head; a gang over them gets two members whose
    TORCH_TPU_TOPOLOGY carries the devices per chip; one-chip actors on one host get
    distinct chips with v7x's four-value bounds."""
    c = CliCluster(tmp_path_factory.mktemp("v7x"))
    try:
        c.head(num_cpus=4).tpu_slice("ix", accelerator_type="tpu7x-16", topology="2x2x2",
                                     hosts=2, chips=4)
        (nodes, members, actors) = run_script(c.tmp, c.env, MEMBER + f"""
    ray.init({c.address!r})
    from tpuray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    tpu_nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU")]
    out([{{"res": n["Resources"], "labels": n["Labels"], "id": n["NodeID"]}} for n in tpu_nodes])
    out(ray.get(tpu.run_on_slice(member, "m", topology="2x2x2", accelerator_version="v7x"),
                timeout=120))

    @ray.remote(num_cpus=0, resources={{"TPU": 1}})
    class OneChip:
        def env(self):
            return {{k: os.environ.get(k) for k in ("TPU_VISIBLE_CHIPS",
                    "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS")}}

    worker0 = [n["id"] for n in [{{"id": x["NodeID"], "w": x["Labels"].get("ray.io/tpu-worker-id")}}
               for x in tpu_nodes] if n["w"] == "0"][0]
    on0 = NodeAffinitySchedulingStrategy(worker0, soft=False)
    group = [OneChip.options(scheduling_strategy=on0).remote() for _ in range(4)]
    out(ray.get([a.env.remote() for a in group], timeout=120))
    """)
        assert len(nodes) == 2, nodes
        heads = 0
        for n in nodes:
            r, lab = n["res"], n["labels"]
            assert r["TPU"] == 4.0 and r["accelerator_type:TPU-V7X"] == 1.0 and r["ix"] == 1.0, r
            heads += int(r.get("TPU-v7x-16-head", 0))
            assert lab["ray.io/tpu-pod-type"] == "v7x-16" and lab["ray.io/tpu-topology"] == "2x2x2"
        assert heads == 1, nodes
        assert sorted(m["TPU_WORKER_ID"] for m in members) == ["0", "1"], members
        for m in members:
            assert m["TORCH_TPU_TOPOLOGY"] == "2,2,2,2", m
            assert m["NNODES"] == "2" and m["WORLD_SIZE"] == "16", m  # 8 chips x 2 devices
            assert len(m["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 16, m
        for k in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "MASTER_ADDR", "MASTER_PORT",
                  "TPU_WORKER_HOSTNAMES", "TORCH_TPU_XPROF_SESSION_ID"):
            assert members[0][k] == members[1][k], k
        assert sorted(a["TPU_VISIBLE_CHIPS"] for a in actors) == ["0", "1", "2", "3"], actors
        for a in actors:
            assert a["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1,2", a
            assert a["TPU_PROCESS_BOUNDS"] == "1,1,1", a
    finally:
        c.stop()


def test_util_submodules_are_attributes_after_import_tpuray():
    """As the README writes it (and as ray.util's are after ``import ray``)."""
    code = ("import tpuray; tpuray.util.tpu.run_on_slice; "
            "tpuray.util.scheduling_strategies.NodeAffinitySchedulingStrategy; "
            "assert callable(tpuray.util.placement_group); print('ok')")  # a function, as Ray's
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_torch_device_falls_back_to_cpu_and_sets_jax_platforms(tmp_path):
    pytest.importorskip("torch")
    assert _device_and_jax_platforms() == ["cpu", "cpu"]


@pytest.mark.parametrize("tpu_module,cuda,want", [(True, True, "tpu"), (False, True, "cuda"), (False, False, "cpu")])
def test_torch_device_prefers_tpu_then_cuda_then_cpu(tmp_path, tpu_module, cuda, want):
    """The selection rule of TPU.md with stand-in ``torch``/``torch_tpu`` modules on the
    path (the real PyTorch is not needed to check the order)."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(textwrap.dedent(f"""
        class device:
            def __init__(self, kind):
                self.type = kind

        class cuda:
            @staticmethod
            def is_available():
                return {cuda}
    """))
    if tpu_module:
        (fake / "torch_tpu.py").write_text("")
    assert _device_and_jax_platforms(PYTHONPATH=str(fake)) == [want, want]
