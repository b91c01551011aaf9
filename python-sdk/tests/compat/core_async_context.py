"""get_runtime_context() inside async actor methods, three overlapping calls each seeing
its own task (Ray names the task Class.method and gives each call its own task id)."""

import asyncio

import ray

ray.init(num_cpus=1)


@ray.remote
class A:
    async def m(self, i):
        c = ray.get_runtime_context()
        before = c.get_task_id()
        await asyncio.sleep(0.2)  # the three calls overlap here
        after = c.get_task_id()
        return i, before == after, before is not None, c.get_task_name(), c.get_task_function_name()

    async def tid(self):
        await asyncio.sleep(0.1)
        return ray.get_runtime_context().get_task_id()

    def s(self):
        c = ray.get_runtime_context()
        return c.get_task_name(), c.get_task_id() is not None


a = A.remote()
results = ray.get([a.m.remote(i) for i in range(3)])
for r in results:
    print(r)
ids = ray.get([a.tid.remote() for _ in range(3)])
print("distinct task ids", len(set(ids)) == 3 and None not in ids)
print("sync method", ray.get(a.s.remote()))
