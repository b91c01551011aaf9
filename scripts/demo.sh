#!/usr/bin/env bash
# Builds tpuray and runs the demo on a local three-node cluster: a head node
# and two worker nodes (one with a custom "special" resource); the Rust
# examples join as jobs (cluster_info prints the cluster; tour runs remote
# functions, refs between tasks, nested tasks, an ordered actor, a task on
# the `special` node, 10,000 tasks, a 50 MB result read on another node and
# a streaming generator); then `tpuray status` and `tpuray list`, and stops
# everything it started. Needs only cargo (and a C compiler for libc).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p tpuray-cli -p tpuray-examples
export PATH="${CARGO_TARGET_DIR:-$PWD/target}/release:$PATH"

# A private registry and port, so the demo never touches another cluster.
export TPURAY_REGISTRY_DIR="${TPURAY_REGISTRY_DIR:-$(mktemp -d /tmp/tpuray-demo-registry.XXXXXX)}"
PORT="${TPURAY_DEMO_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 6390)}"
TMP="$(mktemp -d /tmp/tpuray-demo.XXXXXX)"
trap 'tpuray stop >/dev/null 2>&1 || true; rm -rf "$TMP"' EXIT

echo "== tpuray start --head"
tpuray start --head --port "$PORT" --num-cpus 1 --temp-dir "$TMP/head"
echo "== tpuray start --address (two worker nodes)"
tpuray start --address "127.0.0.1:$PORT" --num-cpus 2 --temp-dir "$TMP/n1"
tpuray start --address "127.0.0.1:$PORT" --num-cpus 2 --resources '{"special": 1}' --labels zone=b --temp-dir "$TMP/n2"
echo "== Rust example: cluster_info"
cluster_info
echo "== Rust example: tour"
tour
echo "== tpuray status"
sleep 2  # nodes report usage in their heartbeats, once a second
tpuray status
echo "== tpuray list nodes"
tpuray list nodes
echo "== tpuray list jobs"
tpuray list jobs
echo "== tpuray list actors"
tpuray list actors
echo "== tpuray list tasks --limit 5"
tpuray list tasks --limit 5
echo "== tpuray stop"
tpuray stop
