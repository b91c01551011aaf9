"""The dashboard (head/src/dashboard.rs) in a real headless browser, and the timeline.

One cluster for the module: a head serving the dashboard on a port of its own, four
simulated v6e-16 hosts of slice ``sa`` (TPU.md's line: ``TPU_*`` env + ``{"TPU": 4}``),
a driver that holds a slice gang (``SliceActorGroup``, one actor per host on all its
chips), a named actor, finished, failed and running tasks, and a Jobs API job with output.

- Tokens (DASH-3): a page without the token is a login form; a wrong one is refused;
  the form and ``?token=`` set the ``ray-authentication-token`` cookie.
- Bad input (paths, queries, forms) gets pages or errors, and the head keeps serving.
- DASH-1: ``/`` names every node by id and address in the HTML itself (no script run).
- Browser (Debian's chromium through selenium + chromedriver): signs in through the
  form, loads every page without a console error, and finds the cluster's real nodes,
  slice hosts and chips held by the gang, actors, tasks, placement groups and jobs; the
  refresh script updates the page. ``TPURAY_UPDATE_SCREENSHOTS=1`` also writes
  ``docs/screenshots/{overview,slices}.png`` (the README shows them).
- Timeline: 1,000 tasks pinned to 3 nodes come back from ``tpuray.timeline()`` and
  ``tpuray timeline`` as 1,000 complete spans, each on the row of the node and worker
  that ran it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import CliCluster

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

HOLDER = """
import json, os, sys
import tpuray as ray
from tpuray.util import tpu

ray.init({addr!r})

