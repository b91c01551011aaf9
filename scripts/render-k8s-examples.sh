#!/usr/bin/env bash
# Renders deploy/k8s/examples/*.yaml again from the command on each file's first line
# (`# tpuray k8s manifests ...`), with the tpuray on PATH (or $TPURAY). Run it after a
# change to `tpuray k8s manifests`; tests/tests/k8s.rs fails while an example is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${TPURAY:-tpuray}"
for f in deploy/k8s/examples/*.yaml; do
    cmd="$(head -n 1 "$f")"
    case "$cmd" in
        "# tpuray k8s manifests "*) ;;
        *) echo "$f: the first line is not '# tpuray k8s manifests ...'" >&2; exit 1 ;;
    esac
    args="${cmd#"# tpuray "}"
    # shellcheck disable=SC2086 # the arguments are words without quotes
    body="$("$bin" $args)"
    printf '%s\n%s\n' "$cmd" "$body" > "$f"
    echo "rendered $f"
done
