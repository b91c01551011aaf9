"""Compatibility recordings: each Ray script in ``compat/`` (plain Ray: ``import ray``,
``from ray.util.queue import Queue``, ...) runs under tpuray, through the ``ray`` shim
in ``compat/shim``, and must print exactly what it printed under Ray 2.60 when
``scripts/record-compat.sh`` recorded ``compat/NAME.expected``. Only stdout counts,
cleaned alike on both sides (``compat/clean_output.py``); each script starts its own
local cluster (``ray.init(num_cpus=...)``) with this test's HOME and registry.

The recording script makes its own venv from PyPI (``bench/.ray-venv``) when missing.
The shim is a ``ray`` package first on ``PYTHONPATH`` whose meta-path finder maps
``ray.*`` onto the same ``tpuray.*`` module objects; the cleaning drops cluster
diagnostics and worker log lines. Scripts print only deterministic output (sorted where
order is free, no ids, times or pids). The collective all-reduce across two real nodes
is ``test_collective.py``.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMPAT = Path(__file__).parent / "compat"
sys.path.insert(0, str(COMPAT))
from clean_output import clean  # noqa: E402

SCRIPTS = sorted(p.stem for p in COMPAT.glob("*.py") if p.stem != "clean_output")


def test_every_script_is_recorded():
    missing = [s for s in SCRIPTS if not (COMPAT / f"{s}.expected").exists()]
    assert not missing, f"run scripts/record-compat.sh {' '.join(missing)}"
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_prints_what_ray_printed(name, tmp_path):
    env = dict(os.environ)
    for k in ("TPURAY_ADDRESS", "RAY_ADDRESS"):
        env.pop(k, None)
    env["HOME"] = str(tmp_path / "home")
    env["TPURAY_REGISTRY_DIR"] = str(tmp_path / "registry")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(COMPAT / "shim")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    os.makedirs(env["HOME"])
    r = subprocess.run(
        [sys.executable, f"{name}.py"], cwd=COMPAT, env=env, capture_output=True, text=True,
        timeout=180,
    )
    got = clean(r.stdout)
    want = (COMPAT / f"{name}.expected").read_text()
    if r.returncode != 0 or got != want:
        diff = "".join(
            difflib.unified_diff(
                want.splitlines(True), got.splitlines(True), f"{name}.expected (Ray 2.60)",
                f"{name} under tpuray",
            )
        )
        pytest.fail(
            f"exit code {r.returncode}\n{diff}\n--- stderr (last 40 lines) ---\n"
            + "\n".join(r.stderr.splitlines()[-40:])
        )
