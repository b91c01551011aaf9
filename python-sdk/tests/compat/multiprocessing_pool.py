"""ray.util.multiprocessing.Pool: the standard library's Pool API over actors."""

import os
import time

import ray
from ray.util.multiprocessing import Pool, TimeoutError
import multiprocessing

ray.init(num_cpus=4)
print("TimeoutError is multiprocessing's", TimeoutError is multiprocessing.TimeoutError)


def square(x):
    return x * x


def add(a, b):
    return a + b


def slow_identity(x):
    time.sleep(0.3 if x == 0 else 0.0)
    return x


def fail_on_three(x):
    if x == 3:
        raise ValueError("three")
    return x


def set_marker(value):
    os.environ["POOL_MARKER"] = value


def read_marker(_):
    return os.environ.get("POOL_MARKER")


with Pool(processes=2) as pool:
    print("map", pool.map(square, range(10)))
    print("map chunksize=3", pool.map(square, range(7), chunksize=3))
    print("map empty", pool.map(square, []))
    print("starmap", pool.starmap(add, [(1, 2), (3, 4), (5, 6)]))
    print("imap", list(pool.imap(square, range(6))))
    print("imap chunksize=4", list(pool.imap(square, range(9), chunksize=4)))
    print("imap of a generator", list(pool.imap(square, (i for i in range(5)))))
    print("imap_unordered", sorted(pool.imap_unordered(square, range(8))))
    print("apply", pool.apply(add, (2, 3)), pool.apply(add, args=(1,), kwargs={"b": 10}))

    r = pool.apply_async(square, (7,))
    print("apply_async", r.get(timeout=30), r.ready(), r.successful())
    m = pool.map_async(square, range(4))
    m.wait(timeout=30)
    print("map_async", m.get(), m.ready(), m.successful())
    s = pool.starmap_async(add, [(1, 1), (2, 2)])
    print("starmap_async", s.get(timeout=30))

    got = []
    pool.apply_async(square, (9,), callback=got.append).wait(30)
    pool.map_async(square, [1, 2], callback=got.append).wait(30)
    errors = []
    pool.map_async(fail_on_three, range(5), error_callback=lambda e: errors.append(repr(e))).wait(30)
    time.sleep(0.2)
    print("callbacks", got, "error_callback", errors)

    try:
        pool.map(fail_on_three, range(5))
    except ValueError as e:
        print("map raised", type(e).__name__, e)
    bad = pool.apply_async(fail_on_three, (3,))
    bad.wait(30)
    print("failed apply_async: ready", bad.ready(), "successful", bad.successful())
    try:
        bad.get()
    except ValueError as e:
        print("get raised", type(e).__name__, e)

    pending = pool.apply_async(time.sleep, (2,))
    try:
        pending.get(timeout=0.1)
    except TimeoutError:
        print("get timed out; ready", pending.ready())
    try:
        pending.successful()
    except ValueError:
        print("successful() before ready: ValueError")
    it = pool.imap(slow_identity, [0, 1])
    print("imap next", it.next(timeout=30), next(it))
    try:
        next(it)
    except StopIteration:
        print("imap exhausted")

    # Ray's imap yields a failed call's PoolTaskError instead of raising it.
    items = list(pool.imap(fail_on_three, range(5)))
    print("imap with a failure", [type(x).__name__ for x in items], repr(items[3].underlying))


def pid(_):
    return os.getpid()


with Pool(processes=1, maxtasksperchild=1) as pool:
    print("maxtasksperchild=1: distinct processes", len(set(pool.map(pid, range(3), chunksize=1))))

with Pool(processes=3, initializer=set_marker, initargs=("set by initializer",)) as pool:
    print("initializer", set(pool.map(read_marker, range(6))))

pool = Pool(2)
print("default-sized pool map", pool.map(square, [3]))
pool.close()
try:
    pool.map(square, [1])
except ValueError as e:
    print("after close:", e)
pool.join()
print("joined")

running = Pool(1)
try:
    running.join()
except ValueError as e:
    print("join while running:", e)
running.terminate()

try:
    Pool(processes=100)
except ValueError as e:
    print("too many processes:", e)
try:
    Pool(processes=0)
except ValueError as e:
    print("zero processes:", e)
ray.shutdown()
