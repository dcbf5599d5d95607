"""Errors of ``lazyrag serve`` in OpenAI's JSON shape, never a traceback: ``APIError`` (what a request got wrong, or
the server's state), ``json_error`` and ``http_error`` (the shape, also for the replicas' front), and the app's
exception handlers (``add_exception_handlers``)."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lazyrag.server.protocol import error_body

log = logging.getLogger("lazyrag.server.app")  # the logger's name from before the app was split into modules


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def json_error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error shape, as every lazyrag endpoint (and the replicas' front) answers."""
    return JSONResponse(error_body(message, type_, status, param), status_code=status)


def http_error(e: StarletteHTTPException) -> JSONResponse:
    """An HTTPException (a 413 or 408 raised mid-body, a 404, a 405) in OpenAI's error shape."""
    return json_error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")


async def api_error_handler(request: Request, e: APIError) -> JSONResponse:
    return json_error(e.status, e.message, e.type, e.param)


async def validation_error_handler(request: Request, e: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}" for err in e.errors()[:5]
    )
    param = next((str(err["loc"][-1]) for err in e.errors() if err.get("loc")), None)
    return json_error(422, f"Invalid request: {problems}", "invalid_request_error", param)


async def http_error_handler(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return http_error(e)


async def internal_error_handler(request: Request, e: Exception) -> JSONResponse:
    # the details (paths, traceback) go to the server's log, never to the client
    ref = uuid.uuid4().hex[:12]
    log.error("error %s on %s %s", ref, request.method, request.url.path, exc_info=e)
    from lazyrag.store.corpus import StoreError

    if isinstance(e, StoreError):
        return json_error(
            503,
            f"The server's corpus store could not be read (error {ref}: the server's log says why; "
            "its operator may need to rebuild or reopen the store).",
            "server_error",
        )
    return json_error(
        500, f"Internal error ({type(e).__name__}, error {ref}: the server's log has the details).", "server_error"
    )


def add_exception_handlers(app: FastAPI) -> None:
    app.exception_handler(APIError)(api_error_handler)
    app.exception_handler(RequestValidationError)(validation_error_handler)
    app.exception_handler(StarletteHTTPException)(http_error_handler)
    app.exception_handler(Exception)(internal_error_handler)
