#!/usr/bin/env python3
"""How cost grows with the work, tpuray against Ray on this machine, interleaved in one
run, each curve drawn as a PNG with Ray's beside tpuray's:

- ``tasks_vs_nodes.png``: tasks per second (empty tasks from one driver, submitted in
  one batch and then all gotten) against 1, 2, 4 and 8 node agents of 1 CPU each,
  started by ``cluster_utils.Cluster`` (Ray's and tpuray's own) on this machine;
- ``putget_vs_size.png``: ``put`` and ``get`` gigabytes per second of one numpy array
  against its size, 1 KiB .. 1 GiB (one node; ``get`` of a fresh ref each time);
- ``get_latency_vs_queue.png``: the round trip of one small task (submit, then ``get``;
  median of 20, in ms) while Q tasks wait in the queue for a resource held by a
  sleeping task, Q = 0, 1,000, 10,000, 100,000.

    bench/scaling.py                         # both systems, every point (~15 min on 2 cores)
    bench/scaling.py --quick                 # fewer, smaller points
    bench/scaling.py --systems tpuray --out /tmp/curves

Ray comes from RAY_VENV (default bench/.ray-venv, made with ``ray==2.60.0`` when missing,
as bench/compare.py makes it); tpuray is the release build in TPURAY_VENV (default
bench/.tpuray-venv, as compare.py makes it; a debug build is refused). Each point runs in
a fresh child process of that system's interpreter (``--child``), so both see the same
machine state, and the systems alternate point by point. The figures are printed as a
table with the ratio tpuray / Ray, written to ``scaling.json`` and drawn (matplotlib,
installed into the tpuray venv when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIB = 1 << 10

# ---------------------------------------------------------------- child: one point


def _child(system: str, kind: str, x: int) -> dict:
    if system == "tpuray":
        import tpuray as ray
        from tpuray._private.build import require_optimized_build
        from tpuray.cluster_utils import Cluster

        require_optimized_build("bench/scaling.py")
    else:
        import ray
        from ray.cluster_utils import Cluster
    if kind == "tasks_vs_nodes":
        return _tasks_vs_nodes(ray, Cluster, x)
    if kind == "putget_vs_size":
        return _putget_vs_size(ray, x)
    if kind == "get_latency_vs_queue":
        return _latency_vs_queue(ray, x)
    raise SystemExit(f"unknown point kind {kind!r}")


def _tasks_vs_nodes(ray, Cluster, nodes: int) -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address)

        @ray.remote(num_cpus=1)
        def noop():
            return None

        ray.get([noop.remote() for _ in range(20 * nodes)])  # every node's workers up
        n = 2000 * nodes if nodes < 8 else 10_000
        rates = []
        for _ in range(3):
            t = time.perf_counter()
            ray.get([noop.remote() for _ in range(n)])
            rates.append(n / (time.perf_counter() - t))
        return {"tasks_per_s": statistics.median(rates)}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _putget_vs_size(ray, size: int) -> dict:
    import numpy as np

    ray.init(num_cpus=1, object_store_memory=max(4 * size, 512 << 20))
    try:
        arr = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        # Each trial: as many put/get pairs as fill ~1 s (at least 3).
        reps = max(3, min(10_000, (1 << 30) // max(size, 1)))
        put_s, get_s = [], []
        for _ in range(3):
            refs = []
            t = time.perf_counter()
            for _ in range(reps):
                refs.append(ray.put(arr))
                if len(refs) > 2:  # the store holds a few at a time
                    refs.pop(0)
            put_s.append(time.perf_counter() - t)
            ref = ray.put(arr)
            t = time.perf_counter()
            for _ in range(reps):
                out = ray.get(ref)
                assert out.nbytes == size
                del out
            get_s.append(time.perf_counter() - t)
            del refs, ref
        gb = size * reps / 1e9
        return {"put_gb_per_s": gb / statistics.median(put_s),
                "get_gb_per_s": gb / statistics.median(get_s)}
    finally:
        ray.shutdown()


def _latency_vs_queue(ray, queued: int) -> dict:
    ray.init(num_cpus=2, resources={"gate": 1})
    try:
        @ray.remote(num_cpus=0, resources={"gate": 1})
        def gated(seconds):
            time.sleep(seconds)

        @ray.remote(num_cpus=1)
        def ping():
            return 1

        ray.get([ping.remote() for _ in range(4)])  # workers up
        holder = gated.remote(3600)  # holds the gate: every later gated task waits
        t = time.perf_counter()
        waiting = [gated.remote(0) for _ in range(queued)]
        submit_s = time.perf_counter() - t
        time.sleep(1.0)  # the queue settles
        lat = []
        for _ in range(20):
            t = time.perf_counter()
            ray.get(ping.remote())
            lat.append((time.perf_counter() - t) * 1e3)
        ready, _ = ray.wait(waiting[:1] + [holder], timeout=0)
        assert not ready, "the queue drained while measuring"
        return {"get_latency_ms": statistics.median(lat), "submit_s": submit_s}
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- parent


POINTS = {
    "tasks_vs_nodes": [1, 2, 4, 8],
    "putget_vs_size": [KIB, 16 * KIB, 256 * KIB, 4 << 20, 64 << 20, 1 << 30],
    "get_latency_vs_queue": [0, 1000, 10_000, 100_000],
}
QUICK = {
    "tasks_vs_nodes": [1, 2],
    "putget_vs_size": [KIB, 1 << 20, 64 << 20],
    "get_latency_vs_queue": [0, 1000],
}


def _interpreters(systems: list[str]) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "bench"))
    import compare

    out = {}
    if "ray" in systems:
        out["ray"] = str(compare.ensure_ray(Path(os.environ.get(
            "RAY_VENV", ROOT / "bench/.ray-venv")), "2.60.0"))
    if "tpuray" in systems:
        py = compare.ensure_tpuray(Path(os.environ.get("TPURAY_VENV", ROOT / "bench/.tpuray-venv")))
        compare.require_optimized(py, "bench/scaling.py")
        out["tpuray"] = str(py)
    return out


def _run_point(py: str, system: str, kind: str, x: int, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("TPURAY_ADDRESS", None)
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([py, __file__, "--child", system, kind, str(x)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _label(kind: str, x: int) -> str:
    if kind == "putget_vs_size":
        return f"{x // (1 << 20)} MiB" if x >= 1 << 20 else f"{x // KIB} KiB"
    return str(x)


def _draw(results: dict, out: Path, systems: list[str]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    # (curve, [(metric, legend prefix)], title, x label, y label, log x, log y)
    specs = [
        ("tasks_vs_nodes", [("tasks_per_s", "")], "Empty tasks per second from one driver",
         "node agents (1 CPU each)", "tasks / s", False, False),
        ("putget_vs_size", [("put_gb_per_s", "put "), ("get_gb_per_s", "get ")],
         "put / get of one numpy array", "object size (bytes)", "GB / s", True, True),
        ("get_latency_vs_queue", [("get_latency_ms", "")],
         "One task's round trip with Q tasks queued", "Q, tasks waiting in the queue",
         "submit + get, median (ms)", True, False),
    ]
    colours = {"put ": "tab:blue", "get ": "tab:orange", "": "tab:blue"}
    for kind, metrics, title, xlabel, ylabel, logx, logy in specs:
        if kind not in results:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for system in systems:
            for metric, prefix in metrics:
                pts = [(int(x), r[system].get(metric)) for x, r in results[kind].items()
                       if isinstance(r.get(system, {}).get(metric), (int, float))]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                xs = [max(x, 1) if logx else x for x in xs]  # Q = 0 drawn at 1 on a log axis
                style = "-o" if system == "tpuray" else "--s"
                colour = colours[prefix] if system == "tpuray" else (
                    "tab:green" if prefix == "put " else "tab:red")
                ax.plot(xs, ys, style, color=colour,
                        label=f"{prefix}{'tpuray' if system == 'tpuray' else 'Ray 2.60'}")
        if logx:
            ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))), flush=True)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--draw":  # OUT SYSTEMS, in a venv with matplotlib
        out = Path(sys.argv[2])
        for p in _draw(json.loads((out / "scaling.json").read_text()), out, sys.argv[3].split(",")):
            print(f"drawn: {p}")
        return 0
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="tpuray,ray", help="comma-separated: tpuray, ray")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller points")
    ap.add_argument("--only", default=None, help="only these curves, comma-separated: "
                    + ", ".join(POINTS))
    ap.add_argument("--out", default=None, help="folder for the PNGs and scaling.json "
                    "(default: a new folder under /tmp, printed)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    a = ap.parse_args()
    systems = [s for s in a.systems.split(",") if s]
    bad = [s for s in systems if s not in ("tpuray", "ray")]
    if bad or not systems:
        ap.error(f"--systems {a.systems!r}: expected tpuray, ray or both, comma-separated")
    points = QUICK if a.quick else POINTS
    kinds = a.only.split(",") if a.only else list(points)
    unknown = [k for k in kinds if k not in points]
    if unknown:
        ap.error(f"--only {', '.join(unknown)}: expected some of {', '.join(points)}")
    out = Path(a.out) if a.out else Path(
        subprocess.check_output(["mktemp", "-d", "/tmp/tpuray-scaling.XXXXXX"], text=True).strip())
    out.mkdir(parents=True, exist_ok=True)
    pys = _interpreters(systems)
    results: dict[str, dict[int, dict]] = {}
    for kind in kinds:
        results[kind] = {}
        for x in points[kind]:
            row = {}
            for system in systems:  # alternating, so both see the same machine
                row[system] = _run_point(pys[system], system, kind, x, a.timeout)
                print(f"{kind} {_label(kind, x)} {system}: {json.dumps(row[system])}", flush=True)
            results[kind][x] = row
    (out / "scaling.json").write_text(json.dumps(results, indent=2))
    print()
    print(f"{'curve':24} {'point':>9} {'metric':16} " + " ".join(f"{s:>12}" for s in systems)
          + ("  tpuray/Ray" if len(systems) == 2 else ""))
    for kind, rows in results.items():
        for x, row in rows.items():
            metrics = sorted({m for r in row.values() for m in r if m not in ("error", "submit_s")})
            for m in metrics:
                vals = [row[s].get(m) for s in systems]
                cells = " ".join(f"{v:12.3f}" if isinstance(v, float) else f"{'-':>12}" for v in vals)
                ratio = ""
                if len(systems) == 2 and all(isinstance(v, float) and v > 0 for v in vals):
                    r = vals[0] / vals[1]
                    ratio = f"  {r:9.2f}x" if "latency" not in m else f"  {r:9.2f}x (lower is better)"
                print(f"{kind:24} {_label(kind, x):>9} {m:16} {cells}{ratio}")
            for s in systems:
                if "error" in row[s]:
                    print(f"{kind:24} {_label(kind, x):>9} {s} failed: {row[s]['error']}")
    # Drawn by the tpuray venv's interpreter (else Ray's), with matplotlib from PyPI.
    py = pys.get("tpuray") or pys["ray"]
    if subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode != 0:
        subprocess.run([py, "-m", "pip", "install", "-q", "matplotlib"], check=True)
    subprocess.run([py, __file__, "--draw", str(out), ",".join(systems)], check=True)
    print(f"figures: {out / 'scaling.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
