"""Async generators in async actors stream (Ray 2.60); `async for` walks an
ObjectRefGenerator's refs, in the driver and inside an async actor."""

import asyncio

import ray

ray.init(num_cpus=4)


@ray.remote
class Ticker:
    async def ticks(self, n):
        for i in range(n):
            await asyncio.sleep(0)
            yield i * i

    async def total_of(self, other, n):
        total = 0
        async for ref in other.ticks.remote(n):
            total += await ref
        return total


@ray.remote
def squares(n):
    for i in range(n):
        yield i * i


t = Ticker.remote()
gen = t.ticks.remote(4)
print("type", type(gen).__name__)
print("values", [ray.get(r) for r in gen])


async def main():
    out = []
    async for ref in squares.remote(4):
        out.append(await ref)
    print("async for over a task", out)
    out = []
    async for ref in t.ticks.remote(3):
        out.append(await ref)
    print("async for over a method", out)


asyncio.run(main())
other = Ticker.remote()
print("async for inside an actor", ray.get(t.total_of.remote(other, 4)))
