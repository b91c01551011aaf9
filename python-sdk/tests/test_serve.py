"""tpuray.serve on a real local cluster (the session's in-process one, and a CLI cluster
with simulated TPU chips for the TPU and `tpuray serve status` case).

Replicas ask for no CPU (``num_cpus: 0``) so that the 4-CPU test cluster can hold them
all. Waits have generous timeouts; nothing asserts on speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import tpuray as ray
from tpuray import serve
from tpuray.serve.exceptions import RayServeException, ReplicaDiedError

NO_CPU = {"num_cpus": 0}


@pytest.fixture(scope="module")
def serve_instance(cluster):
    """Yields a function giving the HTTP proxy's port, once an application with a route
    runs. Port 0: the proxy binds a free port itself (a port picked here and bound
    later could be taken in between, by an outgoing connection's ephemeral port)."""
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    yield lambda: _wait_for(lambda: serve.status().http["port"], 60, "the HTTP proxy's port")
    serve.shutdown()


def _wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def _replicas(app, dep, state="RUNNING"):
    a = serve.status().applications.get(app)
    if a is None or dep not in a.deployments:
        return []
    return [r for r in a.deployments[dep].replicas if state is None or r["state"] == state]


def _http(port, path, body=None, raw=None, method=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


# ---- options (no cluster needed) ----


def test_bad_deployment_options_name_the_option_and_what_is_expected():
    with pytest.raises(TypeError, match="unknown deployment option 'num_replica'"):
        serve.deployment(num_replica=2)(lambda: None)

    def f():
        return 1

    with pytest.raises(ValueError, match="num_replicas is not allowed when autoscaling_config"):
        serve.deployment(num_replicas=2, autoscaling_config={"max_replicas": 2})(f)
    with pytest.raises(ValueError, match="unknown autoscaling_config key 'max'"):
        serve.deployment(autoscaling_config={"max": 2})(f)
    with pytest.raises(ValueError, match="max_replicas .* must be >= min_replicas"):
        serve.deployment(autoscaling_config={"min_replicas": 3, "max_replicas": 2})(f)
    with pytest.raises(ValueError, match="request_router must be one of"):
        serve.deployment(request_router="round_robin")(f)
    with pytest.raises(ValueError, match="ray_actor_options keys \\['max_restarts'\\]"):
        serve.deployment(ray_actor_options={"max_restarts": 2})(f)
    with pytest.raises(TypeError, match="num_replicas must be a integer|num_replicas must be an integer"):
        serve.deployment(num_replicas=1.5)(f)
    d = serve.deployment(f)
    with pytest.raises(TypeError, match="call f.bind"):
        serve.run(d)
    with pytest.raises(ValueError, match="route_prefix must start with '/'"):
        serve.run(d.bind(), route_prefix="api")
    with pytest.raises(RuntimeError, match="Use `.bind\\(\\)` instead"):
        d()
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        serve.batch(max_batch_size=0)
    with pytest.raises(TypeError, match="unknown handle option"):
        serve.DeploymentHandle("x").options(strem=True)


# ---- composition, handles, streaming, HTTP ----


@serve.deployment(ray_actor_options=NO_CPU)
class Doubler:
    def __call__(self, x):
        return 2 * x

    def pid(self):
        return os.getpid()

    async def count(self, n):
        for i in range(n):
            await asyncio.sleep(0)
            yield i


@serve.deployment(ray_actor_options=NO_CPU, num_replicas=2)
class Front:
    def __init__(self, doubler, offset):
        self.doubler = doubler
        self.offset = offset

    async def __call__(self, request):
        if isinstance(request, serve.Request):
            body = await request.json()
            if body.get("fail"):
                raise ValueError("asked to fail")
            if body.get("stream"):
                return self.stream_words(body["n"])
            x = body["x"]
        else:
            x = request
        doubled = await self.doubler.remote(x)
        ctx = serve.get_replica_context()
        return {"y": doubled + self.offset, "app": ctx.app_name, "deployment": ctx.deployment}

    def stream_words(self, n):
        for i in range(n):
            yield {"i": i}

    async def chain(self, x):
        # A response passed on into another call, without awaiting it here.
        first = self.doubler.remote(x)
        return await self.doubler.remote(first)

    async def stream_from_downstream(self, n):
        out = []
        async for i in self.doubler.options(stream=True).count.remote(n):
            out.append(i)
        return out


def test_composition_handles_streaming_and_http(serve_instance, cluster):
    """SERVE-3: a plain deployment gets a Starlette Request over HTTP; a handler that raises
    is a 500 naming the error, and the proxy keeps serving."""
    h = serve.run(Front.bind(Doubler.bind(), offset=1), name="comp", route_prefix="/comp")
    port = serve_instance()
    assert h.remote(5).result(timeout_s=60)["y"] == 11
    assert h.chain.remote(3).result(timeout_s=60) == 12
    assert h.stream_from_downstream.remote(4).result(timeout_s=60) == [0, 1, 2, 3]
    assert list(h.options(stream=True).stream_words.remote(3)) == [{"i": 0}, {"i": 1}, {"i": 2}]
    # A response passed from the driver into another handle call is resolved to its value.
    d = serve.get_deployment_handle("Doubler", "comp")
    assert d.remote(d.remote(d.remote(1))).result(timeout_s=60) == 8
    with pytest.raises(TypeError, match="only as a top-level argument"):
        d.remote([d.remote(1)]).result(timeout_s=60)
    with pytest.raises(TypeError, match="not a generator: call it without stream=True"):
        list(d.options(stream=True).remote(1))

    async def use_async():
        return await h.remote(2)

    assert asyncio.run(use_async())["y"] == 5

    st, ctype, body = _http(port, "/comp", {"x": 2})
    assert (st, ctype) == (200, "application/json")
    assert json.loads(body) == {"y": 5, "app": "comp", "deployment": "Front"}
    st, _, body = _http(port, "/comp/sub/path?q=1", {"x": 0})
    assert st == 200 and json.loads(body)["y"] == 1
    st, ctype, body = _http(port, "/comp", {"stream": True, "n": 3})
    assert (st, ctype) == (200, "application/x-ndjson")
    assert [json.loads(line) for line in body.splitlines()] == [{"i": 0}, {"i": 1}, {"i": 2}]
    st, ctype, body = _http(port, "/nothing-here", {"x": 1})
    assert st == 404 and ctype == "application/json"
    assert "'/nothing-here' not found" in json.loads(body)["error"]
    assert "/comp" in json.loads(body)["routes"]
    # As in Ray, the body reaches the handler as it came: await request.json() raises.
    st, _, body = _http(port, "/comp", raw=b"{not json")
    assert st == 500 and body.splitlines()[0] == b"Internal Server Error"
    assert b"JSONDecodeError" in body
    st, _, body = _http(port, "/comp", {"fail": True})
    assert st == 500
    assert body.decode().splitlines() == ["Internal Server Error", "ValueError: asked to fail"]
    # The proxy is still up after the bad requests.
    assert _http(port, "/comp", {"x": 1})[0] == 200
    assert json.loads(_http(port, "/-/routes")[2]) == {"/comp": "comp"}

    s = serve.status()
    app = s.applications["comp"]
    assert app.status == "RUNNING" and app.route_prefix == "/comp"
    assert app.deployments["Front"].replica_states == {"RUNNING": 2}
    assert app.deployments["Doubler"].replica_states == {"RUNNING": 1}
    assert serve.get_app_handle("comp").remote(1).result(timeout_s=60)["y"] == 3
    with pytest.raises(RayServeException, match="Application 'nope' does not exist"):
        serve.get_app_handle("nope")
    with pytest.raises(RayServeException, match="only be called from within"):
        serve.get_replica_context()

    # `tpuray serve status` reads the same document from the head's KV.
    def cli_status():
        r = subprocess.run([sys.executable, "-m", "tpuray", "serve", "status",
                            "--address", cluster["head_address"]],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout if "Front:" in r.stdout and "RUNNING: 2" in r.stdout else None

    out = _wait_for(cli_status, 30, "tpuray serve status")
    assert "applications:\n  comp:\n    status: RUNNING\n" in out, out
    assert "route_prefix: /comp" in out and "Doubler:" in out and "replica_id:" in out, out

    serve.delete("comp")
    assert "comp" not in serve.status().applications
    st, _, _ = _http(port, "/comp", {"x": 1})
    assert st == 404


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=1, max_queued_requests=1)
class Slow:
    def __call__(self, s):
        time.sleep(s)
        return serve.get_replica_context().replica_tag


def test_redeploy_route_conflicts_backpressure_and_deleted_deployments(serve_instance):
    h = serve.run(Slow.bind(), name="slow", route_prefix="/slow")
    first = {r["replica_id"] for r in _replicas("slow", "Slow")}
    # Same code, more replicas: the first replica stays, one more starts.
    serve.run(Slow.options(num_replicas=2).bind(), name="slow", route_prefix="/slow")
    now = {r["replica_id"] for r in _replicas("slow", "Slow")}
    assert len(now) == 2 and first <= now
    with pytest.raises(ValueError, match="route_prefix '/slow' is already used by application 'slow'"):
        serve.run(Slow.bind(), name="other", route_prefix="/slow")
    serve.run(Slow.options(num_replicas=1).bind(), name="slow", route_prefix="/slow")
    _wait_for(lambda: len(_replicas("slow", "Slow", None)) == 1, 60, "one replica")
    # One running, one queued: a third is refused at once.
    running = h.remote(2)
    queued = h.remote(0)
    with pytest.raises(serve.exceptions.BackPressureError, match="max_queued_requests=1"):
        h.remote(0).result(timeout_s=30)
    assert running.result(timeout_s=60) == queued.result(timeout_s=60)
    serve.delete("slow")
    with pytest.raises(serve.exceptions.DeploymentUnavailableError, match="does not exist"):
        h.remote(0).result(timeout_s=30)


@serve.deployment(ray_actor_options=NO_CPU, user_config={"greeting": "hi"})
class Configured:
    def reconfigure(self, config):
        self.greeting = config["greeting"]

    async def __call__(self, request):
        name = request.query_params.get("name", "you")
        if request.url.path.endswith("/bytes"):
            return f"{self.greeting} {name}".encode()
        return f"{self.greeting} {name}"


def test_user_config_reaches_reconfigure_and_text_and_bytes_go_back_as_they_are(serve_instance):
    serve.run(Configured.bind(), name="conf", route_prefix="/conf")
    port = serve_instance()
    st, ctype, body = _http(port, "/conf?name=ann")
    assert (st, ctype, body) == (200, "text/plain; charset=utf-8", b"hi ann")
    st, ctype, body = _http(port, "/conf/bytes")
    assert (st, ctype, body) == (200, "text/plain", b"hi you")  # Ray's type for bytes
    before = [r["replica_id"] for r in _replicas("conf", "Configured")]
    serve.run(Configured.options(user_config={"greeting": "hello"}).bind(), name="conf",
              route_prefix="/conf")
    # Applied in place: serve.run returns once reconfigure ran, on the same replica.
    assert _http(port, "/conf?name=bo")[2] == b"hello bo"
    assert [r["replica_id"] for r in _replicas("conf", "Configured")] == before
    serve.delete("conf")


# ---- batching ----


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=16)
class Batcher:
    def __init__(self):
        self.sizes = []

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=30)
    async def big_wait(self, xs):
        self.sizes.append(len(xs))
        return [(x, len(xs)) for x in xs]

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.5)
    async def short_wait(self, xs):
        return [(x, len(xs), time.monotonic()) for x in xs]

    def stamp(self):
        return time.monotonic()


