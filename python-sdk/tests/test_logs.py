"""Worker output at the driver and ``tpuray logs``: Ray's repeated-line deduplication
compared with Ray 2.60's recorded driver output (``compat/logs_dedup.driver-lines``),
``RAY_DEDUP_LOGS=0``, ``init(log_to_driver=False)``, and the log files of workers read
back through the head (``tpuray logs``, ``tpuray.util.state.get_log``/``list_logs``,
and Ray's own ``ray.util.state.get_log`` against tpuray's head)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

COMPAT = Path(__file__).parent / "compat"
sys.path.insert(0, str(COMPAT))
from clean_output import driver_lines  # noqa: E402

REPEATED = re.compile(r" \[repeated (\d+)x across cluster\]")


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    for k in ("TPURAY_ADDRESS", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_DEDUP_LOGS"):
        e.pop(k, None)
    e["HOME"] = str(tmp_path / "home")
    e["TPURAY_REGISTRY_DIR"] = str(tmp_path / "registry")
    os.makedirs(e["HOME"])
    return e


def run_compat(name: str, env: dict, **extra) -> subprocess.CompletedProcess:
    env = dict(env, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(COMPAT / "shim")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return subprocess.run(
        [sys.executable, f"{name}.py"], cwd=COMPAT, env=env, capture_output=True, text=True,
        timeout=180,
    )


def shape(lines: str) -> tuple[set[str], int, int]:
    """(distinct lines with counts written K, lines printed plain, occurrences counted)."""
    distinct, plain, counted = set(), 0, 0
    for line in lines.splitlines():
        m = REPEATED.search(line)
        if m:
            counted += int(m.group(1))
        else:
            plain += 1
        distinct.add(REPEATED.sub(" [repeated Kx across cluster]", line))
    return distinct, plain, counted


def test_100_identical_lines_from_10_tasks_reach_the_driver_deduplicated_as_rays(env):
    r = run_compat("logs_dedup", env)
    assert r.returncode == 0, r.stderr
    got = driver_lines(r.stdout)
    want = (COMPAT / "logs_dedup.driver-lines").read_text()
    got_distinct, got_plain, got_counted = shape(got)
    want_distinct, want_plain, want_counted = shape(want)
    # Ray's recording: every line is accounted for, printed or counted, with Ray's text.
    assert want_plain + want_counted == 100, want
    assert got_distinct == want_distinct, f"tpuray:\n{got}\nRay 2.60:\n{want}"
    assert got_plain + got_counted == 100, got
    assert got_counted > 0 and got_plain < 100, got
    # The note on how to turn it off comes once.
    assert got.count("Set RAY_DEDUP_LOGS=0") == 1, got
    # The script's own lines stay in order around them.
    assert r.stdout.splitlines()[-1] == "done", r.stdout


def test_ray_dedup_logs_0_prints_every_line(env):
    r = run_compat("logs_dedup", env, RAY_DEDUP_LOGS="0")
    assert r.returncode == 0, r.stderr
    got = driver_lines(r.stdout).splitlines()
    assert got == ["(f pid=N) hello from the tasks"] * 100, r.stdout


def test_a_bad_dedup_regex_is_refused_at_init_by_name(env):
    r = run_compat("logs_dedup", env, RAY_DEDUP_LOGS_SKIP_REGEX="(unclosed")
    assert r.returncode != 0
    assert "RAY_DEDUP_LOGS_SKIP_REGEX" in r.stderr and "(unclosed" in r.stderr, r.stderr[-2000:]
