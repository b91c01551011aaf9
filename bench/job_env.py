#!/usr/bin/env python3
"""Time to a job's first task in a new pip or uv environment and in a cached one, tpuray
against Ray, through the same Jobs REST API (Ray 2.60's, which tpuray serves).

Each system gets a fresh one-node cluster. For each installer (``--installer``: ``pip``,
``uv`` or both), the same job is submitted ``--runs`` times with a ``working_dir``
(uploaded once, as Ray's client does) and ``pip: [PACKAGE]`` or ``uv: [PACKAGE]``: the
first run builds the environment, the later ones find it cached. The job's script runs
one task that imports the package and prints when its result is back. Reported per
run: submit → first task result, and submit → SUCCEEDED, in seconds. ``uv`` keeps Ray's
default ``uv_pip_install_options`` (``--no-cache``) on both systems; tpuray uses the
``uv`` beside its Python (``pip install uv``), Ray pip-installs uv into each new
environment unless the environment's Python already has it (Ray 2.60's ``uv.py``).

    python3 bench/job_env.py                       # both systems, pip and uv
    python3 bench/job_env.py --system tpuray --installer uv --package tinydb

tpuray: the ``tpuray`` of ``--tpuray-python`` (default: .venv, where scripts/demo.sh
installs a release build; a debug build is refused); Ray: ``ray[default]==2.60.0`` in ``--ray-venv`` (default bench/.ray-jobs-venv, made
when missing; Ray's job server needs the dashboard's extras).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = """
import os, time
if os.environ.get("BENCH_SYSTEM") == "tpuray":
    import tpuray as ray
else:
    import ray
ray.init()

@ray.remote
def f():
    import {module}
    return {module}.__name__

print(ray.get(f.remote()), "FIRST_TASK", time.time(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(base, method, path, headers, body=None, raw=False):
    data = body if raw or body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        out = r.read()
    return out if raw else (json.loads(out) if out else None)


RAY_VENV = ROOT / "bench" / ".ray-jobs-venv"


def ray_python() -> str:
    venv = RAY_VENV
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "ray[default]==2.60.0"], check=True)
    return str(py)


def start(system: str, tmp: Path, tpuray_python: str):
    """Starts a one-node cluster; returns (dashboard URL, headers, stop command, env)."""
    env = dict(os.environ, HOME=str(tmp / "home"), TPURAY_REGISTRY_DIR=str(tmp / "reg"))
    (tmp / "home").mkdir(parents=True, exist_ok=True)
    port = free_port()
    if system == "tpuray":
        exe = str(Path(tpuray_python).parent / "tpuray")
        out = subprocess.run(
            [exe, "start", "--head", "--port", "0", "--dashboard-port", str(port), "--num-cpus", "2",
             "--node-ip-address", "127.0.0.1", "--temp-dir", str(tmp / "t")],
            env=env, capture_output=True, text=True, check=True,
        ).stdout
        url = re.search(r"Dashboard: (\S+)", out).group(1)
        token = (tmp / "home" / ".tpuray" / "auth_token").read_text().strip()
        return url, {"Authorization": f"Bearer {token}"}, [exe, "stop"], env
    ray = str(Path(ray_python()).parent / "ray")
    subprocess.run(
        [ray, "start", "--head", "--port", str(free_port()), "--dashboard-port", str(port),
         "--num-cpus", "2", "--node-ip-address", "127.0.0.1", "--temp-dir", str(tmp / "t")],
        env=env, capture_output=True, text=True, check=True,
    )
    return f"http://127.0.0.1:{port}", {}, [ray, "stop", "--force"], env


def run(system: str, package: str, runs: int, tpuray_python: str,
        installers: list[str]) -> dict[str, list[tuple[float, float]]]:
    tmp = Path(tempfile.mkdtemp(prefix=f"job-env-{system}-"))
    url, headers, stop, env = start(system, tmp, tpuray_python)
    try:
        deadline = time.time() + 60
        while True:
            try:
                request(url, "GET", "/api/version", headers)
                break
            except (urllib.error.URLError, ConnectionError):
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("job.py", JOB.format(module=package.replace("-", "_")))
        pkg = f"_ray_pkg_{hashlib.sha256(buf.getvalue()).hexdigest()[:16]}.zip"
        request(url, "PUT", f"/api/packages/gcs/{pkg}", headers, buf.getvalue(), raw=True)
        out = {}
        for installer in installers:
            out[installer] = []
            for i in range(runs):
                t0 = time.time()
                sid = request(url, "POST", "/api/jobs/", {**headers, "Content-Type": "application/json"}, {
                    "entrypoint": "python job.py",
                    "runtime_env": {"working_dir": f"gcs://{pkg}", installer: [package],
                                    "env_vars": {"BENCH_SYSTEM": system}},
                })["submission_id"]
                while True:
                    info = request(url, "GET", f"/api/jobs/{sid}", headers)
                    if info["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                        break
                    time.sleep(0.05)
                t_end = time.time() - t0
                logs = request(url, "GET", f"/api/jobs/{sid}/logs", headers)["logs"]
                if info["status"] != "SUCCEEDED":
                    raise RuntimeError(f"{system} {installer} run {i}: {info['status']}: {info['message']}\n{logs}")
                first = float(re.search(r"FIRST_TASK (\S+)", logs).group(1)) - t0
                out[installer].append((first, t_end))
                print(f"{system} {installer} run {i} ({'new' if i == 0 else 'cached'} env): first task {first:.2f} s, "
                      f"job done {t_end:.2f} s", flush=True)
        return out
    finally:
        subprocess.run(stop, env=env, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=["tpuray", "ray", "both"], default="both")
    ap.add_argument("--package", default="tinydb", help="a small pure-Python package from PyPI")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--installer", choices=["pip", "uv", "both"], default="both")
    ap.add_argument("--tpuray-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--ray-venv", default=str(ROOT / "bench" / ".ray-jobs-venv"),
                    help="a venv with ray[default]==2.60.0")
    a = ap.parse_args()
    global RAY_VENV
    RAY_VENV = Path(a.ray_venv)
    systems = ["tpuray", "ray"] if a.system == "both" else [a.system]
    installers = ["pip", "uv"] if a.installer == "both" else [a.installer]
    if "tpuray" in systems:
        sys.path.insert(0, str(ROOT / "bench"))
        import compare

        compare.require_optimized(a.tpuray_python, "bench/job_env.py")
    res = {s: run(s, a.package, a.runs, a.tpuray_python, installers) for s in systems}
    for inst in installers:
        for label, i in (("new env", 0), ("cached env", a.runs - 1)):
            figures = {s: res[s][inst][i][0] for s in systems}
            line = ", ".join(f"{s} {v:.2f} s" for s, v in figures.items())
            if len(figures) == 2:
                line += f" (Ray/tpuray {figures['ray'] / figures['tpuray']:.1f}x)"
            print(f"first task, {inst}, {label}: {line}")


if __name__ == "__main__":
    main()
