"""``tpuray.rl``: GRPO's group-relative advantage and clipped loss, weights as named,
versioned (sharded) objects, and worker groups for trainer and sampler pools: on the
session's in-process cluster (conftest.py) for the CPU form, and on a CLI cluster of two
simulated single-host v6e-4 slices for the TPU form (separate slices, a pool that does not
fit failing at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import CliCluster

np = pytest.importorskip("numpy")

import tpuray as ray  # noqa: E402
from tpuray.rl import (  # noqa: E402
    PoolUnsatisfiableError,
    WeightStore,
    WorkerGroup,
    group_advantages,
    grpo_loss,
)


@pytest.fixture(scope="module", autouse=True)
def _shared_cluster(cluster):
    return cluster


def test_group_advantage_is_score_minus_group_mean_over_std_plus_eps():
    r = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    adv = group_advantages(r, group_size=4, eps=1e-6)
    g0 = np.array([1.0, 0.0, 0.0, 1.0])
    assert np.allclose(adv[:4], (g0 - 0.5) / (g0.std() + 1e-6))
    assert np.allclose(adv[4:], 0.0), "equal rewards: no signal"
    assert np.all(group_advantages([3.0, -1.0], group_size=1) == 0), "a group of one has 0"
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1, 2, 3, 4], group_size=3)


def test_grpo_loss_clips_the_ratio_and_adds_kl():
    torch = pytest.importorskip("torch")
    logp_old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    # Same policy: ratio 1, loss = -mean(A) over tokens = 0.
    assert torch.isclose(grpo_loss(logp_old, logp_old, adv), torch.tensor(0.0))
    # A much likelier token with positive advantage is clipped at 1 + eps.
    big = torch.full((1, 3), 2.0)
    loss = grpo_loss(big, torch.zeros(1, 3), torch.tensor([1.0]), clip_eps=0.2)
    assert torch.isclose(loss, torch.tensor(-1.2))
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    with_kl = grpo_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([0.0]), mask,
                        kl_coef=0.5, logp_ref=torch.full((1, 3), 1.0))
    assert torch.isclose(with_kl, torch.tensor(0.5 * (np.e - 1 - 1)))


def test_weights_are_named_versioned_objects_samplers_pull_by_version():
    store = WeightStore("test-weights", keep=2)
    w1 = {"layer": np.arange(1000, dtype=np.float32)}
    store.publish("policy", 1, [w1, {"layer": np.ones(10)}])
    store.publish("policy", 2, [{"layer": np.zeros(3)}])

    @ray.remote
    def sampler(version):
        s = WeightStore("test-weights")
        v, shards = s.fetch("policy", version)
        return v, [float(x["layer"].sum()) for x in shards]

    assert ray.get(sampler.remote(1)) == (1, [float(w1["layer"].sum()), 10.0])
    assert ray.get(sampler.remote(None)) == (2, [0.0])
    store.publish("policy", 3, [{"layer": np.ones(2)}])
    assert store.versions("policy") == [2, 3], "keeps the newest two"
    with pytest.raises(KeyError, match="no version 1"):
        store.fetch("policy", 1)
    with pytest.raises(KeyError, match="no weights"):
        store.fetch("value")


def test_grpo_loss_rejects_mismatched_shapes():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="logp and logp_old"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="needs logp_ref"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), kl_coef=0.1)
    # num_tokens: two halves' losses sum to the whole batch's loss (data-parallel members).
    lp, adv = torch.randn(4, 3), torch.randn(4)
    whole = grpo_loss(lp, lp.detach() - 0.1, adv)
    halves = sum(grpo_loss(lp[i:i + 2], lp[i:i + 2].detach() - 0.1, adv[i:i + 2], num_tokens=12)
                 for i in (0, 2))
    assert torch.isclose(whole, halves)


@ray.remote
class _Member:
    def __init__(self, tag):
        self.tag = tag

    def who(self):
        return {"tag": self.tag, "rank": int(os.environ["NODE_RANK"]),
                "world": int(os.environ["NNODES"]), "master": os.environ["MASTER_ADDR"],
                "port": os.environ["MASTER_PORT"], "group": os.environ["TPURAY_WORKER_GROUP"],
                "pid": os.getpid()}

    def echo(self, x):
        return (int(os.environ["NODE_RANK"]), x)

    def publish(self, store, version):
        """Publishes this member's shard of a fake state dict; returns the object id."""
        rank, world = int(os.environ["NODE_RANK"]), int(os.environ["NNODES"])
        shard = {f"layer{rank}": np.full(50_000, version * 10 + rank, dtype=np.float32)}
        ref = ray.put(shard)
        WeightStore(store).publish_shard("policy", version, rank, world, ref)
        return ref.hex()


