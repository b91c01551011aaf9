"""concurrency_groups on a threaded actor (Ray 2.60): each group runs up to its own
max_concurrency calls at once, apart from the others; @ray.method(concurrency_group=...)
picks a method's group and .options(concurrency_group=...) one call's; methods in no
group share the default group of max_concurrency calls."""

import threading

import ray

ray.init(num_cpus=4)


@ray.remote(concurrency_groups={"io": 2, "compute": 1}, max_concurrency=1)
class Grouped:
    def __init__(self):
        self.barriers = {}
        self.lock = threading.Lock()

    def _barrier(self, key, parties, timeout):
        with self.lock:
            b = self.barriers.setdefault(key, threading.Barrier(parties, timeout=timeout))
        try:
            b.wait()
            return "met"
        except threading.BrokenBarrierError:
            return "alone"

    @ray.method(concurrency_group="io")
    def io(self, key, parties, timeout):
        return self._barrier(key, parties, timeout)

    @ray.method(concurrency_group="compute")
    def compute(self, key, parties, timeout):
        return self._barrier(key, parties, timeout)

    def default(self, key, parties, timeout):
        return self._barrier(key, parties, timeout)

    def thread_name_group(self):
        return threading.current_thread() is not threading.main_thread()


a = Grouped.remote()
# Two io calls run together (its limit is 2): they meet at a barrier of two.
print("io x2", ray.get([a.io.remote("io", 2, 60) for _ in range(2)]))
# compute runs one call at a time: the first waits alone until its timeout.
print("compute x2", ray.get([a.compute.remote("compute", 2, 1) for _ in range(2)]))
# The default group (max_concurrency=1) runs one at a time too.
print("default x2", ray.get([a.default.remote("default", 2, 1) for _ in range(2)]))
# Groups are apart: a compute call and an io call meet while each group has room.
print("compute with io", ray.get([a.compute.remote("mix", 2, 60), a.io.remote("mix", 2, 60)]))
# .options(concurrency_group=...) moves one call of a default-group method to io.
print(
    "default moved to io",
    ray.get([a.default.options(concurrency_group="io").remote("moved", 2, 60),
             a.io.remote("moved", 2, 60)]),
)
try:
    @ray.remote(concurrency_groups={"io": 1})
    class Bad:
        @ray.method(concurrency_group="missing")
        def f(self):
            return 1

    b = Bad.remote()
    print("undefined group", ray.get(b.f.remote()))
except Exception as e:  # noqa: BLE001 - Ray's class is what is compared
    print("undefined group:", type(e).__name__)
try:
    Grouped.options(concurrency_groups={"x": 1})
except ValueError:
    print("concurrency_groups in options(): ValueError")
