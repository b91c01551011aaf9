#!/usr/bin/env bash
# Start-up time of `tpuray start --head` (returns once the head accepts
# registrations and the head node's agent has registered) and of a node agent
# joining (`tpuray start --address`, returns once registered), over ROUNDS
# rounds; prints each round and the medians. With RAY=/path/to/ray set, times
# `ray start --head` and `ray start --address` the same way, for comparison.
#
#   bench/startup.sh            # tpuray only
#   RAY=/tmp/rayvenv/bin/ray bench/startup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-5}"
# Cargo's progress goes to stderr; a failed build stops the script (set -e).
cargo build --release -p tpuray-cli >&2
T="${CARGO_TARGET_DIR:-$PWD/target}/release/tpuray"
export TPURAY_REGISTRY_DIR="$(mktemp -d /tmp/tpuray-bench-reg.XXXXXX)"
TMP="$(mktemp -d /tmp/tpuray-bench.XXXXXX)"
# A free port, not a fixed one that another cluster may hold.
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# Whatever happens, nothing this script started is left running.
cleanup() {
    "$T" stop --force >/dev/null 2>&1 || true
    if [ -n "${RAY:-}" ]; then "$RAY" stop --force >/dev/null 2>&1 || true; fi
    }
trap cleanup EXIT

ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

heads=(); joins=()
for i in $(seq "$ROUNDS"); do
    t0=$(date +%s%N); "$T" start --head --node-ip-address 127.0.0.1 --port "$PORT" --num-cpus 1 --temp-dir "$TMP/h$i" >/dev/null; h=$(ms "$t0")
    t0=$(date +%s%N); "$T" start --address "127.0.0.1:$PORT" --num-cpus 1 --temp-dir "$TMP/n$i" >/dev/null; j=$(ms "$t0")
    "$T" stop >/dev/null
    echo "tpuray round $i: start --head ${h} ms, node join ${j} ms"
    heads+=("$h"); joins+=("$j")
done
echo "tpuray median: start --head $(printf '%s\n' "${heads[@]}" | median) ms, node join $(printf '%s\n' "${joins[@]}" | median) ms"

if [ -n "${RAY:-}" ]; then
    rheads=(); rjoins=()
    for i in $(seq "$ROUNDS"); do
        t0=$(date +%s%N); "$RAY" start --head --node-ip-address 127.0.0.1 --port "$PORT" --num-cpus 1 --disable-usage-stats >/dev/null 2>&1 || { echo "ray start --head failed"; exit 1; }; h=$(ms "$t0")
        t0=$(date +%s%N); "$RAY" start --address "127.0.0.1:$PORT" --node-ip-address 127.0.0.1 --num-cpus 1 >/dev/null 2>&1 || { echo "ray start --address failed"; exit 1; }; j=$(ms "$t0")
        "$RAY" stop --force >/dev/null 2>&1 || true
        echo "ray round $i: start --head ${h} ms, node join ${j} ms"
        rheads+=("$h"); rjoins+=("$j")
    done
    echo "ray median: start --head $(printf '%s\n' "${rheads[@]}" | median) ms, node join $(printf '%s\n' "${rjoins[@]}" | median) ms"
fi
rm -rf "$TPURAY_REGISTRY_DIR" "$TMP"
