#!/usr/bin/env python3
"""Ray's `ray microbenchmark` against `tpuray microbenchmark` (Python SDK) and
`tpuray microbenchmark --rust` (Rust SDK) on this machine: the three run
interleaved for ROUNDS rounds (Ray, tpuray Python, tpuray Rust, Ray, ...), and a
table gives each case's median over the rounds and the ratios tpuray / Ray, then
the floor (an empty tonic unary round trip on loopback, a raw 64-byte loopback TCP
round trip, memcpy GB/s) that the tpuray runs measure.

    bench/compare.py                 # 3 rounds, every case (about an hour on 2 cores)
    bench/compare.py --quick         # 1 round, 7 cheap cases, short trials
    bench/compare.py --rounds 1 --warmup-sleep 1
    bench/compare.py --skip-ray --tls --cases '1:1 actor calls sync|single client tasks sync'

Ray comes from PyPI into its own virtual environment (RAY_VENV, default
bench/.ray-venv, `ray==RAY_VERSION`, default 2.60.0). tpuray is a release build of
python-sdk/ in TPURAY_VENV (default bench/.tpuray-venv; built with `pip install
./python-sdk` when missing, several minutes the first time); both tpuray runs use
its `python -m tpuray` (the Rust cases' workers are then `python -m tpuray
_worker`; pass --tpuray-cli target/release/tpuray for the native CLI).

Ray's cases run through `ray._private.ray_perf.main()`, the function behind
`ray microbenchmark`, with its Ray Client cases left out (tpuray has none) and
Ray's 10 s idle pause before each case set by --warmup-sleep (the same for all
three). Every run's output is kept in a folder printed at the end.

--tls runs the tpuray clusters with mutual TLS (README "Mutual TLS"): a throwaway CA
and a certificate for this machine are made with `tpuray tls make-ca/make-cert` in the
output folder and given to every tpuray process as TPURAY_TLS_CERT, TPURAY_TLS_KEY and
TPURAY_TLS_CA (the Ray column is unchanged: Ray runs without TLS).

--baseline-venv DIR compares two tpuray builds: DIR is another release build's venv (say
of an earlier commit: `python3 -m venv DIR && DIR/bin/pip install maturin cloudpickle
numpy && DIR/bin/pip install --no-build-isolation --no-deps ./python-sdk` in that
checkout). Its Python and Rust runs are interleaved with the others in every round,
and a second table gives each case's median for both builds and the ratio new / base,
marking a case more than 10% below the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(?P<name>.+?) per second (?P<mean>[-+0-9.e]+) \+- (?P<sd>[-+0-9.e]+)\s*$")

# Ray's cases, in ray_perf.py's order.
CASES = [
    "single client get calls (Plasma Store)",
    "single client put calls (Plasma Store)",
    "multi client put calls (Plasma Store)",
    "single client put gigabytes",
    "single client tasks and get batch",
    "multi client put gigabytes",
    "single client get object containing 10k refs",
    "single client wait 1k refs",
    "single client tasks sync",
    "single client tasks async",
    "multi client tasks async",
    "1:1 actor calls sync",
    "1:1 actor calls async",
    "1:1 actor calls concurrent",
    "1:n actor calls async",
    "n:n actor calls async",
    "n:n actor calls with arg async",
    "1:1 async-actor calls sync",
    "1:1 async-actor calls async",
    "1:1 async-actor calls with args async",
    "1:n async-actor calls async",
    "n:n async-actor calls async",
    "placement group create/removal",
]
QUICK_CASES = [
    "single client get calls (Plasma Store)",
    "single client put calls (Plasma Store)",
    "single client tasks sync",
    "single client tasks async",
    "1:1 actor calls sync",
    "1:1 actor calls async",
    "placement group create/removal",
]

# Runs Ray's microbenchmark main with the idle pause and case selection set from the
# environment; with CMP_TRIALS/CMP_TRIAL_S, a copy of Ray's timeit with shorter trials.
RAY_WRAPPER = r"""
import json, os, time
import numpy as np
import ray._private.ray_perf as perf
import ray._private.ray_microbenchmark_helpers as helpers

