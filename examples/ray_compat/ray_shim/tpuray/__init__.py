"""Runs the compatibility scripts under Ray itself: `import tpuray as ray` gets Ray.

Only for `bench/ray_compat.sh`, which puts this folder on PYTHONPATH in Ray's virtual
environment; never installed.
"""

import sys

import ray
import ray.exceptions
import ray.util
import ray.util.placement_group
import ray.util.scheduling_strategies

sys.modules[__name__] = ray
for name in ("exceptions", "util", "util.placement_group", "util.scheduling_strategies"):
    sys.modules[f"{__name__}.{name}"] = sys.modules[f"ray.{name}"]