def test_worker_group_gathers_from_every_member_in_member_order():
    with WorkerGroup(_Member, "t", name="gather", num_workers=3, num_cpus=0.5) as g:
        who = g.call("who")
        assert [w["rank"] for w in who] == [0, 1, 2]
        assert {(w["world"], w["port"], w["group"], w["tag"]) for w in who} == {(3, who[0]["port"], "gather", "t")}
        assert len({w["pid"] for w in who}) == 3, "one actor per member"
        assert g.call_each("echo", [("a",), ("b",), ("c",)]) == [(0, "a"), (1, "b"), (2, "c")]
        assert [p["rank"] for p in g.placement()] == [0, 1, 2]
        with pytest.raises(ValueError, match="one argument tuple per member"):
            g.call_each("echo", [("a",)])
    with pytest.raises(RuntimeError, match="shut down"):
        g.call("who")


def test_worker_group_rejects_bad_arguments():
    with pytest.raises(TypeError, match="remote class"):
        WorkerGroup(object, num_workers=1)
    with pytest.raises(ValueError, match="not both or neither"):
        WorkerGroup(_Member, num_workers=1, topology="2x2", accelerator_version="v6e")
    with pytest.raises(ValueError, match="not both or neither"):
        WorkerGroup(_Member)
    with pytest.raises(ValueError, match="invalid TPU topology"):
        WorkerGroup(_Member, topology="four", accelerator_version="v6e")
    with pytest.raises(ValueError, match="is not valid for v6e"):
        WorkerGroup(_Member, topology="3x3", accelerator_version="v6e")
    with pytest.raises(ValueError, match="unknown TPU version"):
        WorkerGroup(_Member, topology="4x4", accelerator_version="v9z")


def test_tpu_slice_arithmetic_follows_tpu_md_for_every_generation():
    """One implementation (Rust) behind every Python use: v4/v5p/v7x types count
    TensorCores (tpu7x-16 is 8 chips on 2 hosts, as Ray reads it since ray PR#60338)."""
    from tpuray import _tpuray
    from tpuray.rl.worker_group import _slice_shape

    cases = {
        "tpu7x-16": ("v7x-16", 8, 2, 4), "7x-8": ("v7x-8", 4, 1, 4),
        "v4-32": ("v4-32", 16, 4, 4), "v5p-8": ("v5p-8", 4, 1, 4),
        "v6e-16": ("v6e-16", 16, 4, 4), "v6e-8": ("v6e-8", 8, 1, 8),
        "v5litepod-16": ("v5litepod-16", 16, 4, 4),
    }
    for ty, want in cases.items():
        assert _tpuray.tpu_slice_shape(ty) == want, ty
    assert _slice_shape("2x2x2", "v7x") == ("v7x-16", 2)
    assert _slice_shape("2x2x2", "tpu7x") == ("v7x-16", 2)
    assert _slice_shape("4x4", "v6e") == ("v6e-16", 4)
    with pytest.raises(ValueError, match="unknown TPU accelerator type"):
        _tpuray.tpu_slice_shape("v7x-3")


