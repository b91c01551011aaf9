"""Ray Serve: plain deployments over HTTP get a Starlette Request and may return
Starlette responses (status codes, headers, media types), strings, bytes, dicts or
generators (streamed); a handler that raises is a 500 and the proxy stays up."""

import socket

import requests
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse

import ray
from ray import serve


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Echo:
    async def __call__(self, request: Request):
        kind = request.query_params.get("kind", "dict")
        if kind == "dict":
            body = await request.json() if request.method == "POST" else None
            return {"method": request.method, "path": request.url.path, "body": body}
        if kind == "str":
            return f"hello {request.query_params.get('name', 'you')}"
        if kind == "bytes":
            return b"raw bytes"
        if kind == "none":
            return None
        if kind == "created":
            return JSONResponse({"created": True}, status_code=201, headers={"x-made-by": "echo"})
        if kind == "teapot":
            return PlainTextResponse("short and stout", status_code=418)
        if kind == "empty":
            return Response(status_code=204)
        if kind == "redirect":
            return RedirectResponse("/elsewhere", status_code=307)
        if kind == "stream":
            async def gen():
                for i in range(3):
                    yield f"chunk {i};"
            return StreamingResponse(gen(), media_type="text/plain")
        if kind == "header":
            return request.headers.get("x-token", "no token")
        if kind == "raise":
            raise RuntimeError("handler blew up")
        return PlainTextResponse(f"unknown kind {kind}", status_code=400)


@serve.deployment(ray_actor_options={"num_cpus": 0})
def hello(request: Request) -> str:
    return "function says " + request.query_params.get("who", "hi")


ray.init(num_cpus=2)
port = free_port()
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(Echo.bind(), name="echo", route_prefix="/echo")
serve.run(hello.bind(), name="fn", route_prefix="/fn")
base = f"http://127.0.0.1:{port}"


def show(label, r):
    print(label, r.status_code, r.headers.get("content-type"), repr(r.text))


show("dict GET", requests.get(base + "/echo"))
show("dict POST", requests.post(base + "/echo/sub/path", json={"a": [1, 2]}))
show("str", requests.get(base + "/echo", params={"kind": "str", "name": "ann"}))
show("bytes", requests.get(base + "/echo", params={"kind": "bytes"}))
show("none", requests.get(base + "/echo", params={"kind": "none"}))
r = requests.get(base + "/echo", params={"kind": "created"})
show("created", r)
print("x-made-by", r.headers.get("x-made-by"))
show("teapot", requests.get(base + "/echo", params={"kind": "teapot"}))
r = requests.get(base + "/echo", params={"kind": "empty"})
print("empty", r.status_code, repr(r.text))
r = requests.get(base + "/echo", params={"kind": "redirect"}, allow_redirects=False)
print("redirect", r.status_code, r.headers.get("location"))
show("stream", requests.get(base + "/echo", params={"kind": "stream"}))
show("header", requests.get(base + "/echo", params={"kind": "header"}, headers={"X-Token": "abc"}))
r = requests.get(base + "/echo", params={"kind": "raise"})
print("raise", r.status_code, r.text.splitlines()[0])
show("after raise", requests.get(base + "/echo", params={"kind": "str"}))
show("bad", requests.get(base + "/echo", params={"kind": "what"}))
show("function", requests.get(base + "/fn", params={"who": "bo"}))
print("no route", requests.get(base + "/nothing").status_code)
serve.shutdown()
ray.shutdown()
