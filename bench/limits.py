#!/usr/bin/env python3
"""Single-node limits with real processes, tpuray against Ray on this machine in one run
(Ray's envelope is ray ``release/benchmarks/README.md``: on one node
1,000,000 queued tasks, 10,000 objects returned from one task, 10,000 objects in one
``get``):

- ``queued``: N tasks (default 1,000,000) queued from one driver behind a resource a
  sleeping task holds; the driver's resident memory per queued task (bytes; goal
  2 KiB at most) and the submission rate;
- ``returns``: one task with ``num_returns=10000``; seconds to ``get`` them all;
- ``get_refs``: 10,000 ``put`` objects in one ``get``; seconds;
- ``big``: one numpy array of ``--big-gib`` GiB (default 8) put into a store a quarter
  its size, so it is spilled, then ``get`` back and checked; seconds for each;
- ``actors``: 200 actors created at once (``num_cpus=0``) until each has answered one
  call; actors per second.

    bench/limits.py                          # every case, both systems
    bench/limits.py --cases returns,get_refs --systems tpuray
    bench/limits.py --queued 100000 --big-gib 1   # smaller

Interpreters as bench/scaling.py (RAY_VENV, TPURAY_VENV: release builds; a debug build
of tpuray is refused). Each case runs in a fresh child process per system, the systems
alternating; a table with the ratio tpuray / Ray (``x`` > 1: tpuray better) is printed
at the end and the figures are written to ``limits.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(system: str, case: str, arg: float) -> dict:
    if system == "tpuray":
        import tpuray as ray
        from tpuray._private.build import require_optimized_build

        require_optimized_build("bench/limits.py")
    else:
        import ray
    return CASES[case][0](ray, arg)


def _queued(ray, n: float) -> dict:
    n = int(n)
    ray.init(num_cpus=1, resources={"gate": 1})
    try:
        @ray.remote(num_cpus=0, resources={"gate": 1})
        def gated(seconds):
            time.sleep(seconds)

        holder = gated.remote(3600)
        ray.get([gated.options(resources={}).remote(0) for _ in range(10)])  # warm
        before = _rss_bytes()
        t = time.perf_counter()
        refs = [gated.remote(0) for _ in range(n)]
        submit = time.perf_counter() - t
        time.sleep(2.0)
        after = _rss_bytes()
        ready, _ = ray.wait([holder, refs[-1]], timeout=0)
        assert not ready, "the queue drained while measuring"
        return {"driver_bytes_per_queued_task": (after - before) / n,
                "submitted_per_s": n / submit}
    finally:
        ray.shutdown()


def _returns(ray, n: float) -> dict:
    n = int(n)
    ray.init(num_cpus=1)
    try:
        @ray.remote(num_returns=n)
        def many():
            return list(range(n))

        @ray.remote
        def warm():
            return 0

        ray.get(warm.remote())  # a worker up
        t = time.perf_counter()
        out = ray.get(many.remote())
        seconds = time.perf_counter() - t
        assert out == list(range(n))
        return {"seconds": seconds}
    finally:
        ray.shutdown()


def _get_refs(ray, n: float) -> dict:
    n = int(n)
    ray.init(num_cpus=1)
    try:
        refs = [ray.put(i) for i in range(n)]
        t = time.perf_counter()
        out = ray.get(refs)
        seconds = time.perf_counter() - t
        assert out == list(range(n))
        return {"seconds": seconds}
    finally:
        ray.shutdown()


def _big(ray, gib: float) -> dict:
    import numpy as np

    size = int(gib * GIB)
    ray.init(num_cpus=1, object_store_memory=max(size // 4, 256 << 20))
    try:
        arr = np.ones(size, dtype=np.uint8)
        arr[::4096] = 7
        t = time.perf_counter()
        ref = ray.put(arr)
        put_s = time.perf_counter() - t
        del arr
        filler = [ray.put(np.zeros(size // 8, dtype=np.uint8)) for _ in range(2)]  # push it out
        t = time.perf_counter()
        back = ray.get(ref)
        get_s = time.perf_counter() - t
        assert back.nbytes == size and int(back[4096]) == 7 and int(back[1]) == 1
        del back, filler
        return {"put_s": put_s, "get_s": get_s}
    finally:
        ray.shutdown()


def _actors(ray, n: float) -> dict:
    n = int(n)
    ray.init(num_cpus=2)
    try:
        @ray.remote(num_cpus=0)
        class A:
            def ping(self):
                return 1

        t = time.perf_counter()
        actors = [A.remote() for _ in range(n)]
        assert sum(ray.get([a.ping.remote() for a in actors], timeout=900)) == n
        seconds = time.perf_counter() - t
        return {"actors_per_s": n / seconds}
    finally:
        ray.shutdown()


# name -> (function, default argument, {metric: True when higher is better})
CASES = {
    "queued": (_queued, 1_000_000, {"driver_bytes_per_queued_task": False, "submitted_per_s": True}),
    "returns": (_returns, 10_000, {"seconds": False}),
    "get_refs": (_get_refs, 10_000, {"seconds": False}),
    "big": (_big, 8, {"put_s": False, "get_s": False}),
    "actors": (_actors, 200, {"actors_per_s": True}),
}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], float(sys.argv[4]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="tpuray,ray", help="comma-separated: tpuray, ray")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--queued", type=int, default=CASES["queued"][1],
                    help="tasks queued in the 'queued' case (default %(default)s)")
    ap.add_argument("--big-gib", type=float, default=CASES["big"][1],
                    help="GiB of the 'big' case's array (default %(default)s)")
    ap.add_argument("--actors", type=int, default=CASES["actors"][1],
                    help="actors created at once in the 'actors' case (default %(default)s)")
    ap.add_argument("--out", default=None, help="folder for limits.json (default: /tmp/...)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    a = ap.parse_args()
    systems = [s for s in a.systems.split(",") if s]
    if not systems or any(s not in ("tpuray", "ray") for s in systems):
        ap.error(f"--systems {a.systems!r}: expected tpuray, ray or both, comma-separated")
    cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases {', '.join(unknown)}: expected some of {', '.join(CASES)}")
    if a.queued < 1 or a.actors < 1 or a.big_gib <= 0:
        ap.error("--queued and --actors take a positive count, --big-gib a positive size")
    args = {"queued": a.queued, "returns": 10_000, "get_refs": 10_000, "big": a.big_gib,
            "actors": a.actors}
    sys.path.insert(0, str(ROOT / "bench"))
    import scaling

    pys = scaling._interpreters(systems)
    out = Path(a.out) if a.out else Path(
        subprocess.check_output(["mktemp", "-d", "/tmp/tpuray-limits.XXXXXX"], text=True).strip())
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for case in cases:
        results[case] = {}
        for system in systems:
            env = dict(os.environ)
            env.pop("TPURAY_ADDRESS", None)
            env.pop("RAY_ADDRESS", None)
            t = time.time()
            try:
                r = subprocess.run([pys[system], __file__, "--child", system, case, str(args[case])],
                                   capture_output=True, text=True, timeout=a.timeout, env=env)
                lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                res = json.loads(lines[-1]) if r.returncode == 0 and lines else {
                    "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
            except subprocess.TimeoutExpired:
                res = {"error": f"over {a.timeout:.0f} s"}
            results[case][system] = res
            print(f"{case} ({args[case]}) {system}: {json.dumps(res)}  [{time.time() - t:.0f} s]",
                  flush=True)
    (out / "limits.json").write_text(json.dumps(results, indent=2))
    print()
    print(f"{'case':10} {'metric':30} " + " ".join(f"{s:>14}" for s in systems)
          + ("  tpuray vs Ray" if len(systems) == 2 else ""))
    for case, row in results.items():
        for metric, higher_better in CASES[case][2].items():
            vals = [row[s].get(metric) for s in systems]
            cells = " ".join(f"{v:14.3f}" if isinstance(v, float) else f"{'-':>14}" for v in vals)
            ratio = ""
            if len(systems) == 2 and all(isinstance(v, float) and v > 0 for v in vals):
                r = vals[0] / vals[1] if higher_better else vals[1] / vals[0]
                ratio = f"  {r:8.2f}x"
            print(f"{case:10} {metric:30} {cells}{ratio}")
        for s in systems:
            if "error" in row[s]:
                print(f"{case:10} {s} failed: {row[s]['error']}")
    print(f"figures: {out / 'limits.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
