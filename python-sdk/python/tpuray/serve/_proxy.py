"""The HTTP proxy: an actor that serves every application's route prefix over HTTP/1.1
(Python's ``http.server``, one thread per connection).

A request goes to the application whose ``route_prefix`` is the longest prefix of the
path (``/`` matches everything; ``/a`` matches ``/a`` and ``/a/...``). The proxy reads
the whole request and sends it, as a :class:`tpuray.serve.http.HTTPRequest`, to the
application's ingress replica on a streaming call; the replica answers with the status,
headers and body chunks (``http.py`` says how a replica turns a request into a
response: ASGI for ``@serve.ingress`` apps, a Starlette ``Request`` and Ray's return
value conversion for the others). A chunked response is sent with chunked transfer
encoding as its chunks come.

Serve's own errors: 404 JSON ``{"error", "routes"}`` for a path no application serves,
503 (text) when no replica could take the request (backpressure, replicas died, the
deployment is gone), 411 for a chunked request body, 400 for a bad Content-Length.
``GET /-/routes`` lists the routes, ``GET /-/healthz`` answers ``success``. A bad
request never takes the proxy down: every handler catches all. The
``serve_multiplexed_model_id`` request header sets the request's model id (Ray's).

One proxy per cluster (Ray runs one per node), on the controller's choice of node; its
routes are long-polled from the controller.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import traceback
from typing import cast
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import tpuray
from tpuray.serve import _common

#: The request header naming the model of a multiplexed deployment (Ray's
#: ``SERVE_MULTIPLEXED_MODEL_ID``).
MULTIPLEXED_HEADER = "serve_multiplexed_model_id"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):  # noqa: D401 - quiet broken pipes
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class ProxyActor:
    """Binds ``host:port`` (port 0: a free one) at construction; ``ready()`` returns
    ``{"node_id", "port"}``."""

    def __init__(self, host: str, port: int):
        self._routes: dict = {}
        self._version = -1
        self._handles: dict = {}
        handler = type("Handler", (_Handler,), {"proxy": self})
        self._server = _Server((host, int(port)), handler)
        self._port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="serve-http").start()
        threading.Thread(target=self._poll_routes, daemon=True, name="serve-routes").start()

    def ready(self) -> dict:
        return {"node_id": tpuray.get_runtime_context().get_node_id(), "port": self._port}

    def check_health(self) -> bool:
        # An AF_INET server's address is (host str, port).
        host = cast(str, self._server.server_address[0])
        with socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "") else host, self._port), timeout=5):
            return True

    def _poll_routes(self):
        while True:
            try:
                ctrl = _common.get_controller()
                self._version, self._routes = tpuray.get(
                    ctrl.listen_for_routes.remote(self._version), timeout=60
                )
            except Exception:  # noqa: BLE001 - controller restarting or shut down
                _common.forget_controller()
                time.sleep(0.5)

    def match(self, path: str):
        best = None
        for prefix, target in self._routes.items():
            if prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                if best is None or len(prefix) > len(best[0]):
                    best = (prefix, target)
        return best

    def handle_for(self, app: str, ingress: str):
        from tpuray.serve.handle import DeploymentHandle

        key = (app, ingress)
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = DeploymentHandle(ingress, app).options(stream=True, _http=True)
        return h


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    #: Set on the per-server subclass that ProxyActor.__init__ makes (never used bare).
    proxy: ProxyActor

    def log_message(self, fmt, *args):  # no per-request log lines on stderr
        pass

    def do_GET(self):
        self._serve()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def _send(self, status: int, body: bytes, content_type: str):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def _serve(self):
        try:
            self._serve_inner()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bad request never kills the proxy
            print("serve proxy: " + traceback.format_exc(), file=sys.stderr)
            try:
                self._json(500, {"error": f"the proxy failed on this request: {type(e).__name__}: {e}"})
            except Exception:  # noqa: BLE001 - headers already sent
                self.close_connection = True

    def _serve_inner(self):
        parts = urlsplit(self.path)
        path = parts.path or "/"
        proxy = self.proxy
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            self._json(411, {"error": "chunked request bodies are not supported: send a Content-Length"})
            return
        try:
            n = int(length) if length else 0
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            self._json(400, {"error": f"bad Content-Length header {length!r}: expected a byte count"})
            return
        body = self.rfile.read(n) if n else b""
        if path == "/-/routes":
            self._json(200, {p: app for p, (app, _) in proxy._routes.items()})
            return
        if path == "/-/healthz":
            self._send(200, b"success", "text/plain")
            return
        m = proxy.match(path)
        if m is None:
            self._json(404, {
                "error": f"Path '{path}' not found: no application serves it",
                "routes": sorted(proxy._routes),
            })
            return
        prefix, (app, ingress) = m
        from tpuray.serve.http import HTTPRequest, error_start

        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        req = HTTPRequest(self.command, unquote(path), parts.path.encode("latin-1") or b"/",
                          parts.query.encode("latin-1"), headers, body, prefix,
                          client=list(self.client_address[:2]))
        h = proxy.handle_for(app, ingress)
        model_id = self.headers.get(MULTIPLEXED_HEADER)
        if model_id:
            # Ray routes by this header as by the handle option of the same meaning.
            h = h.options(multiplexed_model_id=model_id)
        gen = h.remote(req)
        try:
            first = next(gen, None)
        except Exception as e:  # noqa: BLE001 - serve's own errors (the replica answers the user's)
            first = error_start(e)
        if first is None:
            first = error_start(RuntimeError(f"the ingress {ingress!r} sent no response"))
        _, status, hdrs, data, more = first
        self.send_response(status)
        for k, v in hdrs:
            if k.lower() in (b"content-length", b"transfer-encoding", b"connection"):
                continue
            self.send_header(k.decode("latin-1"), v.decode("latin-1"))
        if not more:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(data)
        try:
            for _, data, more in gen:
                self._chunk(data)
                if not more:
                    break
        except Exception as e:  # noqa: BLE001 - the headers are gone: end the stream
            print(f"serve proxy: the stream from {ingress!r} broke: {_message(e)}", file=sys.stderr)
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes):
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()


def _message(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    s = str(e).strip().splitlines()
    return s[-1] if s else type(e).__name__