@ray.remote
class Member:
    def where(self):
        return {{"worker": os.environ["TPU_WORKER_ID"], "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}}

group = tpu.SliceActorGroup(Member, topology="4x4", accelerator_version="v6e", name="train")
members = group.call("where")

@ray.remote
class Counter:
    def __init__(self):
        self.n = 0
    def inc(self):
        self.n += 1
        return self.n

counter = Counter.options(name="dash-counter").remote()
ray.get(counter.inc.remote(), timeout=60)

@ray.remote
def square(x):
    return x * x

ray.get([square.remote(i) for i in range(5)], timeout=60)

@ray.remote(max_retries=0)
def fails():
    raise ValueError("boom-for-the-dashboard <b>")

try:
    ray.get(fails.remote(), timeout=60)
except Exception:
    pass

@ray.remote
def sleepy():
    import time
    time.sleep(3600)

running = sleepy.remote()  # still RUNNING while the pages are read
print("JSON " + json.dumps({{"members": members, "job_id": ray.get_runtime_context().get_job_id()}}),
      flush=True)
sys.stdin.read()  # holds the gang and the actor until the test closes stdin
group.shutdown()
ray.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, token=None, method="GET", body=None, headers=None, cookie=None):
    """(status, headers, body text) without following redirects."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    if cookie is not None:
        h["Cookie"] = f"ray-authentication-token={cookie}"
    data = body.encode() if isinstance(body, str) else body
    r = urllib.request.Request(url, data=data, method=method, headers=h)
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(r, timeout=30) as resp:
            return resp.status, resp.headers, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode("utf-8", "replace")


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    c = CliCluster(tmp)
    port = free_port()
    holder = None
    try:
        c._start(["--head", "--node-ip-address", "127.0.0.1", "--port", str(c.port),
                  "--num-cpus", "2", "--dashboard-port", str(port),
                  "--temp-dir", str(tmp / "head")])
        c.tpu_slice("sa")
        url = f"http://127.0.0.1:{port}"
        token = (Path(c.env["HOME"]) / ".tpuray" / "auth_token").read_text().strip()
        script = tmp / "holder.py"
        script.write_text(textwrap.dedent(HOLDER.format(addr=c.address)))
        holder = subprocess.Popen([sys.executable, str(script)], env=c.env, cwd=tmp,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        line = ""
        deadline = time.time() + 180
        while time.time() < deadline:
            line = holder.stdout.readline()
            if line.startswith("JSON ") or not line:
                break
        assert line.startswith("JSON "), holder.stderr.read() if holder.poll() is not None else line
        held = json.loads(line[5:])
        status, _, body = http(f"{url}/api/jobs/", token, "POST",
                               json.dumps({"entrypoint": "echo hello-from-the-job; echo '<i>x</i>'"}),
                               {"Content-Type": "application/json"})
        assert status == 200, body
        sub = json.loads(body)["submission_id"]
        for _ in range(120):
            _, _, info = http(f"{url}/api/jobs/{sub}", token)
            if json.loads(info)["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(0.5)
        assert json.loads(info)["status"] == "SUCCEEDED", info
        nodes = json.loads(subprocess.run(
            CliCluster.CLI + ["list", "nodes", "--format", "json", "--address", c.address],
            env=c.env, capture_output=True, text=True, timeout=60, check=True).stdout)
        actors = json.loads(subprocess.run(
            CliCluster.CLI + ["list", "actors", "--format", "json", "--address", c.address],
            env=c.env, capture_output=True, text=True, timeout=60, check=True).stdout)
        yield {"url": url, "token": token, "cluster": c, "nodes": nodes, "actors": actors,
               "held": held, "submission": sub}
    finally:
        if holder is not None:
            try:
                holder.stdin.close()
                holder.wait(timeout=30)
            except Exception:
                holder.kill()
        c.stop()


def test_dash_3_pages_need_the_token_and_the_form_or_a_link_sets_the_cookie(dash):
    url, token = dash["url"], dash["token"]
    status, headers, _ = http(f"{url}/slices?x=1")
    assert status == 303 and headers["Location"] == "/login?next=%2Fslices%3Fx%3D1"
    status, _, body = http(f"{url}/login?next=%2Fslices%3Fx%3D1")
    assert status == 200 and '<form method="post" action="/login">' in body
    assert 'name="next" value="/slices?x=1"' in body
    status, _, body = http(f"{url}/", "not-the-token")
    assert status == 403 and "not this cluster" in body
    status, _, body = http(f"{url}/", cookie="wrong")
    assert status == 403
    status, _, body = http(f"{url}/static/dashboard.css")
    assert status == 303, "assets need the token too"
    # The API route answers Ray's texts, not the form.
    status, _, body = http(f"{url}/api/v0/tasks/timeline")
    assert (status, body) == (401, "Unauthorized: Missing authentication token")
    # ?token= once: the cookie is set and the address loses the token.
    status, headers, _ = http(f"{url}/tasks?state=FAILED&token={token}")
    assert status == 303 and headers["Location"] == "/tasks?state=FAILED"
    assert headers["Set-Cookie"].startswith(f"ray-authentication-token={token};")
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    status, _, body = http(f"{url}/tasks?token=nope")
    assert status == 403 and "The token in the address" in body
    # The form.
    status, _, body = http(f"{url}/login", method="POST", body="token=nope&next=%2Fnodes")
    assert status == 403 and "not this cluster" in body
    status, headers, _ = http(f"{url}/login", method="POST",
                              body=f"token={token}&next=%2Fnodes")
    assert status == 303 and headers["Location"] == "/nodes"
    status, headers, _ = http(f"{url}/login", method="POST",
                              body=f"token={token}&next=https%3A%2F%2Fevil.example%2F")
    assert headers["Location"] == "/", "sign-in never leaves the dashboard"
    # The cookie works, for pages and for the Jobs API.
    assert http(f"{url}/nodes", cookie=token)[0] == 200
    assert http(f"{url}/api/jobs/", cookie=token)[0] == 200
    assert http(f"{url}/healthz")[0] == 200


def test_bad_input_gets_a_page_or_an_error_and_the_head_keeps_serving(dash):
    url, token = dash["url"], dash["token"]
    cases = [
        ("/nodes/%3Cscript%3Ealert(1)%3C%2Fscript%3E", 404),
        ("/jobs/%3Cimg%20src%3Dx%3E", 404),
        ("/jobs/..%2F..%2Fetc%2Fpasswd", 404),
        ("/tasks?state=%ZZ&limit=-5&job=%00%FF", 200),
        ("/tasks?limit=99999999999999999999999", 200),
        ("/actors?state=" + "A" * 20000, 200),
        ("/api/v0/tasks/timeline?job_id=%22%3E&download=1", 200),
        ("/nodes/" + "x" * 5000, 404),
        ("/no-such-page", 404),
    ]
    for path, want in cases:
        status, _, body = http(url + path, token)
        assert status == want, (path, status, body[:300])
        assert "<script>alert" not in body and "<img src=x>" not in body
    status, _, _ = http(f"{url}/login", method="POST", body=b"\xff\xfe%%%&&&=token")
    assert status == 403
    status, _, _ = http(f"{url}/login?next=%ZZ")
    assert status == 200
    assert http(f"{url}/", token)[0] == 200, "the head still serves"


def test_dash_1_the_overview_names_every_node_by_id_and_address_without_a_script(dash):
    status, _, html = http(dash["url"] + "/", dash["token"])
    assert status == 200
    alive = [n for n in dash["nodes"] if n["state"] == "ALIVE"]
    assert len(alive) == 5
    for n in alive:
        assert f"<code>{n['node_id']}</code>" in html
        assert n["address"] in html
    assert "slice sa: v6e-16, topology 4x4, 4 hosts" in html


def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail("the browser tests need Debian's chromium and chromium-driver: "
                    "scripts/python-tests.sh installs them when run as root "
                    "(apt-get install -y chromium chromium-driver)")
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must never fetch a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,900", "--hide-scrollbars"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def console_errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def test_every_page_loads_in_a_browser_and_shows_the_real_cluster(dash):
    from selenium.webdriver.common.by import By

    url = dash["url"]
    driver = browser()
    try:
        # Sign in through the form.
        driver.get(url + "/slices")
        assert "needs its token" in driver.page_source
        assert driver.current_url == url + "/login?next=%2Fslices"
        driver.find_element(By.ID, "token").send_keys("wrong")
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        # The click submits the form; the answer replaces the page a moment later.
        deadline = time.time() + 15
        while "not this cluster" not in driver.page_source and time.time() < deadline:
            time.sleep(0.1)
        assert "not this cluster" in driver.page_source
        driver.get_log("browser")  # the refused sign-in (a 403) was logged; start afresh
        driver.find_element(By.ID, "token").send_keys(dash["token"])
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        deadline = time.time() + 15
        while driver.current_url != url + "/slices" and time.time() < deadline:
            time.sleep(0.1)
        assert driver.current_url == url + "/slices"
        assert not console_errors(driver), console_errors(driver)

        pages = {}
        for path in ("/", "/nodes", "/slices", "/actors", "/tasks", "/tasks?state=FAILED",
                     "/tasks?state=RUNNING",
                     "/placement-groups", "/jobs", f"/jobs/{dash['submission']}",
                     f"/jobs/{dash['held']['job_id']}", "/serve", "/replicas", "/timeline",
                     f"/nodes/{dash['held']['members'][0]['node']}"):
            driver.get(url + path)
            errors = console_errors(driver)
            assert not errors, (path, errors)
            assert driver.find_element(By.TAG_NAME, "h1").text, path
            pages[path] = driver.find_element(By.TAG_NAME, "main").text

        alive = [n for n in dash["nodes"] if n["state"] == "ALIVE"]
        for n in alive:
            assert n["node_id"] in pages["/"] and n["address"] in pages["/"]
            assert n["node_id"] in pages["/nodes"]

        # The slice, host by host: every host with its worker id and address, all 16 chips
        # held by the gang's members (busy, at their indices), the gang named with its
        # generation.
        driver.get(url + "/slices")
        hosts = driver.find_elements(By.CSS_SELECTOR, ".slice[data-slice=sa] .host")
        assert len(hosts) == 4
        tpu = {n["node_id"]: n for n in alive if n["tpu_slice_name"] == "sa"}
        for h in hosts:
            node = tpu[h.get_attribute("data-node")]
            assert f"worker {node['tpu_worker_id']}" in h.text and node["address"] in h.text
            chips = h.find_elements(By.CSS_SELECTOR, ".chip")
            assert [c.get_attribute("data-chip") for c in chips] == ["0", "1", "2", "3"]
            assert {c.get_attribute("data-state") for c in chips} == {"busy"}, h.text
            assert all("gang train (gen 0)" in c.text for c in chips), h.text
            member = next(m for m in dash["held"]["members"] if m["node"] == node["node_id"])
            assert member["worker"] == node["tpu_worker_id"]
            assert f"pid {member['pid']}" in h.text
        # Worker 0 top left, worker 3 bottom right of the 2x2 host grid.
        by_worker = {tpu[h.get_attribute("data-node")]["tpu_worker_id"]: h.rect for h in hosts}
        assert by_worker["0"]["x"] < by_worker["1"]["x"] and by_worker["0"]["y"] < by_worker["2"]["y"]
        assert "gang train (gen 0): 4 chips" in pages["/slices"]
        driver.get(url + "/")
        chips = driver.find_elements(By.CSS_SELECTOR, ".slice[data-slice=sa] .chip")
        assert [c.get_attribute("data-state") for c in chips] == ["busy"] * 16, "overview too"

        for a in dash["actors"]:
            if a["state"] == "ALIVE":
                assert a["actor_id"] in pages["/actors"]
        assert "dash-counter" in pages["/actors"] and "Member" in pages["/actors"]
        assert "boom-for-the-dashboard <b>" in pages["/tasks?state=FAILED"]
        assert "square" in pages["/tasks"]
        assert "sleepy" in pages["/tasks?state=RUNNING"], pages["/tasks?state=RUNNING"]
        assert "gang train (gen 0)" in pages["/placement-groups"]
        assert dash["submission"] in pages["/jobs"] and dash["held"]["job_id"] in pages["/jobs"]
        assert "hello-from-the-job" in pages[f"/jobs/{dash['submission']}"]
        assert "<i>x</i>" in pages[f"/jobs/{dash['submission']}"], "log text shown as text"
        assert "started by hand" in pages[f"/jobs/{dash['held']['job_id']}"]
        member = dash["held"]["members"][0]
        node_page = pages[f"/nodes/{member['node']}"]
        assert str(member["pid"]) in node_page and "ACTOR" in node_page, node_page
        assert "0,1,2,3" in node_page, "the member's chips"
        assert "Object store" in node_page and "Labels" in node_page
        assert "No serve application" in pages["/serve"]
        assert "leader" in pages["/replicas"]

        # The refresh script swaps in a fresh <main>.
        driver.get(url + "/")
        deadline = time.time() + 15
        status = ""
        while time.time() < deadline:
            status = driver.find_element(By.ID, "refresh-status").text
            if status.startswith("updated"):
                break
            time.sleep(0.3)
        assert status.startswith("updated"), status
        assert not console_errors(driver)

        if os.environ.get("TPURAY_UPDATE_SCREENSHOTS") == "1":
            out = REPO / "docs" / "screenshots"
            out.mkdir(parents=True, exist_ok=True)
            for path, name, height in (("/", "overview", 1000), ("/slices", "slices", 1000)):
                driver.set_window_size(1280, height)
                driver.get(url + path)
                driver.save_screenshot(str(out / f"{name}.png"))
    finally:
        driver.quit()


def test_the_readme_shows_the_screenshots():
    readme = (REPO / "README.md").read_text()
    for name in ("overview", "slices"):
        png = REPO / "docs" / "screenshots" / f"{name}.png"
        assert png.exists() and png.stat().st_size < 400_000, png
        assert f"docs/screenshots/{name}.png" in readme


TIMELINE = """
import json, sys
import tpuray as ray
from tpuray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init({addr!r})
nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])[:3]