def test_batching_sends_at_size_n_or_after_timeout(serve_instance):
    h = serve.run(Batcher.bind(), name="batch", route_prefix=None)
    # Four requests fill a batch: sent at once, long before the 30 s timeout.
    rs = [h.big_wait.remote(i) for i in range(4)]
    assert sorted(r.result(timeout_s=20) for r in rs) == [(i, 4) for i in range(4)]
    # Six requests: a batch of four at once, then the other two after the timeout.
    rs = [h.short_wait.remote(i) for i in range(6)]
    out = [r.result(timeout_s=30) for r in rs]
    assert sorted(n for _, n, _ in out) == [2, 2, 4, 4, 4, 4]
    # A lone request waits the timeout (0.5 s, measured on the replica) and goes alone.
    t0 = h.stamp.remote().result(timeout_s=30)
    x, n, t1 = h.short_wait.remote(9).result(timeout_s=30)
    assert (x, n) == (9, 1)
    assert t1 - t0 >= 0.5
    serve.delete("batch")


# ---- autoscaling ----


@serve.deployment(
    ray_actor_options=NO_CPU,
    max_ongoing_requests=2,
    autoscaling_config={"min_replicas": 0, "max_replicas": 3, "target_ongoing_requests": 1,
                        "upscale_delay_s": 0, "downscale_delay_s": 1},
    graceful_shutdown_timeout_s=2,
)
class Scaled:
    def __call__(self, s):
        time.sleep(s)
        return serve.get_replica_context().replica_tag

    def stream(self, n, s):
        for i in range(n):
            time.sleep(s)
            yield i


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
def test_autoscaling_goes_up_under_load_and_back_to_zero(serve_instance, streaming):
    app = f"scale-{streaming}"
    h = serve.run(Scaled.bind(), name=app, route_prefix=None)
    assert _replicas(app, "Scaled", None) == []  # min_replicas 0: nothing runs idle
    seen = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.add(len(_replicas(app, "Scaled")))
            time.sleep(0.2)

    w = threading.Thread(target=watch)
    w.start()
    try:
        if streaming:
            gens = [h.options(stream=True).stream.remote(8, 0.4) for _ in range(6)]
            assert all(list(g) == list(range(8)) for g in gens)
        else:
            rs = [h.remote(3.0) for _ in range(6)]
            assert len({r.result(timeout_s=120) for r in rs}) >= 1
    finally:
        stop.set()
        w.join()
    assert max(seen) >= 2, f"replica counts seen under load: {sorted(seen)}"
    _wait_for(lambda: _replicas(app, "Scaled", None) == [], 60, "scale down to zero")
    a = serve.status().applications[app].deployments["Scaled"]
    assert a.target_replicas == 0 and a.status == "HEALTHY"
    # From zero again: a request brings a replica back.
    if streaming:
        assert list(h.options(stream=True).stream.remote(2, 0)) == [0, 1]
    else:
        assert isinstance(h.remote(0).result(timeout_s=60), str)
    serve.delete(app)


