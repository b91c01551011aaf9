"""runtime_env: environment variables for the job and per task."""
import os

import tpuray as ray

ray.init(num_cpus=2, runtime_env={"env_vars": {"GREETING": "hello"}})


@ray.remote
def greet(name):
    return f"{os.environ.get('GREETING')}, {name}{os.environ.get('PUNCT', '')}"


print(ray.get(greet.remote("world")))
print(ray.get(greet.options(runtime_env={"env_vars": {"PUNCT": "!"}}).remote("tasks")))


@ray.remote
class Env:
    def get(self, k):
        return os.environ.get(k)


e = Env.options(runtime_env={"env_vars": {"ACTOR_VAR": "set"}}).remote()
print("actor env:", ray.get(e.get.remote("ACTOR_VAR")), ray.get(e.get.remote("GREETING")))
ray.shutdown()
