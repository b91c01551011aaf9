"""A first version of `tpuray microbenchmark` for the Python SDK: Ray's case names and
timing method (ray/_private/ray_microbenchmark_helpers.timeit: a warm-up, then 4 runs of
2 s; mean +- sd of calls per second), plus start-up figures. The script says
`import tpuray as ray`; bench/ray_compat.sh's shim runs it under Ray unchanged:

    .venv/bin/python bench/py_microbench.py
    PYTHONPATH=examples/ray_compat/ray_shim /path/to/ray-venv/bin/python bench/py_microbench.py

Prints `<name> per second <mean> +- <sd>` per case and `<name> <seconds> s` for start-up.
"""

import os
import sys
import time

import tpuray as ray

if ray.__name__ == "tpuray":  # not when bench/ray_compat.sh's shim runs this under Ray
    from tpuray._private.build import require_optimized_build

    require_optimized_build("bench/py_microbench.py")

WARMUP = float(os.environ.get("MICROBENCH_WARMUP_S", "1"))


def timeit(name, fn, multiplier=1):
    time.sleep(WARMUP)
    start = time.perf_counter()
    count = 0
    while time.perf_counter() - start < 1:
        fn()
        count += 1
    step = count // 10 + 1
    stats = []
    for _ in range(4):
        start = time.perf_counter()
        count = 0
        while time.perf_counter() - start < 2:
            for _ in range(step):
                fn()
            count += step
        stats.append(multiplier * count / (time.perf_counter() - start))
    mean = sum(stats) / len(stats)
    sd = (sum((s - mean) ** 2 for s in stats) / len(stats)) ** 0.5
    print(f"{name} per second {round(mean, 2)} +- {round(sd, 2)}", flush=True)


@ray.remote(num_cpus=0)
def small_value():
    return b"ok"


@ray.remote(num_cpus=0)
class Actor:
    def small_value(self):
        return b"ok"

    def ready(self):
        return True


def main():
    t = time.perf_counter()
    ray.init(num_cpus=int(os.environ.get("MICROBENCH_CPUS", "2")))
    print(f"init of a local cluster {time.perf_counter() - t:.3f} s", flush=True)
    t = time.perf_counter()
    ray.get(small_value.remote())
    print(f"first task {time.perf_counter() - t:.3f} s", flush=True)
    t = time.perf_counter()
    actors = [Actor.remote() for _ in range(50)]
    ray.get([a.ready.remote() for a in actors])
    print(f"50 actors created and answering {time.perf_counter() - t:.3f} s", flush=True)
    for a in actors:
        ray.kill(a)
    del actors

    value = ray.put(0)
    timeit("single client get calls (Plasma Store)", lambda: ray.get(value))
    timeit("single client put calls (Plasma Store)", lambda: ray.put(0))
    timeit("single client tasks sync", lambda: ray.get(small_value.remote()))
    timeit(
        "single client tasks async",
        lambda: ray.get([small_value.remote() for _ in range(1000)]),
        1000,
    )
    a = Actor.remote()
    ray.get(a.ready.remote())
    timeit("1:1 actor calls sync", lambda: ray.get(a.small_value.remote()))
    timeit(
        "1:1 actor calls async",
        lambda: ray.get([a.small_value.remote() for _ in range(1000)]),
        1000,
    )
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
