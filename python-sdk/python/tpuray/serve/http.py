"""The request object the HTTP proxy hands to an application's ingress.

Ray Serve hands the ingress a Starlette ``Request``; tpuray's proxy is JSON in and JSON
out (no Starlette), and hands this object with the same reading methods:
``await request.json()``, ``await request.body()``, ``request.query_params``,
``request.headers``, ``request.method``, ``request.url.path``. The body was already
read and parsed by the proxy (a body that is not JSON was answered 400 there), so sync
code can read ``request.json_body`` and ``request.body_bytes``.
"""

from __future__ import annotations


class _Ready:
    """An awaitable that is already done (so ``await request.json()`` works)."""

    __slots__ = ("_v",)

    def __init__(self, v):
        self._v = v

    def __await__(self):
        if False:  # pragma: no cover - makes this a generator
            yield
        return self._v


class _URL:
    def __init__(self, path: str, query: str):
        self.path = path
        self.query = query

    def __str__(self) -> str:
        return self.path + (f"?{self.query}" if self.query else "")


class Request:
    """An HTTP request as the ingress sees it.

    Attributes:
        method: ``"GET"``, ``"POST"``, ...
        url: ``.path`` (the full path) and ``.query``.
        route_prefix: the application's route prefix that matched.
        query_params: ``{name: value}`` (the last value of a repeated name).
        headers: ``{lower-case name: value}``.
        body_bytes: the raw body (``b""`` when none).
        json_body: the parsed JSON body (``None`` when the body is empty).
    """

    def __init__(self, method, path, query, route_prefix, headers, body_bytes, json_body):
        self.method = method
        self.url = _URL(path, query)
        self.route_prefix = route_prefix
        from urllib.parse import parse_qsl

        self.query_params = dict(parse_qsl(query, keep_blank_values=True))
        self.headers = headers
        self.body_bytes = body_bytes
        self.json_body = json_body

    def json(self):
        """Awaitable: the parsed JSON body (Starlette's ``await request.json()``)."""
        return _Ready(self.json_body)

    def body(self):
        """Awaitable: the raw body bytes (Starlette's ``await request.body()``)."""
        return _Ready(self.body_bytes)

    def __repr__(self) -> str:
        return f"Request({self.method} {self.url})"
