"""Actors: state, ordering, handles passed to tasks, named actors, async and threaded."""
import asyncio
import threading

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
    def __init__(self):
        self.arrived = 0
        self.all_here = None

    async def rendezvous(self, n):
        # Returns only once n calls are inside the actor at the same time.
        if self.all_here is None:
            self.all_here = asyncio.Event()
        self.arrived += 1
        if self.arrived == n:
            self.all_here.set()
        await asyncio.wait_for(self.all_here.wait(), 60)
        return self.arrived


a = AsyncWorker.remote()
print("async calls overlap:", ray.get([a.rendezvous.remote(5) for _ in range(5)]))


@ray.remote(max_concurrency=3)
class Threaded:
    def __init__(self):
        self.barrier = threading.Barrier(3, timeout=60)

    def meet(self):
        # Passes only when three calls run on three threads at once.
        return self.barrier.wait() >= 0


t = Threaded.remote()
print("threaded calls meet:", ray.get([t.meet.remote() for _ in range(3)]))
ray.kill(c)
try:
    ray.get(c.get.remote())
except ray.exceptions.RayActorError:
    print("killed actor raises RayActorError")
ray.shutdown()
