#!/usr/bin/env bash
# Records what the Ray scripts of python-sdk/tests/compat/ print under Ray itself, into
# NAME.expected beside each NAME.py; python-sdk/tests/test_compat.py then runs each
# script under tpuray only (through the `ray` shim in compat/shim) and compares.
#
#   scripts/record-compat.sh              # every script
#   scripts/record-compat.sh queue_basics # one (or several) by name
#
# Ray runs from RAY_VENV (default bench/.ray-venv), made here with
# `pip install ray[data,serve]==$RAY_VERSION numpy torch pillow pydantic` (default 2.60.0) when it does not exist;
# torch is what ray.util.collective's gloo backend runs on. Each script gets a HOME of
# its own (Ray writes ~/.ray there) and a timeout. Only stdout is recorded, cleaned by
# compat/clean_output.py (Ray's own diagnostics dropped); stderr is shown on failure.
# Scripts named logs_* run with Ray's log deduplication on, and their worker lines are
# also kept in NAME.driver-lines (clean_output.py --driver-lines).
# Re-record only after checking the new output by eye: a recording is the contract.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION="${RAY_VERSION:-2.60.0}"
RAY_VENV="${RAY_VENV:-bench/.ray-venv}"
case "$RAY_VENV" in /*) ;; *) RAY_VENV="$PWD/$RAY_VENV" ;; esac
compat=python-sdk/tests/compat
if [ ! -x "$RAY_VENV/bin/python" ]; then
    python3 -m venv "$RAY_VENV"
    "$RAY_VENV/bin/python" -m pip install -q "ray[data,serve]==$RAY_VERSION" numpy torch pillow pydantic
fi
have=$("$RAY_VENV/bin/python" -c 'import ray; print(ray.__version__)')
if [ "$have" != "$RAY_VERSION" ]; then
    echo "record-compat: $RAY_VENV has ray $have, not $RAY_VERSION (set RAY_VENV or RAY_VERSION)" >&2
    exit 1
fi
"$RAY_VENV/bin/python" -c "import torch" 2>/dev/null ||
    "$RAY_VENV/bin/python" -m pip install -q torch
# The data_* scripts: Ray Data's extra (pandas, pyarrow), Pillow for read_images,
# pydantic for iter_torch_batches (it imports ray.train).
"$RAY_VENV/bin/python" -c "import ray.data, pandas, pyarrow, PIL, pydantic" 2>/dev/null ||
    "$RAY_VENV/bin/python" -m pip install -q "ray[data]==$RAY_VERSION" pillow pydantic
# Ray Serve's scripts need ray[serve] (fastapi, starlette, uvicorn, requests).
"$RAY_VENV/bin/python" -c "import ray.serve, fastapi, requests" 2>/dev/null ||
    "$RAY_VENV/bin/python" -m pip install -q "ray[serve]==$RAY_VERSION"

if [ $# -eq 0 ]; then
    set -- $(ls "$compat"/*.py | xargs -n1 basename | sed 's/\.py$//' | grep -v '^clean_output$')
fi
ray_python="$RAY_VENV/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for name in "$@"; do
    script="$compat/$name.py"
    [ -f "$script" ] || { echo "record-compat: no script $script" >&2; exit 1; }
    mkdir -p "$work/$name/home"
    # logs_* scripts are about the driver's worker lines: Ray's deduplication stays on
    # and the lines are kept (colours dropped, pids written pid=N) in NAME.driver-lines.
    dedup=0
    case "$name" in logs_*) dedup=1 ;; esac
    if (cd "$compat" && env -u RAY_ADDRESS HOME="$work/$name/home" RAY_DEDUP_LOGS=$dedup \
            RAY_USAGE_STATS_ENABLED=0 timeout 300 "$ray_python" "$name.py") \
            >"$work/$name/out" 2>"$work/$name/err"; then
        python3 "$compat/clean_output.py" <"$work/$name/out" >"$compat/$name.expected"
        if [ "$dedup" = 1 ]; then
            python3 "$compat/clean_output.py" --driver-lines <"$work/$name/out" \
                >"$compat/$name.driver-lines"
        fi
        echo "recorded $name ($(wc -l <"$compat/$name.expected") lines)"
    else
        echo "FAILED   $name under Ray (exit $?); stdout and stderr tails:" >&2
        tail -n 20 "$work/$name/out" "$work/$name/err" >&2
        status=1
    fi
done
exit $status