# ---- failures ----


@serve.deployment(ray_actor_options=NO_CPU, num_replicas=2, health_check_period_s=0.5,
                  health_check_timeout_s=5, max_ongoing_requests=10)
class Sleeper:
    def __init__(self):
        self.sick = False

    def __call__(self, s):
        time.sleep(s)
        return os.getpid()

    def pid(self):
        return os.getpid()

    def make_sick(self):
        self.sick = True
        return os.getpid()

    def make_stuck(self):
        self.stuck = True
        return os.getpid()

    def check_health(self):
        if self.sick:
            raise RuntimeError("sick on purpose")
        if getattr(self, "stuck", False):
            time.sleep(60)

    def stream_pid(self, n):
        yield os.getpid()
        for i in range(n):
            time.sleep(0.2)
            yield i


def test_sigkilled_replica_is_replaced_and_in_flight_requests_retry_or_fail_clearly(serve_instance):
    h = serve.run(Sleeper.bind(), name="kill", route_prefix=None)
    before = {r["replica_id"]: r["pid"] for r in _replicas("kill", "Sleeper")}
    assert len(before) == 2
    victim = next(iter(before.values()))
    rs = [h.remote(1.5) for _ in range(8)]
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    ok, failed = [], []
    for r in rs:
        try:
            ok.append(r.result(timeout_s=90))
        except ReplicaDiedError as e:  # a clear error is allowed; a hang is not
            failed.append(str(e))
    assert len(ok) + len(failed) == 8
    assert victim not in ok or len(ok) < 8
    assert len(ok) >= 1, failed
    # The controller starts a replacement: two RUNNING again, the victim gone.
    after = _wait_for(
        lambda: (lambda rs: rs if len(rs) == 2 and victim not in [r["pid"] for r in rs] else None)(
            _replicas("kill", "Sleeper")), 60, "a replacement replica")
    assert len({r["replica_id"] for r in after} - set(before)) == 1
    assert all(isinstance(h.remote(0).result(timeout_s=60), int) for _ in range(4))

    # A stream whose replica dies after its first item fails with a clear error.
    gen = h.options(stream=True).stream_pid.remote(1000)
    pid = next(gen)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ReplicaDiedError, match="broke after"):
        for _ in gen:
            pass
    _wait_for(lambda: len(_replicas("kill", "Sleeper")) == 2 and pid not in
              [r["pid"] for r in _replicas("kill", "Sleeper")], 60, "a replacement replica")

    # A replica whose own check_health raises is replaced too.
    sick = h.make_sick.remote().result(timeout_s=60)
    _wait_for(lambda: sick not in [r["pid"] for r in _replicas("kill", "Sleeper", None)], 60,
              "the unhealthy replica to go")
    _wait_for(lambda: len(_replicas("kill", "Sleeper")) == 2, 60, "two replicas again")
    # So is one whose check_health does not answer within health_check_timeout_s.
    stuck = h.make_stuck.remote().result(timeout_s=60)
    _wait_for(lambda: stuck not in [r["pid"] for r in _replicas("kill", "Sleeper", None)], 60,
              "the stuck replica to go")
    _wait_for(lambda: len(_replicas("kill", "Sleeper")) == 2, 60, "two replicas again")
    serve.delete("kill")


