"""The pure ASGI middleware of ``lazyrag serve``: the API key (``key_refused``), the request-body limits
(``BodyLimits``) and the per-status request counter (``Gate``, which holds the other two). The front of
``lazyrag serve --replicas`` applies the same key rule and body limits.

Pure ASGI, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware hands the endpoint a ``receive`` on which
``Request.is_disconnected()`` never turns true, so a non-streaming client that hung up went on generating.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException as StarletteHTTPException

from lazyrag.server.errors import json_error

if TYPE_CHECKING:
    from lazyrag.server.config import ServerConfig
    from lazyrag.server.metrics import ServerMetrics

OPEN_PATHS = ("/health", "/version")  # never behind the API key: probes and load balancers ask them
WRONG_KEY = "Missing or wrong API key: send the header 'Authorization: Bearer <key>' (lazyrag serve --api-key)."


def route_path(scope) -> str:
    """The path the app routes on: uvicorn puts ``--root-path`` in front of it (a proxy strips that prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


def key_refused(api_key: str | None, covers: str, path: str, authorization: bytes) -> bool:
    """Whether a request for ``path`` with this ``Authorization`` header lacks the API key it needs: every path
    under /v1/, and with ``covers`` "all" every other path but OPEN_PATHS (a constant-time comparison).
    One rule for ``lazyrag serve`` and the front of ``lazyrag serve --replicas``."""
    guarded = path.startswith("/v1/") or (covers == "all" and path not in OPEN_PATHS)
    return (
        bool(api_key)
        and guarded
        and not hmac.compare_digest(authorization, f"Bearer {api_key}".encode("latin-1", "replace"))
    )


class BodyLimits:
    """Pure ASGI middleware: a body over ``max_request_bytes`` gets 413 before it is read into memory (from its
    declared length, or as a chunked body arrives), and one whose next part takes longer than ``body_timeout_s``
    to arrive gets 408. One rule for ``lazyrag serve`` and the front of ``lazyrag serve --replicas``; the 413 and
    408 raised mid-body reach the app's ``StarletteHTTPException`` handler."""

    def __init__(self, app, max_request_bytes: int, body_timeout_s: float):
        self.app, self.limit, self.timeout_s = app, max_request_bytes, body_timeout_s

    def too_large(self) -> str:
        return (
            f"The request body is over {self.limit} bytes (lazyrag serve --max-request-mb): send fewer or "
            "shorter documents, or retrieve them from a store (--store)."
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.limit:
            return await json_error(413, self.too_large(), "invalid_request_error")(scope, receive, send)
        await self.app(scope, _CountedBody(self, receive), send)


class _CountedBody:
    """One request's ``receive`` under BodyLimits: a chunked body declares no length, so it is counted as it
    arrives, and each part must arrive within the timeout."""

    def __init__(self, limits: BodyLimits, receive):
        self.limits, self.receive, self.received, self.body_done = limits, receive, 0, False

    async def __call__(self):
        if self.body_done:  # after the body, receive() waits for a disconnect: no deadline
            return await self.receive()
        try:
            message = await asyncio.wait_for(self.receive(), self.limits.timeout_s)
        except asyncio.TimeoutError:
            raise StarletteHTTPException(
                408,
                f"The request body stopped arriving for {self.limits.timeout_s:g} s "
                "(lazyrag serve --body-timeout): send it whole.",
            ) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.body_done = not message.get("more_body", False)
            if self.received > self.limits.limit:  # FastAPI lets an HTTPException out of its body parsing as it is
                raise StarletteHTTPException(413, self.limits.too_large())
        return message


class Gate:
    """Pure ASGI middleware: the API key, the request-size limits (``BodyLimits``) and the per-status request
    counter (``lazyrag_requests``)."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics):
        self.config, self.metrics = config, metrics
        self.app = BodyLimits(app, config.max_request_bytes, config.body_timeout_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = route_path(scope), dict(scope["headers"])
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if key_refused(self.config.api_key, self.config.api_key_covers, path, headers.get(b"authorization", b"")):
                return await json_error(401, WRONG_KEY, "authentication_error")(scope, receive, send_status)
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(path, str(status[0])).inc()
