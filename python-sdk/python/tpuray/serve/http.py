"""HTTP between the proxy and a replica, as ASGI (https://asgi.readthedocs.io/).

The proxy reads one HTTP request and sends it to the application's ingress replica as an
:class:`HTTPRequest` (method, path, query string, headers, the whole body). In the
replica (:func:`serve_http`):

- an ``@serve.ingress(app)`` deployment: the request is passed to its ASGI app
  (FastAPI, Starlette, ...) as an ASGI ``http`` scope, with ``root_path`` the
  application's route prefix, as Ray Serve does; what the app sends is the response;
- any other deployment: its method gets a Starlette ``Request`` (this module's
  :class:`Request`, a subclass with the body already read), and its return value is the
  response as Ray Serve converts it (``ray/serve/_private/http_util.py``
  ``convert_object_to_asgi_messages``): a Starlette ``Response`` as it is (status code,
  headers and streaming included); ``None`` an empty ``text/plain`` body; ``bytes``
  ``text/plain``; ``str`` ``text/plain; charset=utf-8``; anything else compact JSON
  (FastAPI's ``jsonable_encoder``, so dataclasses and pydantic models work; numpy
  values become lists and numbers). A generator's items are streamed, chunked
  (``str``/``bytes`` as they are, other items one JSON document per line,
  ``application/x-ndjson``).

An exception from the user's code is a 500 whose ``text/plain`` body starts with
Ray's ``Internal Server Error`` and continues with the exception's type and message on
the next line (Ray's body stops after the first line; the error is also printed on the
replica's stderr). Serve's own unavailability errors (backpressure, a deployment gone)
are 503 with their message, as in Ray.

What the replica yields to the proxy (a streaming call): first
``("start", status, headers, body, more)`` (``headers`` a list of ``(bytes, bytes)``),
then, while ``more``, ``("body", bytes, more)`` items.

Needs ``starlette`` (``pip install 'tpuray[serve]'``, as Ray's ``ray[serve]``).

SERVE-3: HTTP is ASGI from the proxy on, and a handler that raises is a 500, never a
hang: the replica always ends the response.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import queue
import sys
import traceback

try:  # Only replicas serving HTTP need it; handles and the controller do not.
    import starlette.requests as _sreq
    import starlette.responses as _sresp

    _StarletteRequest = _sreq.Request
except ImportError:  # pragma: no cover - the serve extra is not installed
    # The serve extra is optional: None stands for the missing modules.
    _sreq = _sresp = None  # type: ignore[assignment]

    class _StarletteRequest:  # type: ignore[no-redef]
        def __init__(self, *a, **k):
            raise ImportError(
                "HTTP requests to tpuray.serve deployments need starlette: pip install 'tpuray[serve]'"
            )


class HTTPRequest:
    """One HTTP request as the proxy read it (picklable, sent to the ingress replica).

    Attributes:
        method: ``"GET"``, ``"POST"``, ...
        path: the full path (the route prefix included), percent-decoded.
        raw_path: the path as it came, bytes.
        query_string: bytes after ``?`` (``b""`` when none).
        headers: ``[(lower-case name bytes, value bytes)]`` in order.
        body: the whole body.
        route_prefix: the application's route prefix that matched.
        client: ``(host, port)`` of the caller.
    """

    __slots__ = ("method", "path", "raw_path", "query_string", "headers", "body", "route_prefix",
                 "client", "http_version", "_json")

    def __init__(self, method, path, raw_path, query_string, headers, body, route_prefix,
                 client=None, http_version="1.1"):
        self.method = method
        self.path = path
        self.raw_path = raw_path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.route_prefix = route_prefix
        self.client = client
        self.http_version = http_version
        self._json = None

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__ if k != "_json"}

    def __setstate__(self, st):
        for k, v in st.items():
            setattr(self, k, v)
        self._json = None

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def json_body(self):
        """The body parsed as JSON, None when empty or not JSON (for routers that look
        at the prompt, e.g. prefix affinity)."""
        if self._json is None:
            try:
                self._json = (json.loads(self.body),) if self.body.strip() else (None,)
            except ValueError:
                self._json = (None,)
        return self._json[0]

    def scope(self) -> dict:
        """The ASGI ``http`` scope (ASGI 3.0, spec 2.3)."""
        root = "" if self.route_prefix in (None, "/") else self.route_prefix
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.raw_path,
            "query_string": self.query_string,
            "root_path": root,
            "headers": [(k, v) for k, v in self.headers],
            "client": self.client,
            "server": None,
            "state": {},
        }


class Request(_StarletteRequest):
    """The Starlette ``Request`` a plain deployment's method gets for an HTTP request
    (``await request.json()``, ``.body()``, ``.query_params``, ``.headers``, ``.method``,
    ``.url.path``, ...). The body was read already, so sync code may use
    ``request.body_bytes`` and ``request.json_body`` (None for an empty body; raises
    ``json.JSONDecodeError`` for one that is not JSON)."""

    def __init__(self, http: HTTPRequest):
        super().__init__(http.scope(), _receive_of(http.body))
        self._body = http.body

    @property
    def body_bytes(self) -> bytes:
        return self._body

    @property
    def json_body(self):
        return json.loads(self._body) if self._body.strip() else None


def _receive_of(body: bytes):
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        # The whole request was read: the next thing the app can learn is the end.
        await asyncio.Event().wait()

    return receive


_DONE = object()


def _json_default(v):
    tolist = getattr(v, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")


def encode(value, stream: bool = False) -> tuple[bytes, bytes]:
    """``(body, content type)`` of a handler's return value (Ray's conversion, see the
    module doc)."""
    if value is None:
        return b"", b"text/plain"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), (b"application/octet-stream" if stream else b"text/plain")
    if isinstance(value, str):
        return value.encode(), b"text/plain; charset=utf-8"
    try:
        # Plain JSON values (the common case) directly; jsonable_encoder gives the same
        # text for them and is several times slower.
        data = json.dumps(value, separators=(",", ":"), default=_json_default).encode()
    except TypeError:
        try:
            from fastapi.encoders import jsonable_encoder
        except ImportError:
            raise TypeError(
                f"the handler returned a {type(value).__name__}, which is not JSON serializable "
                "(dataclasses and pydantic models need fastapi: pip install 'tpuray[serve]')"
            ) from None
        doc = jsonable_encoder(value)  # dataclasses, pydantic models, dates, ...
        data = json.dumps(doc, separators=(",", ":"), default=_json_default).encode()
    if stream:
        return data + b"\n", b"application/x-ndjson"
    return data, b"application/json"


def error_start(e: BaseException) -> tuple:
    """The response for an exception from the user's code or from serve itself."""
    from tpuray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaDiedError

    if isinstance(e, (BackPressureError, DeploymentUnavailableError, ReplicaDiedError)):
        return ("start", 503, [(b"content-type", b"text/plain; charset=utf-8")], str(e).encode(), False)
    cause = getattr(e, "cause", None) or e
    msg = f"Internal Server Error\n{type(cause).__name__}: {cause}"
    return ("start", 500, [(b"content-type", b"text/plain; charset=utf-8")], msg.encode(), False)


