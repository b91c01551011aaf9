#!/usr/bin/env bash
# Builds the Python package (python-sdk/, the `tpuray` wheel with its Rust
# extension) into a virtual environment of the tests' own, .venv-test
# (TPURAY_TEST_VENV names another), and runs its pytest suite. It never touches
# .venv, where scripts/demo.sh installs the release build that the demo and the
# benchmarks use (a debug build there would be measured as tpuray's).
# Needs only Python >= 3.9 with venv and pip, and cargo; maturin and pytest
# come from PyPI. Arguments go to pytest.
#
# The extension is built with cargo's dev profile into python-sdk/target,
# which later runs reuse (set MATURIN_PEP517_ARGS= to build the release
# wheel instead, as a plain `pip install ./python-sdk` does).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${TPURAY_TEST_VENV:-.venv-test}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
# maturin's build hook runs `maturin` from PATH.
export PATH="$venv/bin:$PATH"
# prometheus_client: its text parser reads /metrics in test_metrics.py. uv: the installer
# of runtime_env['uv'], found beside the interpreter (tests/test_runtime_env.py). pandas,
# pyarrow, tqdm, pillow: tpuray.data (its `data` extra; pillow for read_images).
# kubernetes-validate and yamllint: tests/tests/k8s.rs checks deploy/k8s/examples with them
# (scripts/test.sh). fastapi, starlette, uvicorn, requests, pyyaml: tpuray.serve (its
# `serve` extra).
"$venv/bin/python" -m pip install -q "maturin>=1.7,<2" pytest "cloudpickle>=2.2" numpy pyarrow pandas tqdm pillow selenium prometheus_client uv "kubernetes-validate==1.37.0" "yamllint>=1.35,<2" fastapi starlette uvicorn requests pyyaml "mypy>=2.4,<3"
# The dashboard's browser tests (tests/test_dashboard.py) drive Debian's chromium through
# its chromedriver (selenium never downloads a browser or a driver here).
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
    else
        echo "python-tests.sh: the dashboard's browser tests need chromium and chromium-driver (run as root, or apt-get install chromium chromium-driver)" >&2
    fi
fi
"$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/python" -m pip install -q torch
# Ray 2.60's own job client (`ray job ...`, `ray.job_submission`) for test_jobs.py, which
# drives tpuray's Jobs REST API with it; in a venv of its own, so Ray never shadows
# tpuray in .venv (RAY_CLIENT_VENV names another).
ray_venv="${RAY_CLIENT_VENV:-.ray-client-venv}"
if [ ! -x "$ray_venv/bin/ray" ]; then
    "${PYTHON:-python3}" -m venv "$ray_venv"
fi
# ray[serve]: test_serve.py runs Ray's own `serve deploy`/`serve status` and its schema
# models against tpuray's Serve REST API.
"$ray_venv/bin/python" -c "import ray.serve, starlette, fastapi" 2>/dev/null ||
    "$ray_venv/bin/python" -m pip install -q "ray[default,serve]==2.60.0"
# No build isolation: use the maturin installed above rather than fetching a
# fresh one into a throw-away environment on every run.
MATURIN_PEP517_ARGS="${MATURIN_PEP517_ARGS---profile dev}" \
    "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps --force-reinstall ./python-sdk
"$venv/bin/python" -m pytest python-sdk/tests -q "$@"
