"""``tpuray.rl``: pieces of a GRPO trainer/sampler loop on tpuray.

- :func:`group_advantages`: GRPO's group-relative advantage.
- :func:`grpo_loss`: the clipped policy-gradient objective with an optional KL term
  (PyTorch).
- :class:`WeightStore`: weights as named, versioned objects in the object store, optionally
  sharded, that samplers pull by version (the trainer publishes, samplers fetch; the refs
  live as long as the store keeps the version).

Trainer and sampler gangs are :class:`tpuray.util.tpu.SliceActorGroup`s on separate slices.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tpuray


def group_advantages(rewards, group_size: int, eps: float = 1e-6):
    """GRPO's advantages: each completion's reward minus its group's mean, divided by the
    group's standard deviation plus ``eps``; a group of one has advantage 0. (DeepSeekMath,
    "Group Relative Policy Optimization", eq. 3 with outcome supervision.)

    Args:
        rewards: 1-D array-like of ``n * group_size`` rewards, groups contiguous (the
            ``group_size`` completions of prompt 0 first).
        group_size: completions per prompt (G).
        eps: added to the std (avoids dividing by 0 when all rewards in a group agree).

    Returns:
        ``numpy.ndarray`` of float64, same shape as ``rewards``.

    Raises:
        ValueError: ``group_size < 1`` or a length that is not a multiple of it.
    """
    import numpy as np

    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if group_size < 1 or r.size % group_size:
        raise ValueError(
            f"{r.size} rewards do not split into groups of {group_size} (expected a positive "
            f"group size dividing the number of rewards)"
        )
    if group_size == 1:
        return np.zeros_like(r)
    g = r.reshape(-1, group_size)
    adv = (g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1)


def grpo_loss(logp, logp_old, advantages, mask=None, *, clip_eps: float = 0.2,
              kl_coef: float = 0.0, logp_ref=None):
    """The GRPO objective to minimise (PyTorch): the PPO-style clipped surrogate
    ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)`` with
    ``ratio = exp(logp - logp_old)``, plus ``kl_coef`` times the k3 estimate of
    KL(policy || reference) ``exp(ref - logp) - (ref - logp) - 1`` when ``logp_ref`` is
    given; averaged over the tokens where ``mask`` is 1.

    Args:
        logp, logp_old, logp_ref: ``[batch, tokens]`` log-probabilities of the sampled
            tokens under the policy being trained, the sampling policy and the reference.
        advantages: ``[batch]`` (one per completion) or ``[batch, tokens]``.
        mask: ``[batch, tokens]`` of 0/1 (completion tokens); all ones when ``None``.

    Returns:
        A scalar tensor.
    """
    import torch

    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    ratio = torch.exp(logp - logp_old)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    if kl_coef and logp_ref is not None:
        d = logp_ref - logp
        per_token = per_token + kl_coef * (torch.exp(d) - d - 1)
    if mask is None:
        return per_token.mean()
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@tpuray.remote(num_cpus=0)
class _WeightStoreActor:
    def __init__(self, keep: int):
        self._keep = keep
        self._versions: dict[str, dict[int, list]] = {}

    def publish(self, name: str, version: int, shards: list) -> int:
        v = self._versions.setdefault(name, {})
        v[version] = shards  # refs: the store keeps them alive
        for old in sorted(v)[:-self._keep]:
            del v[old]
        return version

    def fetch(self, name: str, version: Optional[int]):
        v = self._versions.get(name, {})
        if not v:
            return None
        if version is None:
            version = max(v)
        if version not in v:
            return ("missing", sorted(v))
        return (version, v[version])

    def versions(self, name: str) -> list:
        return sorted(self._versions.get(name, {}))


class WeightStore:
    """Named, versioned weights in the object store (the trainer publishes, samplers pull a
    version). A detached named actor holds the refs of the last ``keep`` versions of each
    name, so the objects live while any sampler may still ask for them.

    Every process that opens ``WeightStore(store_name)`` sees the same store.
    """

    def __init__(self, store_name: str = "tpuray-weights", keep: int = 2):
        self._actor = _WeightStoreActor.options(
            name=store_name, get_if_exists=True, lifetime="detached"
        ).remote(keep)

    def publish(self, name: str, version: int, shards: Sequence[Any]) -> int:
        """Puts every shard (e.g. one state-dict slice per trainer member; refs are kept
        as they are) and records them as ``name`` at ``version``."""
        refs = [s if isinstance(s, tpuray.ObjectRef) else tpuray.put(s) for s in shards]
        # Nested in a list, the refs travel as refs: the store borrows them.
        return tpuray.get(self._actor.publish.remote(name, int(version), refs))

    def fetch(self, name: str, version: Optional[int] = None, timeout: Optional[float] = None) -> tuple:
        """``(version, shards)``: ``version`` (default: the newest) of ``name``.

        Raises:
            KeyError: nothing published under ``name``, or that version is gone (naming the
                versions kept).
        """
        got = tpuray.get(self._actor.fetch.remote(name, version), timeout=timeout)
        if got is None:
            raise KeyError(f"no weights published under {name!r}")
        if got[0] == "missing":
            raise KeyError(f"{name!r} has no version {version} (kept: {got[1]})")
        v, refs = got
        return v, tpuray.get(list(refs), timeout=timeout)

    def versions(self, name: str) -> list:
        return tpuray.get(self._actor.versions.remote(name))


__all__ = ["WeightStore", "group_advantages", "grpo_loss"]
