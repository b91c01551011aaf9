#!/usr/bin/env bash
# Runs the Ray Core tutorial-style scripts of examples/ray_compat/ twice: under Ray
# (installed from PyPI into its own virtual environment; `import tpuray as ray` is
# pointed at Ray by examples/ray_compat/ray_shim) and under tpuray (the .venv that
# ./scripts/python-tests.sh builds), and shows where their output differs.
#
#   bench/ray_compat.sh            # every script
#   bench/ray_compat.sh 02_actors  # one
#
# RAY_VENV (default bench/.ray-venv) is created with `pip install ray==$RAY_VERSION`
# (default 2.60.0) when it does not exist. Exits 0 when every output matches.
set -uo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION="${RAY_VERSION:-2.60.0}"
RAY_VENV="${RAY_VENV:-bench/.ray-venv}"
if [ ! -x "$RAY_VENV/bin/python" ]; then
    python3 -m venv "$RAY_VENV"
    "$RAY_VENV/bin/python" -m pip install -q "ray==$RAY_VERSION"
fi
# tpuray: the release build scripts/demo.sh installs into .venv (made here when missing).
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/python -m pip install -q "maturin>=1.7,<2" "cloudpickle>=2.2"
    PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install -q --no-build-isolation --no-deps ./python-sdk
fi
out=$(mktemp -d)
status=0
for script in examples/ray_compat/${1:-*}.py; do
    name=$(basename "$script" .py)
    PYTHONPATH="$PWD/examples/ray_compat/ray_shim" RAY_DEDUP_LOGS=0 \
        timeout 300 "$RAY_VENV/bin/python" "$script" >"$out/$name.ray" 2>"$out/$name.ray.err"
    timeout 300 .venv/bin/python "$script" >"$out/$name.tpuray" 2>"$out/$name.tpuray.err"
    # Ray's raylet also reports retried failures on the driver's stdout; those lines
    # (and their colour codes) are Ray's diagnostics, not the script's output.
    sed -i -e 's/\x1b\[[0-9;]*m//g' "$out/$name.ray"
    awk '/^\(raylet\)/{skip=1; next} skip && /^(ray::|  |[A-Za-z]+Error:|Traceback)/{next} {skip=0; print}' \
        "$out/$name.ray" >"$out/$name.ray.clean" && mv "$out/$name.ray.clean" "$out/$name.ray"
    if diff -u "$out/$name.ray" "$out/$name.tpuray" >"$out/$name.diff"; then
        echo "same   $name ($(wc -l <"$out/$name.ray") lines)"
    else
        echo "DIFFER $name"
        cat "$out/$name.diff"
        status=1
    fi
done
echo "outputs kept in $out"
exit $status
