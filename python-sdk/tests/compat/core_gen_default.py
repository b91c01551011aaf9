"""Generators stream by default (Ray 2.60): a generator function or method returns an
ObjectRefGenerator without num_returns="streaming"; next() after the end raises
StopIteration; "streaming" on a plain function is refused; num_returns=N on a
generator still returns N refs."""

import ray

ray.init(num_cpus=4)


@ray.remote
def count(n):
    for i in range(n):
        yield i * 10


@ray.remote
def plain():
    return 1


@ray.remote(num_returns=2)
def two():
    yield "a"
    yield "b"


@ray.remote
class Producer:
    def items(self, n):
        for i in range(n):
            yield f"item{i}"

    @ray.method(num_returns=1)
    def whole(self):
        return [1, 2]


gen = count.remote(3)
print("type", type(gen).__name__)
print("values", [ray.get(r) for r in gen])
try:
    next(gen)
except StopIteration:
    print("next after the end: StopIteration")
print("options streaming", [ray.get(r) for r in count.options(num_returns="streaming").remote(2)])
print("num_returns=2 on a generator", ray.get(two.remote()))
try:
    plain.options(num_returns="streaming")
    print("streaming on a plain function accepted")
except ValueError:
    print("streaming on a plain function: ValueError")

p = Producer.remote()
g = p.items.remote(3)
print("method type", type(g).__name__)
print("method values", ray.get(list(g)))
print("method whole", ray.get(p.whole.remote()))
print("method options streaming", [ray.get(r) for r in p.items.options(num_returns="streaming").remote(2)])

named = Producer.options(name="producer").remote()
again = ray.get_actor("producer")
print("through get_actor", type(again.items.remote(1)).__name__,
      [ray.get(r) for r in again.items.remote(2)])
