"""The prefixes of worker lines at the driver: a task's function name, an actor's class
name, or its ``__repr__`` when the class defines one (Ray's "Customizing prefixes for
Actor logs"), stdout and stderr. test_logs.py compares the lines (sorted, pids written
pid=N) with ``logs_prefixes.driver-lines``, recorded under Ray 2.60."""

import sys
import time

import ray

ray.init(num_cpus=2)


@ray.remote
class Custom:
    def __init__(self, tag):
        self.tag = tag

    def __repr__(self):
        return f"Custom({self.tag})"

    def hi(self):
        print("from the custom actor")
        return 1


@ray.remote
class Plain:
    def hi(self):
        print("from the plain actor")
        return 1


@ray.remote
def task():
    print("from the task")
    print("from the task, on stderr", file=sys.stderr)
    return 1


a, b = Custom.remote("x"), Plain.remote()
print("results", sum(ray.get([a.hi.remote(), b.hi.remote(), task.remote()])))
time.sleep(2)
ray.shutdown()
print("done")
