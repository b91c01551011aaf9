"""Ray Serve: serve.status() in Ray's shape, get_app_handle, get_deployment_handle,
serve.delete, and serve.shutdown() then serve.run() again in the same process."""

import ray
from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Adder:
    def __init__(self, n):
        self.n = n

    def __call__(self, x):
        return x + self.n


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=2)
class Front:
    def __init__(self, adder):
        self.adder = adder

    async def __call__(self, x):
        return await self.adder.remote(x) * 10


ray.init(num_cpus=2)
serve.run(Front.bind(Adder.bind(1)), name="calc", route_prefix=None)
serve.run(Adder.bind(100), name="solo", route_prefix=None)

st = serve.status()
print(sorted(st.applications))
app = st.applications["calc"]
print(app.status)
print(app.status == "RUNNING", type(app.message).__name__, app.message == "")
for name in sorted(app.deployments):
    d = app.deployments[name]
    print(name, d.status, d.status_trigger, {str(k): v for k, v in d.replica_states.items()})

print("app handle", serve.get_app_handle("calc").remote(2).result())
print("deployment handle", serve.get_deployment_handle("Adder", app_name="calc").remote(2).result())
print("solo", serve.get_app_handle("solo").remote(2).result())
try:
    serve.get_app_handle("nope")
except Exception as e:
    print("missing app:", type(e).__name__)

serve.delete("solo")
print("after delete", sorted(serve.status().applications))
serve.delete("never-existed")

serve.shutdown()
print("after shutdown", sorted(serve.status().applications))

h = serve.run(Adder.bind(5), name="again", route_prefix=None)
print("run again", h.remote(1).result())
print(serve.status().applications["again"].status)
serve.shutdown()
ray.shutdown()