@serve.deployment(ray_actor_options=NO_CPU, health_check_period_s=0.3, health_check_timeout_s=5)
class Leaf:
    def __call__(self, x):
        return x + 1

    def pid(self):
        return os.getpid()


@serve.deployment(ray_actor_options=NO_CPU, health_check_period_s=0.3, health_check_timeout_s=5)
class Trunk:
    def __init__(self, leaf):
        self.leaf = leaf

    async def __call__(self, x):
        return {"value": await self.leaf.remote(x), "trunk": os.getpid()}

    async def leaf_pid(self):
        return await self.leaf.pid.remote()


def test_a_dead_downstream_replica_never_gets_a_healthy_upstream_replaced(serve_instance):
    """SERVE-1: a replica's health is its own: a dead downstream replica is replaced, the
    healthy upstream one is kept."""
    h = serve.run(Trunk.bind(Leaf.bind()), name="tree", route_prefix=None)
    trunk_before = [r["replica_id"] for r in _replicas("tree", "Trunk")]
    trunk_pid = h.remote(1).result(timeout_s=60)["trunk"]
    leaf_pid = h.leaf_pid.remote().result(timeout_s=60)
    os.kill(leaf_pid, signal.SIGKILL)
    # Requests through the upstream go on: retried on the replacement, or a clear error.
    results = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len([r for r in results if r == 2]) < 5:
        try:
            out = h.remote(1).result(timeout_s=60)
            results.append(out["value"])
            assert out["trunk"] == trunk_pid
        except ReplicaDiedError:
            results.append("died")
        except ray.exceptions.RayTaskError as e:
            assert "ReplicaDiedError" in str(e) or "died" in str(e), e
            results.append("died")
        time.sleep(0.1)
    assert results.count(2) >= 5, results
    _wait_for(lambda: len(_replicas("tree", "Leaf")) == 1, 60, "a new Leaf replica")
    assert h.leaf_pid.remote().result(timeout_s=60) != leaf_pid
    # Several health-check periods later the upstream replica is still the same one.
    time.sleep(1.5)
    assert [r["replica_id"] for r in _replicas("tree", "Trunk")] == trunk_before
    assert h.remote(1).result(timeout_s=60)["trunk"] == trunk_pid
    serve.delete("tree")


@serve.deployment(ray_actor_options=NO_CPU, num_replicas=2, health_check_period_s=0.3)
class Adoptee:
    def __call__(self, x):
        return (x.json_body if isinstance(x, serve.Request) else x) + 1