def test_cpu_pool_that_cannot_fit_fails_at_once_naming_the_resource():
    total = ray.cluster_resources()["CPU"]
    t0 = time.monotonic()
    with pytest.raises(PoolUnsatisfiableError, match=r"sampler pool needs \d+ more workers? of \{CPU: 1\}"):
        WorkerGroup(_Member, "s", name="sampler", num_workers=int(total) + 1, num_cpus=1)
    assert time.monotonic() - t0 < 10, "no waiting for resources that cannot come"
    # A group holding CPUs is named as the holder.
    with WorkerGroup(_Member, "t", name="trainer", num_workers=1, num_cpus=total - 0.5):
        with pytest.raises(PoolUnsatisfiableError, match="trainer holds the rest"):
            WorkerGroup(_Member, "s", name="sampler", num_workers=1, num_cpus=1)


def _store_object_ids(head_address: str) -> set:
    r = subprocess.run([sys.executable, "-m", "tpuray", "memory", "--format", "json",
                        "--top", "1000", "--address", head_address],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {o["object_id"] for n in json.loads(r.stdout) for o in n.get("largest", [])}


def test_sharded_weights_from_every_trainer_member_pulled_by_version_old_ones_freed(cluster):
    store = WeightStore("test-sharded", keep=2)

    @ray.remote(num_cpus=0)
    def sampler(version):
        v, shards = WeightStore("test-sharded").fetch("policy", version, wait=30)
        merged = {k: float(a[0]) for s in shards for k, a in s.items()}
        return v, merged

    try:
        with WorkerGroup(_Member, "t", name="trainer", num_workers=2, num_cpus=0.5) as trainer:
            # The sampler asks for version 1 before it exists and waits for it.
            early = sampler.remote(1)
            ids = {1: trainer.call("publish", "test-sharded", 1)}
            assert ray.get(early, timeout=60) == (1, {"layer0": 10.0, "layer1": 11.0})
            for v in (2, 3):
                ids[v] = trainer.call("publish", "test-sharded", v)
            assert store.versions("policy") == [2, 3]
            assert ray.get(sampler.remote(2)) == (2, {"layer0": 20.0, "layer1": 21.0})
            assert ray.get(sampler.remote(None)) == (3, {"layer0": 30.0, "layer1": 31.0})
            with pytest.raises(KeyError, match="no version 1"):
                store.fetch("policy", 1)
            # Only one member's shard of version 4: not visible yet.
            ray.get(trainer.actors[0].publish.remote("test-sharded", 4))
            assert store.versions("policy") == [2, 3]
            with pytest.raises(KeyError, match="no version 4"):
                store.fetch("policy", 4, wait=0.2)
            # Version 1's objects are freed once the store dropped them (nobody else held them).
            deadline = time.monotonic() + 20
            while set(ids[1]) & _store_object_ids(cluster["head_address"]):
                assert time.monotonic() < deadline, "version 1 was not freed"
                time.sleep(0.5)
            assert set(ids[3]) <= _store_object_ids(cluster["head_address"])
        with pytest.raises(ValueError, match="older than every version kept"):
            store.publish("policy", 1, [{"x": 1}])
    finally:
        store.destroy()


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory):
    """Two simulated single-host v6e-4 slices (2x2), ``ta`` and ``tb``."""
    c = CliCluster(tmp_path_factory.mktemp("rl-slices"))
    try:
        c.head(num_cpus=1)
        c.tpu_slice("ta", "v6e-4", "2x2", hosts=1, chips=4)
        c.tpu_slice("tb", "v6e-4", "2x2", hosts=1, chips=4)
        yield c
    finally:
        c.stop()


