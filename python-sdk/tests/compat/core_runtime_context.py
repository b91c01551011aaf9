"""RuntimeContext inside tasks and actors: ids, names, function names, assigned
resources, accelerator ids, current_actor, was_current_actor_reconstructed."""

import ray

ray.init(num_cpus=4)
ctx = ray.get_runtime_context()
print("driver task id", ctx.get_task_id())
print("driver actor id", ctx.get_actor_id(), "actor name", ctx.get_actor_name())
print("driver worker id is hex", isinstance(ctx.get_worker_id(), str) and int(ctx.get_worker_id(), 16) >= 0)
print("driver task name", ctx.get_task_name(), ctx.get_task_function_name())


def describe():
    c = ray.get_runtime_context()
    return {
        "task_id_str": isinstance(c.get_task_id(), str),
        "task_name": c.get_task_name(),
        "function": c.get_task_function_name(),
        "assigned": c.get_assigned_resources(),
        "accelerators": sorted(k for k, v in c.get_accelerator_ids().items() if v),
        "actor_id": c.get_actor_id() is not None,
        "actor_name": c.get_actor_name(),
        "worker_id_str": isinstance(c.get_worker_id(), str),
    }


@ray.remote
def task():
    return describe()


@ray.remote(num_cpus=2)
def big():
    return describe()


@ray.remote
class Plain:
    def about(self):
        d = describe()
        c = ray.get_runtime_context()
        d["reconstructed"] = c.was_current_actor_reconstructed
        d["current_actor"] = type(c.current_actor).__name__
        return d


@ray.remote(num_cpus=1)
class Sized:
    def about(self):
        return describe()


for label, ref in (
    ("task", task.remote()),
    ("named task", task.options(name="custom-name").remote()),
    ("num_cpus=2", big.remote()),
    ("actor", Plain.remote().about.remote()),
    ("named actor", Plain.options(name="ctx-actor").remote().about.remote()),
    ("actor num_cpus=1", Sized.remote().about.remote()),
):
    d = ray.get(ref)
    print(label, sorted(d.items()))
ray.shutdown()