@ray.remote
def where(i):
    ctx = ray.get_runtime_context()
    return ctx.get_task_id(), ctx.get_node_id(), ctx.get_worker_id()

refs = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % 3], soft=False)).remote(i)
        for i in range(1000)]
ran = ray.get(refs, timeout=180)
ray.timeline(filename={path!r})
events = ray.timeline()
print("JSON " + json.dumps({{"ran": ran, "nodes": nodes, "job_id": ray.get_runtime_context().get_job_id(),
                             "spans": sum(1 for e in events if e.get("ph") == "X")}}), flush=True)
ray.shutdown()
"""


def check_trace(events, ran, job_id, nodes):
    spans = [e for e in events if e["ph"] == "X" and e["args"]["job_id"] == job_id]
    assert len(spans) == 1000
    assert len({e["args"]["task_id"] for e in spans}) == 1000
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    by_task = {t: (node, worker) for t, node, worker in ran}
    pid_node = {}
    for e in spans:
        node, worker = by_task[e["args"]["task_id"]]
        assert e["name"] == "where" and e["cat"] == "task"
        assert e["args"]["node_id"] == node and e["args"]["worker_id"] == worker
        assert isinstance(e["ts"], int) and e["ts"] > 0 and e["dur"] >= 0
        assert pid_node.setdefault(e["pid"], node) == node, "one node per pid"
        assert node[:8] in names[(e["pid"], None)]
        assert names[(e["pid"], e["tid"])] == f"worker:{worker}", "the span is on its worker's row"
    assert set(pid_node.values()) == set(nodes)


def test_a_timeline_of_1000_tasks_on_3_nodes_has_1000_spans_on_the_right_workers(dash, tmp_path):
    c = dash["cluster"]
    path = tmp_path / "trace.json"
    script = tmp_path / "timeline.py"
    script.write_text(textwrap.dedent(TIMELINE.format(addr=c.address, path=str(path))))
    r = subprocess.run([sys.executable, str(script)], env=c.env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("JSON "))[5:])
    assert len({node for _, node, _ in out["ran"]}) == 3
    check_trace(json.loads(path.read_text()), out["ran"], out["job_id"], out["nodes"])
    assert out["spans"] >= 1000
    # The CLI writes the same trace; the dashboard serves it.
    cli_out = tmp_path / "cli.json"
    r = subprocess.run(CliCluster.CLI + ["timeline", "--address", c.address, "--output", str(cli_out),
                                         "--job-id", out["job_id"]],
                       env=c.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "1000 task spans" in r.stdout
    check_trace(json.loads(cli_out.read_text()), out["ran"], out["job_id"], out["nodes"])
    status, headers, body = http(f"{dash['url']}/api/v0/tasks/timeline?job_id={out['job_id']}&download=1",
                                 dash["token"])
    assert status == 200 and "attachment" in headers["Content-Disposition"]
    check_trace(json.loads(body), out["ran"], out["job_id"], out["nodes"])


def test_timeline_needs_an_initialized_cluster():
    r = subprocess.run([sys.executable, "-c", "import tpuray as ray\ntry:\n    ray.timeline()\n"
                        "except RuntimeError as e:\n    print('RuntimeError', e)"],
                       capture_output=True, text=True, timeout=60)
    assert "RuntimeError" in r.stdout and "initialized" in r.stdout, r.stdout + r.stderr
