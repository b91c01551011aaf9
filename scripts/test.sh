#!/usr/bin/env bash
# Sets up and runs every test: formatting, lints, unit tests, and the
# integration tests that start real head and node-agent processes on
# loopback. Needs only cargo (cargo-nextest is used when installed).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The integration tests run the real `tpuray` binary.
cargo build -p tpuray-cli
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast
else
    cargo test --workspace --no-fail-fast
fi
