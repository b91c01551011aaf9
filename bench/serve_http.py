"""HTTP requests/s and p50/p99 latency through serve's proxy to one trivial deployment
(no model: what serve itself costs per request), with N client threads.

    python bench/serve_http.py [--seconds 8] [--threads 8] [--kind plain|fastapi]

``plain``: a class whose ``__call__(request)`` reads the JSON body and returns a dict;
``fastapi``: the same through ``@serve.ingress(FastAPI())``. Runs the same under Ray
(``import ray`` instead of tpuray with ``--ray``) for a ratio.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
import urllib.request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--kind", choices=["plain", "fastapi"], default="plain")
    ap.add_argument("--ray", action="store_true", help="run under Ray instead of tpuray")
    a = ap.parse_args()
    if a.ray:
        import ray
        from ray import serve
    else:
        import tpuray as ray
        from tpuray import serve
        from tpuray._private.build import require_optimized_build

        require_optimized_build("bench/serve_http.py")

    if a.kind == "plain":
        @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
        class Echo:
            async def __call__(self, request):
                body = await request.json()
                return {"y": body["x"] + 1}
    else:
        from fastapi import FastAPI

        app = FastAPI()

        @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
        @serve.ingress(app)
        class Echo:
            @app.post("/")
            def echo(self, body: dict):
                return {"y": body["x"] + 1}

    ray.init(num_cpus=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Echo.bind(), name="echo", route_prefix="/echo")
    url = f"http://127.0.0.1:{port}/echo" + ("/" if a.kind == "fastapi" else "")
    lat: list = []
    stop = time.monotonic() + a.seconds

    def client():
        data = json.dumps({"x": 1}).encode()
        while time.monotonic() < stop:
            t = time.perf_counter()
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert json.loads(r.read()) == {"y": 2}
            lat.append(time.perf_counter() - t)

    for _ in range(20):  # warm up
        urllib.request.urlopen(urllib.request.Request(url, data=b'{"x": 1}', headers={
            "Content-Type": "application/json"}), timeout=60).read()
    t0 = time.monotonic()
    ts = [threading.Thread(target=client) for _ in range(a.threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    lat.sort()
    print(f"{a.kind}: {len(lat) / wall:.1f} requests/s, p50 {1000 * statistics.median(lat):.1f} ms, "
          f"p99 {1000 * lat[int(0.99 * (len(lat) - 1))]:.1f} ms ({len(lat)} requests, {a.threads} threads)")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
