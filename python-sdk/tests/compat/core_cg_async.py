"""concurrency_groups on an async actor (Ray 2.60): each group's coroutines run up to its
max_concurrency at once; the default group takes max_concurrency."""

import asyncio

import ray

ray.init(num_cpus=4)


@ray.remote(concurrency_groups={"two": 2, "one": 1}, max_concurrency=3)
class AsyncGrouped:
    def __init__(self):
        self.running = {}
        self.peak = {}

    async def _track(self, group):
        self.running[group] = self.running.get(group, 0) + 1
        self.peak[group] = max(self.peak.get(group, 0), self.running[group])
        await asyncio.sleep(0.3)
        self.running[group] -= 1

    @ray.method(concurrency_group="two")
    async def in_two(self):
        await self._track("two")

    @ray.method(concurrency_group="one")
    async def in_one(self):
        await self._track("one")

    async def in_default(self):
        await self._track("default")

    async def peaks(self):
        return dict(sorted(self.peak.items()))


a = AsyncGrouped.remote()
refs = [a.in_two.remote() for _ in range(6)]
refs += [a.in_one.remote() for _ in range(3)]
refs += [a.in_default.remote() for _ in range(6)]
ray.get(refs)
peaks = ray.get(a.peaks.remote())
print("peak one", peaks["one"])
print("peak two <= 2", peaks["two"] <= 2, "above one", peaks["two"] > 1)
print("peak default <= 3", peaks["default"] <= 3, "above one", peaks["default"] > 1)
