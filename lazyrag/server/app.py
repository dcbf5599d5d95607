"""The OpenAI-compatible HTTP app of ``lazyrag serve`` (FastAPI), shaped as vLLM's ``api_server.py``:
``build_app`` makes the app (exception handlers, middleware, the routes) and ``init_app_state`` puts what the routes
share on ``app.state``. A thin layer: the engine does the work. Its scheduler batches every request in flight, and
each chunk's KV is reused at whatever position it lands.

Where each part lives: ``routes.py`` (the endpoints), ``serving.py`` (requests into engine prompts, results into
OpenAI responses; where a request's chunks come from), ``errors.py`` (OpenAI's error shape and the exception
handlers), ``middleware.py`` (API key, body limits, request counter), ``config.py`` (``ServerConfig``).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI

from lazyrag.server.config import ServerConfig
from lazyrag.server.errors import add_exception_handlers
from lazyrag.server.metrics import ServerMetrics
from lazyrag.server.middleware import Gate
from lazyrag.server.routes import router
from lazyrag.server.serving import InFlight, OpenAIServing
from lazyrag.version import __version__

if TYPE_CHECKING:
    from starlette.datastructures import State

    from lazyrag.engine import LazyEngine
    from lazyrag.store.retriever import Retriever


def model_aliases(model_name: str) -> tuple[str, ...]:
    """Ids a client may send for a model served under its file or folder name: without ``.gguf`` and without a
    quantisation suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` is also ``SmolLM2-135M-Instruct.Q4_1`` and
    ``SmolLM2-135M-Instruct``, as the README and the model card name it)."""
    stem = re.sub(r"\.gguf$", "", model_name, flags=re.IGNORECASE)
    base = re.sub(r"[.-](?:[QF]\d+(?:_[A-Z0-9]+)*|BF16|F16|F32)$", "", stem, flags=re.IGNORECASE)
    return tuple(dict.fromkeys(n for n in (stem, base) if n and n != model_name))


def seed_sampling(seed: int) -> None:
    """vLLM's ``--seed``: seed the generators that sampling requests without a ``seed`` of their own draw from
    (torch's default generator; Python's and NumPy's too), so that after every start the same requests in the same
    order sample the same answers. A request's own ``seed`` gives it a generator of its own, as before."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def build_app(engine: LazyEngine, config: ServerConfig, retriever: Retriever | None = None) -> FastAPI:
    """The app for one engine. ``retriever`` (over the store attached to ``engine``) serves chat requests
    that bring no chunks."""
    check_config(engine, config)
    app = FastAPI(
        title="lazyrag",
        description="OpenAI-compatible server with reusable, position-free chunk KV",
        version=__version__,
    )
    init_app_state(app.state, engine, config, retriever)
    add_exception_handlers(app)  # OpenAI's JSON shape, never a traceback
    app.add_middleware(Gate, config=config, metrics=app.state.metrics)
    if config.allowed_origins:  # added last, so outermost: a browser's preflight is answered before the API key check
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
    app.include_router(router)
    return app


def check_config(engine: LazyEngine, config: ServerConfig) -> None:
    """A ValueError for settings the app cannot serve with."""
    if config.max_model_len is not None and not 0 < config.max_model_len <= engine.max_context:
        raise ValueError(
            f"max_model_len (--max-model-len) {config.max_model_len} must be from 1 to the model's context, "
            f"{engine.max_context} tokens (its max_position_embeddings)."
        )
    if config.api_key_covers not in ("v1", "all"):
        raise ValueError(f"api_key_covers must be 'v1' or 'all'; got {config.api_key_covers!r}.")


def init_app_state(state: State, engine: LazyEngine, config: ServerConfig, retriever: Retriever | None = None) -> None:
    """What the routes share, on ``app.state``: the engine, the config, the metrics, the generations in flight
    (``in_flight``, under ``--max-pending``) and ``serving``, the ``OpenAIServing`` over them all."""
    state.engine, state.config, state.retriever = engine, config, retriever
    state.metrics = ServerMetrics(engine)
    state.in_flight = InFlight(config.max_pending)
    state.serving = OpenAIServing(engine, config, state.metrics, state.in_flight, retriever)


def wait_until_ready(url: str, timeout_s: float = 60.0) -> None:
    """Block until ``url``/health answers (a server started in another thread or process)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer /health within {timeout_s:.0f} s") from None
            time.sleep(0.1)
