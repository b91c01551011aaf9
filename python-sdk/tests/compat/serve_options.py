"""Ray Serve: deployment options max_ongoing_requests and max_queued_requests
(BackPressureError from a handle, 503 over HTTP), graceful_shutdown_* and
health_check_* as the Deployment reports them."""

import socket
import threading
import time

import requests

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1,
    max_queued_requests=1,
    graceful_shutdown_timeout_s=3,
    graceful_shutdown_wait_loop_s=0.5,
    health_check_period_s=1,
    health_check_timeout_s=5,
)
class Slow:
    def __init__(self, gate):
        self.gate = gate

    def __call__(self, request=None):
        while not ray.get(self.gate.is_open.remote()):
            time.sleep(0.05)
        return "done"


@ray.remote(num_cpus=0)
class Gate:
    def __init__(self):
        self.opened = False

    def open(self):
        self.opened = True

    def close(self):
        self.opened = False

    def is_open(self):
        return self.opened


print(Slow.max_ongoing_requests, Slow.max_queued_requests)

ray.init(num_cpus=2)
port = free_port()
serve.start(http_options={"host": "127.0.0.1", "port": port})
gate = Gate.remote()
h = serve.run(Slow.bind(gate), name="slow", route_prefix="/slow")
first = h.remote()
time.sleep(1.0)
second = h.remote()
time.sleep(1.0)
try:
    h.remote().result()
except BackPressureError as e:
    print("third request:", type(e).__name__)
ray.get(gate.open.remote())
print(first.result(), second.result())

# The proxy's own handle has the same limits: one running, one queued, the next a 503.
ray.get(gate.close.remote())
codes = {}


def get(i):
    codes[i] = requests.get(f"http://127.0.0.1:{port}/slow", timeout=60).status_code


threads = []
for i in range(3):
    t = threading.Thread(target=get, args=(i,))
    t.start()
    threads.append(t)
    time.sleep(1.0)
print("third http request:", codes.get(2))
ray.get(gate.open.remote())
for t in threads:
    t.join()
print("http status codes:", [codes[i] for i in range(3)])
serve.shutdown()
ray.shutdown()
