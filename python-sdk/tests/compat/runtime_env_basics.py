"""runtime_env: a task's env_vars merged over the job's per variable, the job's
working_dir importable in a task with its own environment; RuntimeEnvConfig and RuntimeEnv are dicts of Ray's shape; a package pip cannot
find raises RuntimeEnvSetupError at the task's get and at an actor's first call, and
plain tasks run afterwards.

Not here, where tpuray does more than Ray 2.60: a local working_dir or py_modules per
task or actor (Ray refuses it: "only supported at the job level"), pip's output in the
error's text (tests/test_runtime_env.py checks it)."""

import os
import tempfile

import ray
from ray.runtime_env import RuntimeEnv, RuntimeEnvConfig

wd = tempfile.mkdtemp()
with open(os.path.join(wd, "mod_in_wd.py"), "w") as f:
    f.write("V = 'from the working_dir'\n")
ray.init(num_cpus=2, runtime_env={"env_vars": {"A": "job", "B": "job"}, "working_dir": wd})


@ray.remote
def env():
    return os.environ.get("A"), os.environ.get("B"), os.environ.get("C")


print("job only", ray.get(env.remote()))
print("merged", ray.get(env.options(runtime_env={"env_vars": {"B": "task", "C": "task"}}).remote()))
print("config", dict(RuntimeEnvConfig(setup_timeout_seconds=30)))
r = RuntimeEnv(env_vars={"X": "1"}, config={"setup_timeout_seconds": 30})
print("runtime_env", sorted(r.keys()), r["env_vars"], dict(r["config"]))

@ray.remote
def use_wd():
    import mod_in_wd

    return mod_in_wd.V, os.environ.get("A")


print("working_dir", ray.get(use_wd.options(runtime_env={"env_vars": {"C": "c"}}).remote()))

bad = {"pip": ["tpuray-no-such-package-3141592==0.0.1"]}
try:
    ray.get(env.options(runtime_env=bad).remote(), timeout=300)
    print("task: no error")
except ray.exceptions.RuntimeEnvSetupError as e:
    # (the lines after it differ: tpuray carries pip's own output there)
    print("task RuntimeEnvSetupError:", str(e).splitlines()[0])


@ray.remote
class A:
    def ping(self):
        return "pong"


a = A.options(runtime_env=bad).remote()
try:
    ray.get(a.ping.remote(), timeout=300)
    print("actor: no error")
except ray.exceptions.RuntimeEnvSetupError as e:
    print("actor RuntimeEnvSetupError:", str(e).splitlines()[0])
except ray.exceptions.RayActorError as e:
    print("actor RayActorError", type(e).__name__)
print("after", ray.get(env.remote()))
ray.shutdown()
