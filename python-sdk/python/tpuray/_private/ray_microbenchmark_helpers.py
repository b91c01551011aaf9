"""Ray's microbenchmark timing (``ray/_private/ray_microbenchmark_helpers.timeit``),
reproduced so ``tpuray microbenchmark`` measures each case the way ``ray
microbenchmark`` does: an idle pause, a 1 s warm-up that counts the calls, then
trials of 2 s each running the function in steps of a tenth of the warm-up count;
the mean and population sd of ``multiplier * calls / seconds`` over the trials.

The environment selects and shortens runs:

- ``TESTS_TO_RUN`` / ``TESTS_TO_SKIP``: run only the cases whose name contains
  the pattern / skip those that contain it (Ray's variables; here ``a|b`` means
  either);
- ``TPURAY_MICROBENCH_WARMUP_S`` (default 10, Ray's idle pause before each case),
  ``TPURAY_MICROBENCH_TRIALS`` (default 4) and ``TPURAY_MICROBENCH_TRIAL_S``
  (default 2): shorter runs for trying things out;
- ``TPURAY_MICROBENCH_JSON=1``: one JSON object per case
  (``{"name", "mean", "sd", "unit"}``) instead of Ray's text line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, List, Optional, Tuple

filter_pattern = os.environ.get("TESTS_TO_RUN", "")
skip_pattern = os.environ.get("TESTS_TO_SKIP", "")
WARMUP_S = float(os.environ.get("TPURAY_MICROBENCH_WARMUP_S", "10"))
TRIALS = int(os.environ.get("TPURAY_MICROBENCH_TRIALS", "4"))
TRIAL_S = float(os.environ.get("TPURAY_MICROBENCH_TRIAL_S", "2"))
JSON = os.environ.get("TPURAY_MICROBENCH_JSON", "") not in ("", "0")

Result = Optional[Tuple[str, float, float]]


def selected(name: str) -> bool:
    """Whether ``TESTS_TO_RUN`` / ``TESTS_TO_SKIP`` let the case named ``name`` run."""
    if filter_pattern and not any(p in name for p in filter_pattern.split("|")):
        return False
    if skip_pattern and any(p in name for p in skip_pattern.split("|")):
        return False
    return True


def report(name: str, mean: float, sd: float) -> None:
    """Prints one case's figure: Ray's line, or a JSON object with ``TPURAY_MICROBENCH_JSON``."""
    if JSON:
        print(
            json.dumps({"name": name, "mean": mean, "sd": sd, "unit": "per second"}),
            flush=True,
        )
    else:
        print(name, "per second", round(mean, 2), "+-", round(sd, 2), flush=True)


def skipped(name: str, reason: str) -> List[Result]:
    """Reports a case that cannot run here, with why."""
    if not selected(name):
        return [None]
    if JSON:
        print(json.dumps({"name": name, "skipped": reason}), flush=True)
    else:
        print(f"{name} skipped: {reason}", flush=True)
    return [None]


def timeit(
    name: str, fn: Callable[[], object], multiplier: float = 1, warmup_time_sec: float | None = None
) -> List[Result]:
    """Times ``fn`` as Ray's ``timeit`` does; returns ``[(name, mean, sd)]``, or
    ``[None]`` for a case the filters leave out.

    Args:
        name: The case's name, as Ray prints it.
        fn: One call of the workload.
        multiplier: Operations per call of ``fn`` (so the figure is operations/s).
        warmup_time_sec: The idle pause before the case (default
            ``TPURAY_MICROBENCH_WARMUP_S``, 10 s as Ray's).
    """
    if not selected(name):
        return [None]
    time.sleep(WARMUP_S if warmup_time_sec is None else warmup_time_sec)
    start = time.perf_counter()
    count = 0
    while time.perf_counter() - start < 1:
        fn()
        count += 1
    step = count // 10 + 1
    stats = []
    for _ in range(TRIALS):
        start = time.perf_counter()
        count = 0
        while time.perf_counter() - start < TRIAL_S:
            for _ in range(step):
                fn()
            count += step
        end = time.perf_counter()
        stats.append(multiplier * count / (end - start))
    mean = sum(stats) / len(stats)
    sd = (sum((s - mean) ** 2 for s in stats) / len(stats)) ** 0.5
    report(name, mean, sd)
    return [(name, mean, sd)]
