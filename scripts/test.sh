#!/usr/bin/env bash
# Sets up and runs every test: formatting, lints, unit tests, the
# integration tests that start real head and node-agent processes on
# loopback, and the Python package's tests (scripts/python-tests.sh).
# Needs only cargo and Python 3 with pip (cargo-nextest is used when installed).
set -euo pipefail
cd "$(dirname "$0")/.."

# The multi-host tests (tests/tests/hosts.rs) need ip, nsenter and nft.
if ! command -v ip >/dev/null || ! command -v nsenter >/dev/null || ! command -v nft >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq iproute2 util-linux nftables
    else
        echo "test.sh: the multi-host tests need root and ip, nsenter, nft (apt-get install iproute2 util-linux nftables)" >&2
    fi
fi

# test_metrics.py scrapes the cluster with a real Prometheus (Debian's package).
if ! command -v prometheus >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }
    else
        echo "test.sh: the metrics test needs Debian's prometheus (apt-get install prometheus)" >&2
    fi
fi

cargo fmt --all -- --check
# The Python extension is a workspace of its own (python-sdk/Cargo.toml).
(cd python-sdk && cargo fmt -- --check)
cargo clippy --workspace --all-targets -- -D warnings
# The autoscaler's kubernetes provider (the kube client) is behind a feature: lint it too.
cargo clippy -p tpuray-cli --features kubernetes --all-targets -- -D warnings
# The tests' own virtual environment (scripts/python-tests.sh builds the package into
# it); .venv, where the demo installs its release build, is never touched.
export TPURAY_TEST_VENV="${TPURAY_TEST_VENV:-$PWD/.venv-test}"
# tests/tests/k8s.rs checks the rendered Kubernetes examples with kubernetes-validate
# (offline, against the schemas it bundles) and yamllint, both from PyPI into the test
# venv (scripts/python-tests.sh installs them there too).
if [ ! -x "$TPURAY_TEST_VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$TPURAY_TEST_VENV"
fi
"$TPURAY_TEST_VENV/bin/python" -m pip install -q "kubernetes-validate==1.37.0" "yamllint>=1.35,<2"
# The integration tests run the real `tpuray` binary.
cargo build -p tpuray-cli
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast
else
    cargo test --workspace --no-fail-fast
fi
# The Python package: builds the wheel's extension and runs pytest.
./scripts/python-tests.sh
