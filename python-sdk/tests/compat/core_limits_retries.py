"""Method-level max_task_retries and retry_exceptions (Ray 2.60), from @ray.method and
from .options(...) on a call: a method that raises runs again while its retries last;
exceptions outside a retry_exceptions list are not retried; max_calls in .options() is
refused."""

import ray

ray.init(num_cpus=2)


@ray.remote
class Flaky:
    def __init__(self):
        self.calls = {}

    def _count(self, key):
        self.calls[key] = self.calls.get(key, 0) + 1
        return self.calls[key]

    @ray.method(max_task_retries=3, retry_exceptions=True)
    def fails_twice(self, key):
        n = self._count(key)
        if n <= 2:
            raise ValueError(f"attempt {n}")
        return f"succeeded on attempt {n}"

    def plain_fails_twice(self, key):
        n = self._count(key)
        if n <= 2:
            raise ValueError(f"attempt {n}")
        return f"succeeded on attempt {n}"

    @ray.method(max_task_retries=5, retry_exceptions=[ValueError])
    def raises(self, key, exc):
        self._count(key)
        raise exc("always")

    def count(self, key):
        return self.calls.get(key, 0)


f = Flaky.remote()
print("decorated", ray.get(f.fails_twice.remote("a")))
try:
    ray.get(f.plain_fails_twice.remote("b"))
except ValueError:
    print("undecorated: ValueError after", ray.get(f.count.remote("b")), "call(s)")
print(
    "options on the call",
    ray.get(f.plain_fails_twice.options(max_task_retries=2, retry_exceptions=True).remote("c")),
)
try:
    ray.get(f.plain_fails_twice.options(max_task_retries=1, retry_exceptions=True).remote("d"))
except ValueError:
    print("too few retries: ValueError after", ray.get(f.count.remote("d")), "call(s)")
try:
    ray.get(f.raises.remote("e", KeyError))
except KeyError:
    print("outside the list: KeyError after", ray.get(f.count.remote("e")), "call(s)")
try:
    ray.get(f.raises.remote("g", ValueError))
except ValueError:
    print("inside the list: ValueError after", ray.get(f.count.remote("g")), "call(s)")


@ray.remote(max_calls=2)
def pid():
    import os

    return os.getpid()


try:
    pid.options(max_calls=3)
except ValueError:
    print("max_calls in options(): ValueError")
pids = [ray.get(pid.remote()) for _ in range(6)]
print("no worker ran more than max_calls", max(pids.count(p) for p in set(pids)) <= 2)
