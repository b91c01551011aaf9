"""`tpuray microbenchmark`: a tiny run of the Python and the Rust cases, each
printed under Ray's case name, with the floor measured in the same run."""

import json
import os
import subprocess
import sys

import pytest

from tpuray import _tpuray

FAST = ["--json", "--warmup-sleep", "0", "--trials", "1", "--trial-seconds", "0.2"]
# The test command installs a debug build (scripts/python-tests.sh), which the benchmark
# refuses unless asked to go on.
if not _tpuray.OPTIMIZED:
    FAST.append("--allow-debug-build")


def microbenchmark(*args):
    out = subprocess.run(
        [sys.executable, "-m", "tpuray", "microbenchmark", *FAST, *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_python_cases_print_rays_names_after_the_floor():
    rows = microbenchmark("--filter", "single client tasks sync|1:1 actor calls sync")
    names = [r["name"] for r in rows]
    assert names[:3] == [
        "floor: empty tonic unary RPC round trip (loopback)",
        "floor: raw TCP 64-byte round trip (loopback)",
        "floor: memcpy 100 MB (GB)",
    ]
    assert names[3:] == ["single client tasks sync", "1:1 actor calls sync"]
    assert all(r["mean"] > 0 and r["sd"] >= 0 for r in rows)
    assert rows[1]["unit"] == "per second" and rows[2]["unit"] == "GB per second"


def test_rust_cases_run_from_the_cli_and_report_what_they_skip():
    rows = microbenchmark(
        "--rust", "--no-floor", "--filter", "single client tasks sync|1:1 async-actor calls sync"
    )
    assert rows[0]["name"] == "single client tasks sync" and rows[0]["mean"] > 0
    assert rows[1] == {
        "name": "1:1 async-actor calls sync",
        "skipped": "the Rust SDK has no async actors",
    }


@pytest.mark.skipif(_tpuray.OPTIMIZED, reason="a release build is measured without asking")
def test_a_debug_build_is_refused_unless_asked_to_go_on():
    env = {k: v for k, v in os.environ.items() if k != "TPURAY_ALLOW_DEBUG_BUILD"}
    out = subprocess.run(
        [sys.executable, "-m", "tpuray", "microbenchmark", "--quick", "--no-floor"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode != 0 and out.stdout == "", out
    assert "refusing to measure a debug build" in out.stderr, out.stderr
    assert "--allow-debug-build" in out.stderr, out.stderr
    # The Python cases refuse on their own too (a release CLI can run a debug extension).
    out = subprocess.run(
        [sys.executable, "-m", "tpuray._private.ray_perf"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 2 and "TPURAY_ALLOW_DEBUG_BUILD=1" in out.stderr, out
