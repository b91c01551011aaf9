"""Which build of tpuray's Rust extension this process runs, and the guard every
benchmark calls before it measures anything.

A debug build (``MATURIN_PEP517_ARGS="--profile dev"``, as ``scripts/python-tests.sh``
installs into its own virtual environment) runs the core several times slower than a
release build, so its figures are not tpuray's. Ray has the same check:
``ray._raylet.OPTIMIZED``, which ``ray microbenchmark`` warns about
(``ray/_private/ray_perf.py``, ``check_optimized_build``); here a benchmark refuses a
debug build unless ``TPURAY_ALLOW_DEBUG_BUILD=1`` is set (or ``tpuray microbenchmark
--allow-debug-build``, which sets it for its children), and then warns.
"""

from __future__ import annotations

import os
import sys

from tpuray import _tpuray

#: Set to ``1`` to measure a debug build anyway (a warning is still printed).
ALLOW_ENV = "TPURAY_ALLOW_DEBUG_BUILD"


def is_optimized() -> bool:
    """True when the extension was compiled with optimisations (cargo's release profile)."""
    return bool(_tpuray.OPTIMIZED)


def require_optimized_build(what: str) -> None:
    """Return at once for a release build; for a debug build, exit with status 2 naming
    the build and how to get a release one, unless :data:`ALLOW_ENV` is ``1`` (then warn
    on stderr and return).

    :param what: the benchmark's name, printed at the start of the message.
    :raises SystemExit: a debug build without :data:`ALLOW_ENV` set.
    """
    if is_optimized():
        return
    where = getattr(_tpuray, "__file__", "tpuray._tpuray")
    if os.environ.get(ALLOW_ENV) == "1":
        print(
            f"{what}: WARNING: measuring a debug build of tpuray ({where}); "
            "its figures are not tpuray's",
            file=sys.stderr,
        )
        return
    print(
        f"{what}: refusing to measure a debug build of tpuray ({where}): its figures would "
        "not be tpuray's. Install a release build (`pip install ./python-sdk` with "
        "MATURIN_PEP517_ARGS unset, as ./scripts/demo.sh does into .venv), or set "
        f"{ALLOW_ENV}=1 (`tpuray microbenchmark --allow-debug-build`) to measure it anyway.",
        file=sys.stderr,
    )
    raise SystemExit(2)