def test_trainer_and_sampler_on_separate_slices_a_third_pool_fails_at_once(two_slices, tmp_path):
    script = tmp_path / "pools.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, time
        import numpy as np
        import tpuray as ray
        from tpuray.rl import PoolUnsatisfiableError, WeightStore, WorkerGroup

        @ray.remote
        class Member:
            def where(self):
                return {{"slice": os.environ["TPU_NAME"], "chips": os.environ.get("TPU_VISIBLE_CHIPS"),
                        "node": ray.get_runtime_context().get_node_id()}}
            def publish(self, v):
                WeightStore("pools").publish_shard("w", v, 0, 1, {{"x": np.full(4, v)}})
            def pull(self, v):
                return WeightStore("pools").fetch("w", v, wait=30)[1][0]["x"].tolist()

        def out(x):
            print("JSON " + json.dumps(x), flush=True)

        ray.init({two_slices.address!r})
        trainer = WorkerGroup(Member, name="trainer", topology="2x2", accelerator_version="v6e")
        sampler = WorkerGroup(Member, name="sampler", topology="2x2", accelerator_version="v6e")
        out([trainer.call("where"), sampler.call("where"), trainer.placement(), sampler.placement()])
        store = WeightStore("pools")
        trainer.call("publish", 7)
        out(sampler.call("pull", 7))
        errors = []
        for kw in (dict(topology="2x2", accelerator_version="v6e"),
                   dict(topology="4x4", accelerator_version="v6e")):
            t0 = time.monotonic()
            try:
                WorkerGroup(Member, name="critic", **kw)
                errors.append(["no error", 0])
            except PoolUnsatisfiableError as e:
                errors.append([str(e), time.monotonic() - t0])
        out(errors)
        sampler.shutdown()
        # The slice is free again: the next pool gets it.
        critic = WorkerGroup(Member, name="critic", topology="2x2", accelerator_version="v6e")
        out(critic.call("where"))
        store.destroy()
        ray.shutdown()
    """))
    r = subprocess.run([sys.executable, str(script)], env=two_slices.env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (where, pulled, errors, critic) = [json.loads(l[5:]) for l in r.stdout.splitlines()
                                        if l.startswith("JSON ")]
    t_where, s_where, t_place, s_place = where
    assert len(t_where) == len(s_where) == 1
    assert {t_where[0]["slice"], s_where[0]["slice"]} == {"ta", "tb"}, "separate slices"
    assert t_where[0]["node"] != s_where[0]["node"]
    assert [p["slice"] for p in t_place] == [t_where[0]["slice"]]
    assert [p["node_id"] for p in s_place] == [s_where[0]["node"]]
    assert pulled == [[7, 7, 7, 7]]
    (same, (bigger, t_bigger)) = errors
    msg, took = same
    assert msg.startswith("critic pool needs 1 more intact v6e-4 slice (TPU 2x2): cluster has 2"), msg
    assert f"trainer holds {t_where[0]['slice']}" in msg and f"sampler holds {s_where[0]['slice']}" in msg, msg
    assert took < 10, "fails at once"
    assert bigger.startswith("critic pool needs 1 more intact v6e-16 slice (TPU 4x4): cluster has 0"), bigger
    assert critic[0]["slice"] == s_where[0]["slice"]


def _example(name: str):
    """Imports ``examples/python/<name>.py`` as a module (runs nothing: main is guarded)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tpuray_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_examples_export_what_a_serving_example_imports(tmp_path):
    torch = pytest.importorskip("torch")
    grpo = _example("grpo")
    policy = grpo.Policy()
    torch.save({"config": policy.config, "state": policy.state_dict()}, tmp_path / "p.pt")
    loaded = grpo.load_policy(str(tmp_path / "p.pt"))
    out = grpo.answer(loaded, "3+4=")
    assert isinstance(out, str) and len(out) <= grpo.MAX_NEW
    assert grpo.reward(3, 4, grpo.encode("7$")) == 1.0
    assert grpo.reward(3, 4, grpo.encode("7")) == 0.0, "no end mark: no reward"
    assert grpo.reward(3, 4, grpo.encode("8$")) == 0.0
    with pytest.raises(ValueError, match="not in the vocabulary"):
        grpo.answer(loaded, "3*4=")
    with pytest.raises(ValueError, match="characters"):
        grpo.answer(loaded, "")
    pytest.importorskip("sklearn")
    digits = _example("digits")
    net = digits.DigitsNet()
    torch.save(net.state_dict(), tmp_path / "d.pt")
    preds = digits.predict_digits(digits.load_digits_model(str(tmp_path / "d.pt")), [[0.0] * 64, [16.0] * 64])
    assert len(preds) == 2 and all(0 <= p <= 9 for p in preds)
    with pytest.raises(ValueError, match="0..16"):
        digits.predict_digits(net, [[17.0] * 64])
    with pytest.raises(ValueError, match="n x 64"):
        digits.predict_digits(net, [[1.0] * 8])
