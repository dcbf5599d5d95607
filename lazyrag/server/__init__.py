"""``lazyrag serve``: an OpenAI-compatible HTTP server over one LazyEngine (FastAPI + uvicorn).

``/v1/chat/completions`` and ``/v1/completions`` (streaming as server-sent events), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus), and vLLM's ``/version``, ``/tokenize`` and ``/detokenize``. Any
OpenAI client works against it; chunk KV is reused across requests whichever way the chunks arrive
(see ``app.py``).
"""

from __future__ import annotations

from lazyrag.server.app import ServerConfig, create_app, wait_until_ready

__all__ = ["ServerConfig", "create_app", "run_server", "wait_until_ready"]


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
        create_app(engine, config, retriever),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        **uvicorn_options,
    )