pause = float(os.environ["CMP_WARMUP_S"])
cases = json.loads(os.environ["CMP_CASES"])
trials = os.environ.get("CMP_TRIALS")
trial_s = float(os.environ.get("CMP_TRIAL_S", "2"))
ray_timeit = helpers.timeit

def short_timeit(name, fn, multiplier=1):
    time.sleep(pause)
    start = time.perf_counter(); count = 0
    while time.perf_counter() - start < 1:
        fn(); count += 1
    step = count // 10 + 1
    stats = []
    for _ in range(int(trials)):
        start = time.perf_counter(); count = 0
        while time.perf_counter() - start < trial_s:
            for _ in range(step):
                fn()
            count += step
        stats.append(multiplier * count / (time.perf_counter() - start))
    mean, sd = np.mean(stats), np.std(stats)
    print(name, "per second", round(mean, 2), "+-", round(sd, 2), flush=True)
    return [(name, mean, sd)]

def timeit(name, fn, multiplier=1, warmup_time_sec=10):
    if cases and name not in cases:
        return [None]
    if trials:
        return short_timeit(name, fn, multiplier)
    return ray_timeit(name, fn, multiplier, warmup_time_sec=pause)

perf.timeit = timeit
perf.client_microbenchmark_main = lambda results: results
perf.main()
"""


def ensure_ray(venv: Path, version: str) -> Path:
    py = venv / "bin" / "python"
    ready = py.exists() and subprocess.run(
        [str(py), "-c", "import ray, numpy"], capture_output=True).returncode == 0
    if not ready:  # missing, or left half-made by an interrupted install
        print(f"creating {venv} with ray=={version} from PyPI", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # grpcio: ray_perf imports Ray Client's helpers, which need it, and plain `ray`
        # does not depend on it.
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"ray=={version}", "numpy",
                        "grpcio"], check=True)
    return py


def ensure_tpuray(venv: Path) -> Path:
    # Absolute: pip runs maturin from another folder, so a relative PATH entry misses it.
    venv = venv.absolute()
    py = venv / "bin" / "python"
    ready = py.exists() and subprocess.run(
        [str(py), "-c", "import tpuray._tpuray"], capture_output=True).returncode == 0
    if not ready:  # missing, or left half-made by a failed build
        print(f"creating {venv} with a release build of python-sdk/", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "maturin>=1.7,<2", "cloudpickle>=2.2", "numpy"],
            check=True,
        )
        env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
        env.pop("MATURIN_PEP517_ARGS", None)
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
             "--force-reinstall", str(ROOT / "python-sdk")],
            check=True,
            env=env,
        )
    return py


def require_optimized(py: str | Path, what: str) -> None:
    """Exit (status 2, with tpuray's message) when the tpuray that interpreter ``py``
    imports is a debug build, unless TPURAY_ALLOW_DEBUG_BUILD=1
    (``tpuray._private.build.require_optimized_build``)."""
    r = subprocess.run(
        [str(py), "-c",
         f"from tpuray._private.build import require_optimized_build as r; r({what!r})"],
        stderr=subprocess.PIPE, text=True,
    )
    if r.stderr:
        print(r.stderr.rstrip(), file=sys.stderr)
    if r.returncode != 0:
        sys.exit(2)


def parse(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Case name -> mean, and case name -> why it was skipped, from text or JSON lines."""
    means, skipped = {}, {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if "skipped" in o:
                skipped[o["name"]] = o["skipped"]
            elif "mean" in o:
                means[o["name"]] = float(o["mean"])
            continue
        m = LINE.match(line)
        if m:
            means[m["name"]] = float(m["mean"])
        elif " skipped: " in line:
            name, why = line.split(" skipped: ", 1)
            skipped[name] = why
    return means, skipped


def run(label: str, argv: list[str], env: dict, out: Path, timeout: float) -> str:
    shown = " ".join(a if len(a) < 80 else "<ray_perf wrapper>" for a in argv)
    print(f"  {label}: {shown}", file=sys.stderr, flush=True)
    t = time.time()
    with open(out, "w") as f:
        try:
            p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=f, text=True,
                               timeout=timeout)
            text = p.stdout
            if p.returncode != 0:
                print(f"  {label} exited with {p.returncode} (stderr in {out})", file=sys.stderr)
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            print(f"  {label} timed out after {timeout:.0f} s", file=sys.stderr)
        f.write("\n--- stdout ---\n" + text)
    print(f"  {label}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return text


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="1 round of 7 cheap cases, no idle pause, one 0.5 s trial each")
    ap.add_argument("--warmup-sleep", type=float, default=None,
                    help="idle seconds before each case, all three runs (default 10 as Ray's; 0 with --quick)")
    ap.add_argument("--cases", default=None, help="only these cases, '|'-separated names")
    ap.add_argument("--ray-venv", default=os.environ.get("RAY_VENV", str(ROOT / "bench/.ray-venv")))
    ap.add_argument("--ray-version", default=os.environ.get("RAY_VERSION", "2.60.0"))
    ap.add_argument("--tpuray-venv", default=os.environ.get("TPURAY_VENV", str(ROOT / "bench/.tpuray-venv")))
    ap.add_argument("--tpuray-cli", default=None,
                    help="the tpuray CLI for the --rust run (default: the venv's python -m tpuray)")
    ap.add_argument("--skip-ray", action="store_true", help="tpuray runs only (no Ray column)")
    ap.add_argument("--baseline-venv", default=None,
                    help="a second tpuray release build's venv to compare against, run interleaved")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--tls", action="store_true",
                    help="run tpuray with mutual TLS (a throwaway CA and certificate)")
    a = ap.parse_args()
    rounds = a.rounds or (1 if a.quick else 3)
    pause = a.warmup_sleep if a.warmup_sleep is not None else (0.0 if a.quick else 10.0)
    cases = a.cases.split("|") if a.cases else (QUICK_CASES if a.quick else [])
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"compare.py: --cases: no case named {', '.join(map(repr, unknown))} "
                 f"(expected whole names from Ray's list: {', '.join(CASES)})")

    ray_py = None if a.skip_ray else ensure_ray(Path(a.ray_venv), a.ray_version)
    tp_py = ensure_tpuray(Path(a.tpuray_venv))
    require_optimized(tp_py, "bench/compare.py")
    tpuray = [a.tpuray_cli] if a.tpuray_cli else [str(tp_py), "-m", "tpuray"]
    base_py = None
    if a.baseline_venv:
        base_py = Path(a.baseline_venv).absolute() / "bin" / "python"
        if not base_py.exists():
            sys.exit(f"compare.py: --baseline-venv {a.baseline_venv}: no bin/python there "
                     "(expected a venv with a release build of tpuray)")
        require_optimized(base_py, "bench/compare.py --baseline-venv")
    base = [str(base_py), "-m", "tpuray"] if base_py else []
    common = ["--json", "--warmup-sleep", str(pause)]
    if a.quick:
        common += ["--trials", "1", "--trial-seconds", "0.5"]
    if cases:
        common += ["--filter", "|".join(cases)]

    env = dict(os.environ)
    for k in ("RAY_ADDRESS", "TPURAY_ADDRESS", "TESTS_TO_RUN", "TESTS_TO_SKIP"):
        env.pop(k, None)
    ray_env = dict(env, CMP_WARMUP_S=str(pause), CMP_CASES=json.dumps(cases),
                   RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0")
    if a.quick:
        ray_env.update(CMP_TRIALS="1", CMP_TRIAL_S="0.5")

    outdir = Path(tempfile.mkdtemp(prefix="tpuray-compare-"))
    if a.tls:
        for args in (["tls", "make-ca", "--out", str(outdir / "ca")],
                     ["tls", "make-cert", "--ca", str(outdir / "ca"), "--host", "localhost",
                      "--out", str(outdir / "cert")]):
            subprocess.run(tpuray + args, env=env, check=True, stdout=subprocess.DEVNULL)
        env = dict(env, TPURAY_TLS_CERT=str(outdir / "cert" / "cert.pem"),
                   TPURAY_TLS_KEY=str(outdir / "cert" / "key.pem"),
                   TPURAY_TLS_CA=str(outdir / "ca" / "ca.pem"))
    keys = ("ray", "py", "rust", "base-py", "base-rust")
    results: dict[str, dict[str, list[float]]] = {k: {} for k in keys}
    skipped: dict[str, dict[str, str]] = {k: {} for k in keys}
    for r in range(1, rounds + 1):
        print(f"round {r}/{rounds}", file=sys.stderr, flush=True)
        runs = [
            ("py", tpuray + ["microbenchmark", "--python", str(tp_py)] + common, env),
            ("rust", tpuray + ["microbenchmark", "--rust"] + common, env),
        ]
        if base_py:
            # Interleaved: each build's run of a kind right after the other's.
            runs.insert(0, ("base-py", base + ["microbenchmark", "--python", str(base_py)] + common, env))
            runs.insert(2, ("base-rust", base + ["microbenchmark", "--rust"] + common, env))
        if ray_py:
            runs.insert(0, ("ray", [str(ray_py), "-c", RAY_WRAPPER], ray_env))
        for key, argv, e in runs:
            text = run(key, argv, e, outdir / f"{key}-{r}.log", a.timeout)
            means, skip = parse(text)
            for name, v in means.items():
                results[key].setdefault(name, []).append(v)
            skipped[key].update(skip)

    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in results.items()}
    names = [c for c in CASES if not cases or c in cases]
    w = max(len(n) for n in names) + 2
    print(f"\nmedians of {rounds} round(s), operations per second (Ray {a.ray_version}; "
          f"idle pause {pause:g} s; {os.cpu_count()} CPUs"
          f"{'; tpuray with mutual TLS' if a.tls else ''})\n")
    head = f"{'case':<{w}}{'Ray':>12}{'tpuray (Python)':>17}{'tpuray (Rust)':>15}{'Py/Ray':>8}{'Rust/Ray':>10}"
    print(head)
    print("-" * len(head))
    for n in names:
        ray_v, py_v, rs_v = med["ray"].get(n), med["py"].get(n), med["rust"].get(n)
        rs = fmt(rs_v) if rs_v is not None or n not in skipped["rust"] else "skipped"
        py = fmt(py_v) if py_v is not None or n not in skipped["py"] else "skipped"
        print(f"{n:<{w}}{fmt(ray_v):>12}{py:>17}{rs:>15}{ratio(py_v, ray_v):>8}{ratio(rs_v, ray_v):>10}")
    print()
    for key, label in (("py", "Python run"), ("rust", "Rust run")):
        for name, v in sorted(med[key].items()):
            if name.startswith("floor:"):
                unit = " (GB/s)" if "memcpy" in name else f" per second ({1e6 / v:.1f} us each)"
                print(f"{name} [{label}]: {fmt(v)}{unit}")
    for key, label in (("py", "tpuray (Python)"), ("rust", "tpuray (Rust)")):
        for name, why in skipped[key].items():
            print(f"skipped in {label}: {name}: {why}")
    if base_py:
        print(f"\nthis build against the baseline ({a.baseline_venv}), medians of {rounds} "
              "round(s), operations per second; '<' marks a case more than 10% below\n")
        head = (f"{'case':<{w}}{'base Py':>12}{'Python':>12}{'new/base':>9}"
                f"{'base Rust':>12}{'Rust':>12}{'new/base':>9}")
        print(head)
        print("-" * len(head))
        for n in names:
            cols = ""
            for k in ("py", "rust"):
                b, v = med[f"base-{k}"].get(n), med[k].get(n)
                mark = "<" if b and v is not None and v < 0.9 * b else " "
                cols += f"{fmt(b):>12}{fmt(v):>12}{ratio(v, b):>8}{mark}"
            print(f"{n:<{w}}{cols}")
    print(f"\nrun outputs: {outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
