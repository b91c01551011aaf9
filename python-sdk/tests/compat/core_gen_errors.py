"""An exception in a generator surfaces at the right item (Ray 2.60): the refs of the
items produced before it get their values, the next ref raises the exception (its
class kept), then the generator ends."""

import ray

ray.init(num_cpus=4)


class Boom(ValueError):
    pass


@ray.remote
def fails_at(k):
    for i in range(5):
        if i == k:
            raise Boom(f"failed at {i}")
        yield i


@ray.remote
class A:
    def fails(self):
        yield "first"
        raise KeyError("in a method")


gen = fails_at.remote(2)
refs = list(gen)
print("refs", len(refs))
print("first values", ray.get(refs[:2]))
try:
    ray.get(refs[2])
except Boom as e:
    print("third raises Boom:", isinstance(e, ValueError), "failed at 2" in str(e))
try:
    next(gen)
except StopIteration:
    print("then StopIteration")

gen = fails_at.remote(0)
r = next(gen)
try:
    ray.get(r)
except Boom:
    print("failing at once: the first ref raises Boom")

a = A.remote()
refs = list(a.fails.remote())
print("method refs", len(refs), ray.get(refs[0]))
try:
    ray.get(refs[1])
except KeyError:
    print("method error: KeyError")
