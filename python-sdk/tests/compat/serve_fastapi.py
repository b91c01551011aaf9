"""Ray Serve: a FastAPI app as a deployment's ingress (@serve.ingress), class-based
routes with path and query parameters, a pydantic body, HTTPException, a route that
raises (a 500), and the same deployment's methods called through a handle."""

import socket

import requests
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import ray
from ray import serve


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


app = FastAPI()


class Item(BaseModel):
    name: str
    price: float
    tags: list[str] = []


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Shop:
    def __init__(self, greeting: str):
        self.greeting = greeting
        self.items = {}

    @app.get("/")
    def root(self):
        return {"greeting": self.greeting}

    @app.get("/hello/{name}")
    async def hello(self, name: str, times: int = 1):
        return " ".join([f"{self.greeting}, {name}!"] * times)

    @app.post("/items/{item_id}", status_code=201)
    def create(self, item_id: int, item: Item):
        self.items[item_id] = item
        return {"id": item_id, "name": item.name, "total": item.price * 2, "tags": item.tags}

    @app.get("/items/{item_id}")
    def read(self, item_id: int):
        if item_id not in self.items:
            raise HTTPException(status_code=404, detail=f"no item {item_id}")
        return self.items[item_id]

    @app.get("/boom")
    def boom(self):
        raise ValueError("the handler failed")

    def count(self) -> int:
        return len(self.items)


ray.init(num_cpus=2)
port = free_port()
serve.start(http_options={"host": "127.0.0.1", "port": port})
handle = serve.run(Shop.bind("Hi"), name="shop", route_prefix="/shop")
base = f"http://127.0.0.1:{port}/shop"

r = requests.get(base + "/")
print("GET /", r.status_code, r.headers["content-type"], r.text)
r = requests.get(base + "/hello/ann", params={"times": 2})
print("GET /hello/ann", r.status_code, r.json())
r = requests.get(base + "/hello/bo", params={"times": "many"})
print("bad query", r.status_code, [e["loc"] for e in r.json()["detail"]])
r = requests.post(base + "/items/7", json={"name": "tea", "price": 2.5, "tags": ["hot"]})
print("POST /items/7", r.status_code, r.json())
r = requests.post(base + "/items/8", json={"name": "tea"})
print("missing field", r.status_code, [e["loc"] for e in r.json()["detail"]])
r = requests.get(base + "/items/7")
print("GET /items/7", r.status_code, r.json())
r = requests.get(base + "/items/9")
print("GET /items/9", r.status_code, r.json())
r = requests.get(base + "/nope")
print("unknown route", r.status_code, r.json())
r = requests.get(base + "/boom")
print("raising route", r.status_code, r.text.splitlines()[0])
r = requests.get(base + "/")
print("after the error", r.status_code, r.json())
print("handle count", handle.count.remote().result())
print("handle root", handle.root.remote().result())
serve.shutdown()
ray.shutdown()
