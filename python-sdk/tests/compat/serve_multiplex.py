"""Ray Serve: @serve.multiplexed model loading per replica with LRU eviction,
serve.get_multiplexed_model_id() from the handle option and from the
serve_multiplexed_model_id HTTP header."""

import socket

import requests

import ray
from ray import serve


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Model:
    def __init__(self, model_id):
        self.model_id = model_id

    def predict(self, x):
        return f"{self.model_id}({x})"


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Multi:
    def __init__(self):
        self.loads = []

    @serve.multiplexed(max_num_models_per_replica=2)
    async def get_model(self, model_id: str):
        self.loads.append(model_id)
        return Model(model_id)

    async def __call__(self, request):
        model_id = serve.get_multiplexed_model_id()
        model = await self.get_model(model_id)
        x = request.query_params.get("x", "?") if hasattr(request, "query_params") else request
        return model.predict(x)

    def loaded(self):
        return list(self.loads)


ray.init(num_cpus=2)
port = free_port()
serve.start(http_options={"host": "127.0.0.1", "port": port})
h = serve.run(Multi.bind(), name="mux", route_prefix="/mux")
for m in ["a", "b", "a", "c", "a", "b"]:
    print(m, h.options(multiplexed_model_id=m).remote(1).result())
print("loads", h.loaded.remote().result())
r = requests.get(f"http://127.0.0.1:{port}/mux", params={"x": 7}, headers={"serve_multiplexed_model_id": "z"})
print("http", r.status_code, r.text)
print("loads", h.loaded.remote().result())
try:
    serve.multiplexed(lambda model_id: model_id)
except TypeError as e:
    print("sync loader:", type(e).__name__)
try:
    serve.multiplexed(max_num_models_per_replica=0)
except ValueError as e:
    print("zero models:", type(e).__name__)
serve.shutdown()
ray.shutdown()
