"""``ServerConfig``: what ``lazyrag serve`` is started with (its command-line options), as the app reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    model_name: str  # the id clients pass as ``model`` (``/v1/models`` lists it)
    max_tokens: int = 256  # a request's default max_tokens
    temperature: float = 0.0  # the default when a request has none: greedy
    strategy: str = "lazy+recover"  # the default strategy (a request's ``strategy`` field overrides it)
    k: int = 5  # chunks retrieved per chat request when a store is attached
    max_pending: int = 256  # generations in flight before new requests get 503
    api_key: str | None = None  # when set, requests need ``Authorization: Bearer <key>``
    # what the key guards: "v1" (the API, as vLLM) or "all" (also /metrics, /docs, /openapi.json, /tokenize, ...;
    # /health and /version stay open for load balancers and probes)
    api_key_covers: str = "v1"
    aliases: tuple[str, ...] = ()  # other ids accepted as ``model`` (model_aliases: the file's stem, say)
    pasted_context: bool = True  # passages pasted into prompts (no ``documents`` field) are cached and reused
    max_request_bytes: int = 8 << 20  # a larger request body gets 413 before it is read into memory
    body_timeout_s: float = 30.0  # a body whose next part takes longer than this to arrive gets 408 (slow clients)
    # prompt plus answer tokens a request may take (vLLM's --max-model-len); None: the model's context
    # (max_position_embeddings). Longer prompts get a 400; it cannot exceed the model's context
    max_model_len: int | None = None
    # CORS (starlette's CORSMiddleware, as vLLM's --allowed-origins/-methods/-headers): no origin, no CORS headers
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