def test_a_killed_controller_restarts_and_adopts_the_running_replicas(serve_instance):
    """SERVE-2: a killed controller restarts and adopts the running replicas; serving goes
    on meanwhile."""
    h = serve.run(Adoptee.bind(), name="adopt", route_prefix="/adopt")
    port = serve_instance()
    before = sorted(r["replica_id"] for r in _replicas("adopt", "Adoptee"))
    old_pid = serve.status().to_dict()["controller"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    # Serving does not stop meanwhile: the replicas and the proxy are not the controller.
    assert h.remote(1).result(timeout_s=60) == 2
    assert _http(port, "/adopt", 1)[2] == b"2"

    def restarted():
        try:
            doc = serve.status().to_dict()
        except Exception:  # noqa: BLE001 - the controller is restarting
            return None
        return doc if doc["controller"]["pid"] != old_pid else None

    doc = _wait_for(restarted, 60, "the controller to restart")
    assert doc["applications"]["adopt"]["status"] == "RUNNING"
    assert sorted(r["replica_id"] for r in _replicas("adopt", "Adoptee")) == before
    # The new controller manages them: a killed replica is replaced.
    victim = _replicas("adopt", "Adoptee")[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    _wait_for(lambda: len(_replicas("adopt", "Adoptee")) == 2 and victim not in
              [r["pid"] for r in _replicas("adopt", "Adoptee")], 60, "a replacement replica")
    serve.delete("adopt")


@serve.deployment(ray_actor_options=NO_CPU)
class Broken:
    def __init__(self):
        raise ValueError("constructor says no")


def test_a_constructor_that_raises_fails_the_deploy_with_its_error(serve_instance):
    with pytest.raises(RayServeException, match="constructor says no"):
        serve.run(Broken.bind(), name="broken", route_prefix=None)
    assert serve.status().applications["broken"].status == "DEPLOY_FAILED"
    # Requests to it fail with the reason instead of waiting for a replica forever.
    with pytest.raises(serve.exceptions.DeploymentUnavailableError, match="constructor says no"):
        serve.get_deployment_handle("Broken", "broken").remote().result(timeout_s=30)
    serve.delete("broken")


# ---- prefix affinity ----


@serve.deployment(ray_actor_options=NO_CPU, num_replicas=3, request_router="prefix_affinity",
                  request_router_kwargs={"prefix_chars": 16})
class Llm:
    def __call__(self, request):
        return serve.get_replica_context().replica_tag


def test_prefix_affinity_sends_a_shared_prompt_prefix_to_one_replica(serve_instance):
    h = serve.run(Llm.bind(), name="llm", route_prefix=None)
    system = "You are a helpful assistant. "
    same = {h.remote({"prompt": system + f"question {i}"}).result(timeout_s=60) for i in range(12)}
    assert len(same) == 1
    spread = {h.remote(f"{i:04d} unrelated prompt text").result(timeout_s=60) for i in range(24)}
    assert len(spread) >= 2
    serve.delete("llm")


# ---- TPU chips per replica, and `tpuray serve status` after the driver left ----

_TPU_DRIVER = r"""
import json, os, sys
import tpuray as ray
from tpuray import serve

ray.init(address=sys.argv[1])

@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0, "resources": {"TPU": 2}})
def chips(_):
    return os.environ.get("TPU_VISIBLE_CHIPS")

h = serve.run(chips.bind(), name="tpu", route_prefix=None)
print(json.dumps(sorted({h.remote(None).result(timeout_s=60) for _ in range(20)})))
"""

_SHUTDOWN_DRIVER = r"""
import sys
import tpuray as ray
from tpuray import serve
ray.init(address=sys.argv[1])
print(sorted(serve.status().applications))
serve.shutdown()
"""


def test_replicas_get_their_own_tpu_chips_and_serve_status_outlives_the_driver(tmp_path):
    from conftest import CliCluster

    c = CliCluster(tmp_path).head(num_cpus=2)
    try:
        c.node("--num-cpus", "1", "--resources", '{"TPU": 4}')
        env = dict(c.env)
        r = subprocess.run([sys.executable, "-c", _TPU_DRIVER, c.address], env=env,
                           capture_output=True, text=True, timeout=150)
        assert r.returncode == 0, r.stderr[-3000:]
        chips = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(chips) == 2 and sorted(",".join(chips).split(",")) == ["0", "1", "2", "3"], chips
        s = subprocess.run(CliCluster.CLI + ["serve", "status", "--address", c.address], env=env,
                           capture_output=True, text=True, timeout=60)
        assert s.returncode == 0, s.stderr
        assert "  tpu:\n    status: RUNNING\n" in s.stdout and "RUNNING: 2" in s.stdout, s.stdout
        j = subprocess.run(CliCluster.CLI + ["serve", "status", "--json", "--address", c.address],
                           env=env, capture_output=True, text=True, timeout=60)
        doc = json.loads(j.stdout)
        assert doc["applications"]["tpu"]["deployments"]["chips"]["replica_states"] == {"RUNNING": 2}
        r = subprocess.run([sys.executable, "-c", _SHUTDOWN_DRIVER, c.address], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "['tpu']" in r.stdout, r.stderr[-3000:]
        s = subprocess.run(CliCluster.CLI + ["serve", "status", "--address", c.address], env=env,
                           capture_output=True, text=True, timeout=60)
        assert "no serve application is running" in s.stdout, s.stdout
    finally:
        c.stop()


# ---- tpuray serve build / deploy / run (Ray's config schema) ----

_CLI_APP = '''
from tpuray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0}, user_config={"word": "hi"})
class Greeter:
    def reconfigure(self, config):
        self.word = config["word"]

    def __call__(self, name="you"):
        return f"{self.word} {name}"


app = Greeter.bind()


def builder(args):
    return Greeter.options(user_config={"word": args.get("word", "yo")}).bind()
'''

_CLI_CHECK = r"""
import sys
import tpuray as ray
from tpuray import serve
ray.init(address=sys.argv[1])
print(serve.status().applications[sys.argv[2]].status)
print(serve.get_app_handle(sys.argv[2]).remote("ann").result(timeout_s=60))
if len(sys.argv) > 3:
    serve.shutdown()
"""

def test_cli_help_names_every_serve_verb_and_the_python_verbs_print_their_arguments():
    cli = [sys.executable, "-m", "tpuray"]

    def out(*args):
        r = subprocess.run(cli + list(args), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    top = [line for line in out("--help").splitlines() if line.strip().startswith("serve ")]
    assert top and all(v in top[0] for v in ("status", "run", "deploy", "build")), top
    text = out("serve", "--help")
    for verb in ("status", "run", "deploy", "build"):
        assert f"\n  {verb} " in text, text
    assert "tpuray serve run --help" in text, text
    run = out("serve", "run", "--help")
    assert "usage: tpuray serve run" in run and "--non-blocking" in run and "key=value" in run, run
    deploy = out("serve", "help", "deploy")
    assert "usage: tpuray serve deploy" in deploy and "declarative" in deploy, deploy
    assert "--output-path" in out("serve", "build", "--help")
    assert "--json" in out("serve", "status", "--help")


_CLI_APPS = r"""
import json, sys
import tpuray as ray
from tpuray import serve
from tpuray.serve import _common
ray.init(address=sys.argv[1])
doc = ray.get(_common.get_controller().status.remote())
print(json.dumps({n: {"source": a["source"], "message": a["message"]}
                  for n, a in doc["applications"].items() if a["status"] != "DELETING"}))
if len(sys.argv) > 2:
    serve.shutdown()
"""



def test_cli_build_deploy_and_run_use_rays_config_schema(tmp_path):
    import yaml
    from conftest import CliCluster

    (tmp_path / "cliapp.py").write_text(_CLI_APP)
    c = CliCluster(tmp_path).head(num_cpus=2)
    try:
        env = dict(c.env, PYTHONPATH=str(tmp_path) + os.pathsep + c.env.get("PYTHONPATH", ""))

        def cli(*args, timeout=150):
            return subprocess.run(CliCluster.CLI + list(args), env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=timeout)

        cfg = tmp_path / "serve.yaml"
        r = cli("serve", "build", "cliapp:app", "-o", str(cfg))
        assert r.returncode == 0, r.stderr
        doc = yaml.safe_load(cfg.read_text())
        assert doc["applications"][0]["import_path"] == "cliapp:app"
        assert doc["applications"][0]["deployments"][0]["name"] == "Greeter"
        doc["http_options"] = {"host": "127.0.0.1", "port": 0}
        doc["applications"][0].update(name="greet", route_prefix=None)
        doc["applications"][0]["deployments"][0]["user_config"] = {"word": "hello"}
        cfg.write_text(yaml.safe_dump(doc))
        r = cli("serve", "deploy", str(cfg), "--address", c.address)
        assert r.returncode == 0, r.stderr[-3000:]
        r = subprocess.run([sys.executable, "-c", _CLI_CHECK, c.address, "greet"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["ApplicationStatus.RUNNING", "hello ann"], \
            r.stdout + r.stderr[-3000:]
        s = cli("serve", "status", "--address", c.address)
        assert "greet:\n    status: RUNNING" in s.stdout, s.stdout
        # A builder with key=value arguments, not blocking.
        r = cli("serve", "run", "cliapp:builder", "word=hey", "--name", "built", "--non-blocking",
                "--address", c.address)
        assert r.returncode == 0, r.stderr[-3000:]
        r = subprocess.run([sys.executable, "-c", _CLI_CHECK, c.address, "built"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "hey ann" in r.stdout, r.stdout + r.stderr[-3000:]
        # `serve deploy` is declarative, as Ray's apply_config: the applications an earlier
        # config deployed that this one omits (greet) are deleted, those `serve run` /
        # serve.run deployed (built) stay. Other http_options than the running ones are
        # kept, with a warning naming them.
        other = tmp_path / "other.yaml"
        other.write_text(yaml.safe_dump({
            "http_options": {"host": "127.0.0.1", "port": 1},
            "applications": [{"name": "other", "route_prefix": None, "import_path": "cliapp:app"}]}))
        r = cli("serve", "deploy", str(other), "--address", c.address)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "deleting applications ['greet']" in r.stdout, r.stdout
        assert "http_options" in r.stderr and "'port'" in r.stderr, r.stderr[-3000:]
        r = subprocess.run([sys.executable, "-c", _CLI_APPS, c.address], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        apps = json.loads(r.stdout)
        assert apps.keys() == {"built", "other"}, apps
        assert apps["other"]["source"] == "declarative" and "'port'" in apps["other"]["message"], apps
        assert apps["built"]["source"] == "imperative", apps
        # Deploying a config again that omits `other` deletes it; `built` still stays.
        r = cli("serve", "deploy", str(cfg), "--address", c.address)
        assert r.returncode == 0 and "deleting applications ['other']" in r.stdout, r.stdout + r.stderr[-3000:]
        r = subprocess.run([sys.executable, "-c", _CLI_APPS, c.address, "stop"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and json.loads(r.stdout).keys() == {"built", "greet"}, r.stdout + r.stderr[-3000:]
        # Bad input names what is wrong.
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump({"applications": [{"import_path": "cliapp:app", "colour": 1}]}))
        r = cli("serve", "deploy", str(bad), "--address", c.address)
        assert r.returncode == 1 and "unknown application keys ['colour']" in r.stderr, r.stderr
    finally:
        c.stop()


# ---- a replica that needs a whole TPU slice (placement_group_bundles) ----

_SLICE_DRIVER = r"""
import json, os, sys, threading, time
import tpuray as ray
from tpuray import serve

ray.init(address=sys.argv[1])
go = sys.argv[2]


@ray.remote(num_cpus=0, resources={"TPU": 4})
def host():
    return ray.get_runtime_context().get_node_id()


@serve.deployment(
    num_replicas=2,
    ray_actor_options={"num_cpus": 0},
    placement_group_bundles=[{"TPU": 4, "TPU-v6e-16-head": 1}] + [{"TPU": 4}] * 3,
    placement_group_strategy="STRICT_SPREAD",
)
class SliceModel:
    def gang(self):
        from tpuray.util.placement_group import get_current_placement_group
        from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        nodes = ray.get([host.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
                         for i in range(4)])
        return serve.get_replica_context().replica_tag, nodes


def states():
    a = serve.status().applications.get("slices")
    if a is None or "SliceModel" not in a.deployments:
        return {}
    return dict(a.deployments["SliceModel"].replica_states)


done = threading.Event()
threading.Thread(target=lambda: (serve.run(SliceModel.bind(), name="slices", route_prefix=None), done.set()),
                 daemon=True).start()
deadline = time.monotonic() + 120
while states() != {"RUNNING": 1, "STARTING": 1} and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(3)  # still waiting: one slice only
print("ONE_SLICE " + json.dumps(states()), flush=True)
while not os.path.exists(go):
    time.sleep(0.2)
assert done.wait(180), states()
h = serve.get_app_handle("slices")
gangs = {}
for _ in range(60):
    rid, nodes = h.gang.remote().result(timeout_s=60)
    gangs[rid] = nodes
    if len(gangs) == 2:
        break
print("GANGS " + json.dumps(gangs), flush=True)
serve.shutdown()
"""


def test_a_replica_gets_a_whole_slice_as_a_gang_and_the_next_waits_for_another(tmp_path):
    """SCHED-15: a replica's slice group takes every host of one intact slice; the next
    replica waits for another slice."""
    from conftest import CliCluster

    c = CliCluster(tmp_path).head(num_cpus=1)
    try:
        c.tpu_slice("sa")
        go = tmp_path / "go"
        p = subprocess.Popen([sys.executable, "-c", _SLICE_DRIVER, c.address, str(go)], env=c.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = p.stdout.readline()
            assert line.startswith("ONE_SLICE "), line + p.stderr.read()[-3000:]
            assert json.loads(line[10:]) == {"RUNNING": 1, "STARTING": 1}
            c.tpu_slice("sb")
            go.write_text("")
            line = p.stdout.readline()
            assert line.startswith("GANGS "), line + p.stderr.read()[-3000:]
            gangs = json.loads(line[6:])
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
        r = subprocess.run([sys.executable, "-c", "import sys, json, tpuray as ray\n"
                            "ray.init(address=sys.argv[1])\n"
                            "print(json.dumps({n['NodeID']: (n.get('Labels') or {}).get('tpuray.io/tpu-slice-name')"
                            " for n in ray.nodes()}))", c.address],
                           env=c.env, capture_output=True, text=True, timeout=120)
        slice_of = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(gangs) == 2
        seen = []
        for nodes in gangs.values():
            assert len(set(nodes)) == 4, nodes  # four hosts ...
            assert len({slice_of[n] for n in nodes}) == 1, nodes  # ... of one slice
            seen.append(slice_of[nodes[0]])
        assert sorted(seen) == ["sa", "sb"]
    finally:
        c.stop()


# ---- Ray's Serve REST API on the head's dashboard port ----

_REST_APP = '''
from tpuray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0}, user_config={"word": "hi"})
class Word:
    def reconfigure(self, config):
        self.word = config["word"]

    def __call__(self, request):
        return self.word


app = Word.bind()
'''

_START_SERVE = r"""
import sys
import tpuray as ray
from tpuray import serve
ray.init(address=sys.argv[1])
serve.start(http_options={"host": "127.0.0.1", "port": 0})
if len(sys.argv) > 2:
    import restapp
    serve.run(restapp.app, name=sys.argv[2], route_prefix=None)
"""


def test_rest_api_put_get_delete_applications(tmp_path):
    """SERVE-API-1: the head stores a declaration the controller applies; SERVE-API-2: 503
    without a controller; SERVE-API-3: GET reads as Ray's ServeInstanceDetails."""
    import socket

    from conftest import CliCluster

    (tmp_path / "restapp.py").write_text(_REST_APP)
    c = CliCluster(tmp_path)
    c.env["PYTHONPATH"] = str(tmp_path) + os.pathsep + c.env.get("PYTHONPATH", "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dash = s.getsockname()[1]
    c._start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(c.port), "--num-cpus", "2",
              "--dashboard-port", str(dash), "--temp-dir", str(tmp_path / "head")])
    try:
        token = (Path(c.env["HOME"]) / ".tpuray" / "auth_token").read_text().strip()
        url = f"http://127.0.0.1:{dash}/api/serve/applications/"

        def call(method, doc=None, auth=True):
            req = urllib.request.Request(url, method=method, data=None if doc is None else json.dumps(doc).encode(),
                                         headers={"Authorization": f"Bearer {token}"} if auth else {})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        # http_options other than the running ones: kept, with a warning (as Ray's dashboard).
        config = {"http_options": {"host": "127.0.0.1", "port": 1},
                  "applications": [{"name": "rest", "route_prefix": "/rest", "import_path": "restapp:app",
                                    "deployments": [{"name": "Word", "user_config": {"word": "declared"}}]}]}
        assert call("PUT", config, auth=False)[0] == 401
        st, body = call("PUT", {"applications": [{"name": "x"}]})
        assert st == 400 and b"import_path" in body, body
        st, body = call("PUT", config)
        assert st == 503 and b"no serve controller runs" in body, body
        r = subprocess.run([sys.executable, "-c", _START_SERVE, c.address], env=c.env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        _wait_for(lambda: call("GET")[0] == 200 and json.loads(call("GET")[1])["controller_info"], 60,
                  "the controller's status")
        # An application serve.run deployed (imperative): declarations leave it alone.
        r = subprocess.run([sys.executable, "-c", _START_SERVE, c.address, "imp"], env=c.env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        st, body = call("PUT", config)
        assert st == 200, body

        def app_state():
            # The proxy starts with the first application that has a route; until it is
            # HEALTHY, http_options shows the configured port (0 here), as Ray's shows its.
            doc = json.loads(call("GET")[1])
            a = doc["applications"].get("rest")
            proxies = doc["proxies"].values()
            healthy = proxies and all(p["status"] == "HEALTHY" for p in proxies)
            return a and a["status"] == "RUNNING" and healthy and doc

        doc = _wait_for(app_state, 120, "the declared application to run")
        assert doc["applications"]["rest"]["deployments"]["Word"]["name"] == "Word"
        assert doc["applications"]["rest"]["source"] == "declarative"
        msg = doc["applications"]["rest"]["message"]
        assert "http_options" in msg and "'port'" in msg, msg
        assert doc["applications"]["imp"]["source"] == "imperative", doc["applications"]
        assert doc["http_options"]["port"] != 1
        port = doc["http_options"]["port"]
        assert _http(port, "/rest")[2] == b"declared"
        # Ray's own client reads the details (its models refuse unknown fields): Ray 2.60
        # with ray[serve] in .ray-client-venv, which scripts/python-tests.sh makes.
        root = Path(__file__).resolve().parents[2]
        ray_py = Path(os.environ.get("RAY_CLIENT_VENV", root / ".ray-client-venv")) / "bin" / "python"
        assert ray_py.exists(), f"{ray_py} is missing: run scripts/python-tests.sh's setup"
        check = ("import sys, json\nfrom ray.serve.schema import ServeInstanceDetails\n"
                 "d = ServeInstanceDetails(**json.loads(sys.stdin.read()))\n"
                 "print(d.applications['rest'].status.value)")
        r = subprocess.run([str(ray_py), "-c", check], input=call("GET")[1].decode(),
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.strip() == "RUNNING", r.stderr[-3000:]
        # A bad import path: the application shows DEPLOY_FAILED with the error (as
        # Ray), while what ran before keeps serving.
        bad = {"applications": [{"name": "rest", "import_path": "restapp:nothing"}]}
        assert call("PUT", bad)[0] == 200
        a = _wait_for(lambda: json.loads(call("GET")[1])["applications"]["rest"]["status"] == "DEPLOY_FAILED"
                      and json.loads(call("GET")[1])["applications"]["rest"], 60, "the failed declaration")
        assert "nothing" in a["message"], a
        assert _http(port, "/rest")[2] == b"declared"
        # tpuray's own CLI through the REST API.
        (tmp_path / "cli.yaml").write_text(
            "applications:\n- name: viacli\n  route_prefix: /viacli\n  import_path: restapp:app\n")
        r = subprocess.run(CliCluster.CLI + ["serve", "deploy", str(tmp_path / "cli.yaml"), "--address",
                                             f"http://127.0.0.1:{dash}"], env=c.env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        _wait_for(lambda: (json.loads(call("GET")[1])["applications"].get("viacli") or {}).get("status")
                  == "RUNNING", 120, "the application tpuray's CLI declared")
        # Ray's own `serve deploy` and `serve status` against this head.
        (tmp_path / "ray.yaml").write_text(
            "applications:\n- name: viaray\n  route_prefix: /viaray\n  import_path: restapp:app\n")
        renv = {k: v for k, v in c.env.items() if not k.startswith(("TPURAY_", "RAY_", "PYTHONPATH"))}
        renv.update(HOME=str(tmp_path / "ray-home"), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        cli = [str(ray_py), "-c", "from ray.serve.scripts import cli; cli()"]
        r = subprocess.run(cli + ["deploy", str(tmp_path / "ray.yaml"), "-a", f"http://127.0.0.1:{dash}"],
                           env=renv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "Sent deploy request successfully" in r.stderr + r.stdout, r.stderr[-3000:]
        _wait_for(lambda: (json.loads(call("GET")[1])["applications"].get("viaray") or {}).get("status")
                  == "RUNNING", 120, "the application Ray's CLI declared")
        r = subprocess.run(cli + ["status", "-a", f"http://127.0.0.1:{dash}"], env=renv,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "viaray:\n    status: RUNNING" in r.stdout, r.stdout + r.stderr[-3000:]
        # The declaration named only viaray: rest was deleted (Ray's declarative update).
        assert "rest" not in json.loads(call("GET")[1])["applications"]
        # The imperative application outlived every declaration (Ray deletes only
        # applications of APIType.DECLARATIVE that a config omits).
        assert json.loads(call("GET")[1])["applications"]["imp"]["status"] == "RUNNING"
        assert call("DELETE")[0] == 200
        _wait_for(lambda: json.loads(call("GET")[1])["applications"] == {}, 120, "serve to shut down")
    finally:
        c.stop()


# ---- ASGI ingress: a Starlette app, a builder function, lifespan, streaming ----


def _starlette_app():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    from contextlib import asynccontextmanager

    state = {}

    @asynccontextmanager
    async def lifespan(app):
        state["started"] = True
        yield

    async def hello(request):
        return PlainTextResponse(f"started={state.get('started')} q={request.query_params.get('q')}")

    async def stream(request):
        async def gen():
            for i in range(3):
                yield f"{i};"
        return StreamingResponse(gen(), media_type="text/plain")

    return Starlette(routes=[Route("/hello", hello), Route("/stream", stream)], lifespan=lifespan)


@serve.deployment(ray_actor_options=NO_CPU)
@serve.ingress(_starlette_app)
class StarletteIngress:
    def plain(self):
        return "handle call"


def test_a_starlette_app_from_a_builder_serves_http_with_lifespan_and_streaming(serve_instance):
    """SERVE-3: an ingress deployment gets ASGI scopes under its route prefix and its app's
    lifespan runs in the replica."""
    h = serve.run(StarletteIngress.bind(), name="star", route_prefix="/star")
    port = serve_instance()
    assert _http(port, "/star/hello?q=1")[2] == b"started=True q=1"
    st, ctype, body = _http(port, "/star/stream")
    assert (st, body) == (200, b"0;1;2;") and ctype.startswith("text/plain")
    assert _http(port, "/star/none")[0] == 404
    assert h.plain.remote().result(timeout_s=60) == "handle call"
    with pytest.raises(ValueError, match="may not have __call__"):
        @serve.ingress(_starlette_app)
        class WithCall:
            def __call__(self):
                return 1
    serve.delete("star")
