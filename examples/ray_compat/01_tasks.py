"""Tasks: remote functions, refs passed into tasks, nested tasks, put/get, wait."""
import tpuray as ray

ray.init(num_cpus=2)


@ray.remote
def square(x):
    return x * x


@ray.remote
def add(a, b):
    return a + b


@ray.remote
def sum_of_squares(n):
    # A task that submits tasks.
    return sum(ray.get([square.remote(i) for i in range(n)]))


print("squares:", ray.get([square.remote(i) for i in range(5)]))
x = square.remote(3)
print("chained:", ray.get(add.remote(x, square.remote(4))))
print("nested:", ray.get(sum_of_squares.remote(10)))
big = ray.put(list(range(1000)))
print("put/get:", sum(ray.get(big)))
refs = [square.remote(i) for i in range(4)]
ready, not_ready = ray.wait(refs, num_returns=4, timeout=30)
print("wait:", len(ready), len(not_ready), sorted(ray.get(ready)))
print("keyword args:", ray.get(add.remote(a=1, b=2)))


@ray.remote(num_returns=3)
def three():
    return 1, 2, 3


print("num_returns:", ray.get(list(three.remote())))
ray.shutdown()
