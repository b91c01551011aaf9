#!/usr/bin/env bash
# Where a sync call's time goes (issue 35): the Rust SDK's sync task and sync actor call
# (`core_bench`, ROUNDS (default 40) x 500 tasks or 1,000 calls) against a local one-node cluster,
# over gRPC alone (TPURAY_DIRECT_CALLS=0) and with direct calls (CORE-15): the whole
# machine's busy CPU time and context switches per call (/proc/stat before and after,
# less what a run without calls costs), and `perf record -a -g` (CPU samples by process,
# thread and symbol).
#
#   cargo build --release -p tpuray-cli -p tpuray-examples
#   bench/sync_profile.sh [OUT_DIR]       # default: a new folder under /tmp
#
# Needs perf (Debian: linux-perf) and root or kernel.perf_event_paranoid <= 0. Run on a
# quiet machine: every process's CPU counts (it warns when the load average says
# otherwise). Prints a table of µs of CPU and context switches per call, and keeps each
# `perf report` in OUT_DIR. Its cluster (4 CPUs) is its own: registry, sessions and token
# under OUT_DIR. calls/s is core_bench's, not the microbenchmark's (another harness).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
OUT=${1:-$(mktemp -d /tmp/sync-profile.XXXXXX)}
ROUNDS=${ROUNDS:-40}
# Busy CPU seconds and context switches of the whole machine so far.
counters() {
    python3 -c '
import os
hz = os.sysconf("SC_CLK_TCK")
for line in open("/proc/stat"):
    f = line.split()
    if f[0] == "cpu":
        busy = sum(int(x) for x in f[1:4] + f[6:9]) / hz
    elif f[0] == "ctxt":
        ctxt = int(f[1])
print(busy, ctxt)'
}
# Runs core_bench (env as given) and writes "<busy s> <switches>" it cost to $OUT/$1.stat.
measure() {
    local tag=$1; shift
    read -r b0 c0 < <(counters)
    env "$@" "$BIN/core_bench" "127.0.0.1:$PORT" >"$OUT/$tag.out" 2>&1
    read -r b1 c1 < <(counters)
    python3 -c "print($b1 - $b0, $c1 - $c0)" >"$OUT/$tag.stat"
}
mkdir -p "$OUT"
command -v perf >/dev/null || { echo "sync_profile.sh: perf is not installed (apt install linux-perf)" >&2; exit 2; }
for b in tpuray core_bench; do
    [ -x "$BIN/$b" ] || { echo "sync_profile.sh: $BIN/$b is missing: cargo build --release -p tpuray-cli -p tpuray-examples" >&2; exit 2; }
done
# A cluster of its own: its registry (what `tpuray stop` stops), session files and token
# all under OUT, so other clusters on the machine are left alone.
export HOME="$OUT/home" TPURAY_REGISTRY_DIR="$OUT/registry" TPURAY_TEMP_DIR="$OUT/tmp"
mkdir -p "$HOME" "$TPURAY_REGISTRY_DIR" "$TPURAY_TEMP_DIR"
load=$(cut -d' ' -f1 /proc/loadavg)
if python3 -c "import sys; sys.exit(0 if $load > 0.5 else 1)"; then
    echo "sync_profile.sh: warning: load average $load: other work shares the machine, and its CPU counts in every figure here" >&2
fi
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN/tpuray" start --head --port "$PORT" --node-ip-address 127.0.0.1 --dashboard-port 0 --num-cpus 4 >"$OUT/start.log" 2>&1
trap '"$BIN/tpuray" stop >/dev/null 2>&1 || true' EXIT
# What a run costs without its calls (start, first task, the actor's creation, exit):
# taken off each case's counts.
for mode in grpc direct; do
    direct=1; [ "$mode" = grpc ] && direct=0
    measure "fixed.$mode" TPURAY_DIRECT_CALLS=$direct ONLY="(no case)"
done
printf '%-26s %-7s %10s %12s %14s\n' case path calls/s "CPU us/call" "switches/call"
for case in "single client tasks sync:500" "1:1 actor calls sync:1000"; do
    name=${case%:*}; per=${case##*:}
    for mode in grpc direct; do
        direct=1; [ "$mode" = grpc ] && direct=0
        tag="${name// /-}.$mode"
        measure "$tag" TPURAY_DIRECT_CALLS=$direct ONLY="$name" ROUNDS=$ROUNDS
        TPURAY_DIRECT_CALLS=$direct ONLY="$name" ROUNDS=$ROUNDS perf record -q -a -g \
            -o "$OUT/$tag.data" "$BIN/core_bench" "127.0.0.1:$PORT" >/dev/null 2>&1
        perf report -i "$OUT/$tag.data" --no-children --sort comm,dso,sym --stdio \
            >"$OUT/$tag.report" 2>/dev/null || true
        perf report -i "$OUT/$tag.data" --no-children --sort comm --stdio -g none \
            >"$OUT/$tag.bycomm" 2>/dev/null || true
        calls=$((ROUNDS * per))
        rate=$(grep "^$name per second" "$OUT/$tag.out" | awk '{print $(NF-2)}')
        read -r cpu sw <"$OUT/$tag.stat"; read -r cpu0 sw0 <"$OUT/fixed.$mode.stat"
        python3 -c "print('%-26s %-7s %10s %12.1f %14.1f' % ('$name', '$mode', '$rate', ($cpu-$cpu0)*1e6/$calls, ($sw-$sw0)/$calls))"
    done
done
echo "reports: $OUT/*.report (by thread name, library, symbol) and $OUT/*.bycomm (by thread name; threads of one name in several processes add up)"
