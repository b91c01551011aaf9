"""GRPO's group-relative advantage and clipped policy-gradient loss (Shao et al. 2024,
"DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
section 4.1, https://arxiv.org/abs/2402.03300).

``group_advantages``: score minus the group mean, over the group std plus eps; a group
of one gets 0. ``grpo_loss``: the clipped surrogate, an optional k3 KL term to a
reference, and ``num_tokens=`` so that data-parallel members' summed gradients equal the
whole batch's mean loss. Pure torch/numpy, no cluster calls.
"""

from __future__ import annotations


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
              kl_coef: float = 0.0, logp_ref=None, num_tokens=None):
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
        clip_eps: the clip range of the probability ratio (DeepSeekMath's epsilon).
        kl_coef: weight of the KL term (DeepSeekMath's beta); needs ``logp_ref``.
        num_tokens: divide the masked sum by this count instead of this batch's own token
            count: data-parallel members pass the token count of the whole batch (summed
            over members) so that summing their gradients (an all-reduce) gives the
            gradient of the whole batch's loss.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: shapes that do not match, ``clip_eps < 0``, or ``kl_coef`` without
            ``logp_ref``.
    """
    import torch

    if logp.shape != logp_old.shape or logp.dim() != 2:
        raise ValueError(
            f"logp and logp_old must both be [batch, tokens], got {tuple(logp.shape)} and "
            f"{tuple(logp_old.shape)}"
        )
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [batch] or [batch, tokens] = {tuple(logp.shape)}, got "
            f"{tuple(advantages.shape)}"
        )
    if mask is not None and mask.shape != logp.shape:
        raise ValueError(f"mask must be {tuple(logp.shape)}, got {tuple(mask.shape)}")
    if logp_ref is not None and logp_ref.shape != logp.shape:
        raise ValueError(f"logp_ref must be {tuple(logp.shape)}, got {tuple(logp_ref.shape)}")
    if clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")
    if kl_coef and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref (the reference policy's log-probabilities)")

    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    ratio = torch.exp(logp - logp_old)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    if kl_coef and logp_ref is not None:
        d = logp_ref - logp
        per_token = per_token + kl_coef * (torch.exp(d) - d - 1)
    if mask is None:
        mask = torch.ones_like(per_token)
    mask = mask.to(per_token.dtype)
    denom = mask.sum().clamp(min=1) if num_tokens is None else max(float(num_tokens), 1.0)
    return (per_token * mask).sum() / denom
