"""Actors: state, ordering, handles passed to tasks, named actors, async and threaded."""
import asyncio
import threading
import time

import tpuray as ray

ray.init(num_cpus=2)


@ray.remote
class Counter:
    def __init__(self, start):
        self.value = start

    def increment(self, by=1):
        self.value += by
        return self.value

    def get(self):
        return self.value


c = Counter.remote(10)
print("in order:", ray.get([c.increment.remote() for _ in range(5)]))


@ray.remote
def bump(counter, times):
    return ray.get([counter.increment.remote() for _ in range(times)])[-1]


print("handle in task:", ray.get(bump.remote(c, 3)))
named = Counter.options(name="shared").remote(0)
print("named:", ray.get(ray.get_actor("shared").increment.remote(5)))


@ray.remote
class AsyncWorker:
    async def work(self, i):
        await asyncio.sleep(0.3)
        return i * 10


a = AsyncWorker.remote()
start = time.time()
print("async results:", ray.get([a.work.remote(i) for i in range(5)]))
print("async overlapped:", time.time() - start < 1.4)


@ray.remote(max_concurrency=3)
class Threaded:
    def __init__(self):
        self.lock = threading.Lock()
        self.peak = 0
        self.now = 0

    def work(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(0.3)
        with self.lock:
            self.now -= 1
        return True

    def peak_concurrency(self):
        return self.peak


t = Threaded.remote()
ray.get([t.work.remote() for _ in range(6)])
print("threaded peak > 1:", ray.get(t.peak_concurrency.remote()) > 1)
ray.kill(c)
try:
    ray.get(c.get.remote())
except ray.exceptions.RayActorError:
    print("killed actor raises RayActorError")
ray.shutdown()
