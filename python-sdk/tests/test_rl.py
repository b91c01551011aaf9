"""``tpuray.rl``: GRPO's group-relative advantage and clipped loss, and weights as named,
versioned objects (on the session's in-process cluster, conftest.py)."""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")

import tpuray as ray  # noqa: E402
from tpuray.rl import WeightStore, group_advantages, grpo_loss  # noqa: E402


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
