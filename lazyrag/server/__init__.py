"""``lazyrag serve``: an OpenAI-compatible HTTP server over one LazyEngine (FastAPI + uvicorn).

``/v1/chat/completions`` and ``/v1/completions`` (streaming as server-sent events), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus), and vLLM's ``/version``, ``/tokenize`` and ``/detokenize``. Any
OpenAI client works against it; chunk KV is reused across requests whichever way the chunks arrive
(see ``serving.py``). ``build_app`` makes the app (as vLLM's ``api_server.build_app``; its routes read what they
share from ``app.state``, which ``init_app_state`` fills).
"""

from __future__ import annotations

from lazyrag.server.app import build_app, init_app_state, wait_until_ready
from lazyrag.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app", "init_app_state", "run_server", "wait_until_ready"]


def run_server(
    engine,
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    retriever=None,
    log_level: str = "info",
    **uvicorn_options,
) -> None:
    """Serve ``engine`` until interrupted (Ctrl-C): requests in flight are aborted and their blocks freed.
    ``uvicorn_options``: more of ``uvicorn.run``'s keywords (``ssl_keyfile``, ``ssl_certfile``, ``root_path``, ...)."""
    import uvicorn

    uvicorn.run(
        build_app(engine, config, retriever),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        **uvicorn_options,
    )