def is_asgi_ingress(obj) -> bool:
    return getattr(type(obj), "_serve_asgi_app", None) is not None


def serve_http(obj, fn, http: HTTPRequest, loop: asyncio.AbstractEventLoop, pool):
    """Runs one HTTP request in a replica; a generator of what to send back (see the
    module doc). Runs on a replica executor thread; ``loop`` is the replica's event loop
    (the app's coroutines run there), ``pool`` the executor that runs plain methods (with
    the request's context variables)."""
    q: queue.Queue = queue.Queue()
    _END = object()

    async def send(msg):
        q.put(msg)

    async def run_asgi(app, scope, receive):
        try:
            await app(scope, receive, send)
        except BaseException as e:  # noqa: BLE001 - becomes a 500 (or ends the stream)
            q.put(e)
        finally:
            q.put(_END)

    async def run_plain():
        try:
            req = Request(http)
            if asyncio.iscoroutinefunction(fn) or asyncio.iscoroutinefunction(getattr(fn, "__call__", None)):
                result = await fn(req)
            else:
                result = await loop.run_in_executor(pool, contextvars.copy_context().run, fn, req)
                if asyncio.iscoroutine(result):
                    result = await result
            if _sresp is not None and isinstance(result, _sresp.Response):
                await result(req.scope, req.receive, send)
            elif hasattr(result, "__aiter__"):
                await _stream(result.__aiter__(), True)
            elif hasattr(result, "__next__"):
                await _stream(result, False)
            else:
                body, ctype = encode(result)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", ctype)]})
                await send({"type": "http.response.body", "body": body})
        except BaseException as e:  # noqa: BLE001
            q.put(e)
        finally:
            q.put(_END)

    async def _stream(it, is_async):
        started = False
        while True:
            try:
                item = await it.__anext__() if is_async else await loop.run_in_executor(
                    pool, contextvars.copy_context().run, next, it, _DONE)
                if item is _DONE:
                    break
            except (StopAsyncIteration, StopIteration):
                break
            data, ctype = encode(item, stream=True)
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", ctype)]})
            await send({"type": "http.response.body", "body": data, "more_body": True})
        if not started:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # SERVE-3: an ingress gets the ASGI scope, any other deployment a Starlette Request; an
    # exception becomes a 500 (error_start) and the replica always ends the response.
    if is_asgi_ingress(obj):
        asyncio.run_coroutine_threadsafe(run_asgi(obj._serve_asgi_app, http.scope(), _receive_of(http.body)), loop)
    else:
        asyncio.run_coroutine_threadsafe(run_plain(), loop)

    # None: no http.response.start yet; (status, headers): held until the first body;
    # "sent": the start went out.
    start: tuple[int, list[tuple[bytes, bytes]]] | str | None = None
    while True:
        msg = q.get()
        if msg is _END:
            if start is not None and start != "sent":
                yield ("start", *start, b"", False)
            return
        if isinstance(msg, BaseException):
            if start is None or start == "sent":
                _log(msg)
            if start == "sent":
                return  # headers are gone: the stream just ends
            yield error_start(msg)
            _drain(q, _END)
            return
        t = msg.get("type")
        if t == "http.response.start":
            start = (int(msg.get("status", 200)), [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])])
        elif t == "http.response.body":
            body = bytes(msg.get("body", b""))
            more = bool(msg.get("more_body", False))
            if start is None:
                yield error_start(RuntimeError("the ASGI app sent a body before http.response.start"))
                _drain(q, _END)
                return
            if start == "sent":
                yield ("body", body, more)
            else:
                yield ("start", *start, body, more)
                start = "sent"
            if not more:
                _drain(q, _END)
                return


def _drain(q, end):
    """Waits for the app's coroutine to finish (what it sends after the last body is
    dropped, as ASGI servers do; an exception it raises after answering, as Starlette's
    error middleware re-raises after sending its 500, is logged)."""
    while True:
        msg = q.get()
        if msg is end:
            return
        if isinstance(msg, BaseException):
            _log(msg)


def _log(e: BaseException) -> None:
    print("serve: the HTTP handler raised:\n" + "".join(traceback.format_exception(e)), file=sys.stderr)
