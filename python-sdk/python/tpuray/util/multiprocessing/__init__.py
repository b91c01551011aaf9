"""``tpuray.util.multiprocessing``: the standard library's ``multiprocessing.Pool`` API
over actors (Ray's ``ray.util.multiprocessing``), so a program using a process pool runs
on a cluster by changing its import."""

from multiprocessing import JoinableQueue, TimeoutError

from tpuray.util.multiprocessing.pool import AsyncResult, Pool

__all__ = ["AsyncResult", "JoinableQueue", "Pool", "TimeoutError"]
