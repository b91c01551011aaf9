"""``tpuray.rl``: the pieces of a GRPO trainer/sampler loop on tpuray (DESIGN.md section 10).

- :func:`group_advantages`, :func:`grpo_loss`: GRPO's group-relative advantage and clipped
  policy-gradient objective with an optional KL term (DeepSeekMath, Shao et al. 2024,
  https://arxiv.org/abs/2402.03300).
- :class:`WorkerGroup`: a trainer or sampler pool, on TPU slices (one actor per host of an
  intact slice, the gang environment of ``tpuray.util.tpu``) or on CPUs (``n`` actors of
  ``num_cpus`` each), called together (``call`` gathers from every member). Each group's
  resources are reserved for it alone, so trainer and samplers never share chips, and a
  pool the cluster cannot hold fails at once with :class:`PoolUnsatisfiableError` naming
  the missing resource and who holds it.
- :class:`WeightStore`: weights as named, versioned objects in the object store, published
  whole or one shard per trainer member, pulled by version by samplers; old versions are
  dropped (and freed) as new ones come.

A loop: ``trainer = WorkerGroup(Trainer, name="trainer", topology="4x4",
accelerator_version="v6e")``, ``samplers = WorkerGroup(Sampler, name="sampler", ...)``;
each step the samplers fetch version ``v`` from the store, generate and score, the driver
computes advantages, the trainer members update (all-reducing gradients) and publish
version ``v + 1``, one shard each. ``examples/python/grpo.py`` is a whole one.
"""

from __future__ import annotations

from tpuray.rl.grpo import group_advantages, grpo_loss
from tpuray.rl.weights import WeightStore
from tpuray.rl.worker_group import PoolUnsatisfiableError, WorkerGroup

__all__ = ["PoolUnsatisfiableError", "WeightStore", "WorkerGroup", "group_advantages", "grpo_loss"]
