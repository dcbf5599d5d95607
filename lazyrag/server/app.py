"""The OpenAI-compatible HTTP app of ``lazyrag serve`` (FastAPI): a thin layer that turns requests into
engine prompts and engine results into OpenAI responses. The engine does the work: its scheduler
batches every request in flight, and each chunk's KV is reused at whatever position it lands.

Where a request's chunks come from, in order:
1. ``documents`` (a lazyrag field): the texts are the chunks, placed before the last user message;
2. chunks the engine already knows (cached, given before, or in the attached store) found inside the
   message text, e.g. a LangChain or LlamaIndex prompt that stuffs retrieved passages;
3. chat only, with ``--store``: the top ``k`` chunks retrieved for the last user message
   (``retrieve: false`` turns it off, ``retrieve: true`` forces it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from lazyrag.engine.sampling import logprob_entries, openai_chat_logprobs, openai_completion_logprobs
from lazyrag.prompt import check_text
from lazyrag.server.metrics import ServerMetrics
from lazyrag.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
    error_body,
    new_id,
    now,
    usage,
)
from lazyrag.version import __version__

if TYPE_CHECKING:
    from lazyrag.engine import GenerationResult, LazyEngine, RequestStream
    from lazyrag.store.retriever import Retriever

log = logging.getLogger(__name__)


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


def route_path(scope) -> str:
    """The path the app routes on: uvicorn puts ``--root-path`` in front of it (a proxy strips that prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


OPEN_PATHS = ("/health", "/version")  # never behind the API key: probes and load balancers ask them
WRONG_KEY = "Missing or wrong API key: send the header 'Authorization: Bearer <key>' (lazyrag serve --api-key)."


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


def json_error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error shape, as every lazyrag endpoint (and the replicas' front) answers."""
    return JSONResponse(error_body(message, type_, status, param), status_code=status)


def http_error(e: StarletteHTTPException) -> JSONResponse:
    """An HTTPException (a 413 or 408 raised mid-body, a 404, a 405) in OpenAI's error shape."""
    return json_error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")


class BodyLimits:
    """Pure ASGI middleware: a body over ``max_request_bytes`` gets 413 before it is read into memory (from its
    declared length, or as a chunked body arrives), and one whose next part takes longer than ``body_timeout_s``
    to arrive gets 408. One rule for ``lazyrag serve`` and the front of ``lazyrag serve --replicas``; the 413 and
    408 raised mid-body reach the app's ``StarletteHTTPException`` handler."""

    def __init__(self, app, max_request_bytes: int, body_timeout_s: float):
        self.app, self.limit, self.timeout_s = app, max_request_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = (
            f"The request body is over {self.limit} bytes (lazyrag serve --max-request-mb): send fewer or "
            "shorter documents, or retrieve them from a store (--store)."
        )
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.limit:
            return await json_error(413, too_large, "invalid_request_error")(scope, receive, send)
        received, body_done = [0], [False]

        async def counted_receive():  # a chunked body declares no length: count it as it arrives
            if body_done[0]:  # after the body, receive() waits for a disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise StarletteHTTPException(
                    408,
                    f"The request body stopped arriving for {self.timeout_s:g} s "
                    "(lazyrag serve --body-timeout): send it whole.",
                ) from None
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                body_done[0] = not message.get("more_body", False)
                if received[0] > self.limit:  # FastAPI lets an HTTPException out of its body parsing as it is
                    raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, counted_receive, send)


class _Gate:
    """Pure ASGI middleware: the API key, the request-size limit and the per-status request counter.

    Not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware hands the endpoint a ``receive`` on which
    ``Request.is_disconnected()`` never turns true, so a non-streaming client that hung up went on generating.
    """

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


def create_app(engine: "LazyEngine", config: ServerConfig, retriever: "Retriever | None" = None) -> FastAPI:
    """The app for one engine. ``retriever`` (over the store attached to ``engine``) serves chat requests
    that bring no chunks."""
    app = FastAPI(
        title="lazyrag",
        description="OpenAI-compatible server with reusable, position-free chunk KV",
        version=__version__,
    )
    if config.max_model_len is not None and not 0 < config.max_model_len <= engine.max_context:
        raise ValueError(
            f"max_model_len (--max-model-len) {config.max_model_len} must be from 1 to the model's context, "
            f"{engine.max_context} tokens (its max_position_embeddings)."
        )
    if config.api_key_covers not in ("v1", "all"):
        raise ValueError(f"api_key_covers must be 'v1' or 'all'; got {config.api_key_covers!r}.")
    max_len = config.max_model_len or engine.max_context  # prompt plus answer, in tokens
    metrics = ServerMetrics(engine)
    pending = [0]  # generations admitted and not finished (one event loop: no lock needed)
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, config

    # -- errors: OpenAI's JSON shape, never a traceback ------------------------------------------

    _error = json_error

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}" for err in e.errors()[:5]
        )
        param = next((str(err["loc"][-1]) for err in e.errors() if err.get("loc")), None)
        return _error(422, f"Invalid request: {problems}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return http_error(e)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        # the details (paths, traceback) go to the server's log, never to the client
        ref = uuid.uuid4().hex[:12]
        log.error("error %s on %s %s", ref, request.method, request.url.path, exc_info=e)
        from lazyrag.store.corpus import StoreError

        if isinstance(e, StoreError):
            return _error(
                503,
                f"The server's corpus store could not be read (error {ref}: the server's log says why; "
                "its operator may need to rebuild or reopen the store).",
                "server_error",
            )
        return _error(
            500, f"Internal error ({type(e).__name__}, error {ref}: the server's log has the details).", "server_error"
        )

    app.add_middleware(_Gate, config=config, metrics=metrics)
    if config.allowed_origins:  # added last, so outermost: a browser's preflight is answered before the API key check
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )

    # -- plain endpoints ------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        problem = engine.health_problem()
        if problem is not None:  # e.g. a tensor-parallel rank died: a load balancer must stop sending here
            return JSONResponse({"status": "error", "error": problem, "model": config.model_name}, status_code=503)
        return {"status": "ok", "model": config.model_name, "requests_in_flight": pending[0]}

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.in_flight.set(pending[0])
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def _messages(messages: list[ChatMessage]) -> list[dict]:
        try:
            return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's /tokenize: a prompt, or chat messages through the chat template (with lazyrag's default system
        turn when they bring none, as /v1/chat/completions renders them), as token ids."""
        _check_model(body.model)
        tokenizer = engine.tokenizer
        chat = body.messages is not None
        messages = _messages(body.messages) if body.messages is not None else None

        def run() -> list[int]:
            text = body.prompt
            if messages is not None:
                assert engine.prompts is not None  # a served engine has a tokenizer
                text = engine.prompts.render(messages, body.add_generation_prompt)
            special = (not chat) if body.add_special_tokens is None else body.add_special_tokens
            return list(tokenizer(text, add_special_tokens=special).input_ids)

        ids = await asyncio.to_thread(run)
        out = {"count": len(ids), "max_model_len": max_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model)
        vocab = len(engine.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the tokenizer's vocabulary [0, {vocab}).", param="tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)}

    @app.get("/v1/models")
    async def models():
        card = {"object": "model", "created": now(), "owned_by": "lazyrag", "max_model_len": max_len}
        return {"object": "list", "data": [{"id": name, **card} for name in (config.model_name,)]}

    # -- requests into the engine ----------------------------------------------------------------

    def _check_model(model: str | None) -> None:
        if model is not None and model not in (config.model_name, *config.aliases):
            raise APIError(
                404,
                f"The model {model!r} does not exist here; this server serves {config.model_name!r} (GET /v1/models).",
                "invalid_request_error",
                "model",
            )

    def _check(body: _Common, generations: int) -> None:
        """Refuse what is wrong with the request before any work; else reserve its generations under
        --max-pending (released by _done, or by _release when the request fails before it is submitted)."""
        _check_model(body.model)
        bad = body.unsupported()
        if bad:
            raise APIError(
                400,
                f"Not supported by lazyrag serve: {', '.join(bad)}. Leave them out.",
                "invalid_request_error",
                bad[0].split()[0],
            )
        if generations > config.max_pending:  # never fits, however idle the server: retrying cannot help
            raise APIError(
                400,
                f"The request asks for {generations} generations (prompts x n) and this server's --max-pending "
                f"is {config.max_pending}: split the request, or start the server with a larger --max-pending.",
                "invalid_request_error",
                "n",
            )
        if pending[0] + generations > config.max_pending:
            raise APIError(
                503,
                f"The server has {pending[0]} generations in flight and the request asks for "
                f"{generations} (--max-pending {config.max_pending}); retry shortly.",
                "server_overloaded",
            )
        pending[0] += generations

    _flag = " (lazyrag serve --max-model-len)" if config.max_model_len else ""

    def _release(generations: int) -> None:
        pending[0] -= generations

    def _params(body: _Common, max_tokens: int | None, num_prompt_tokens: int, choice: int):
        from lazyrag.engine import SamplingParams

        room = max_len - num_prompt_tokens
        # worded as vLLM and OpenAI word it: clients (LiteLLM, ...) recognise a context overflow by it
        limit = f"This model's maximum context length is {max_len} tokens{_flag}."
        if room < 1:
            raise APIError(
                400,
                f"{limit} However, your request has {num_prompt_tokens} input tokens: send fewer or "
                "shorter documents or messages.",
                param="messages",
            )
        asked = max_tokens or config.max_tokens
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"{limit} However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} in max_tokens): ask for at most {room}.",
                param="max_tokens",
            )
        seed = None if body.seed is None else (body.seed + choice) % 2**63
        try:
            return SamplingParams(
                max_new_tokens=min(asked, room),
                temperature=config.temperature if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
                seed=seed,
                strategy=body.strategy or config.strategy,
                top_k=-1 if body.top_k is None else body.top_k,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                logprobs=body.engine_logprobs(),
                ignore_eos=bool(body.ignore_eos),
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def _retrieved(question: str, k: int) -> list[str]:
        if retriever is None:
            raise APIError(
                400, "retrieve: true needs a corpus store: start the server with --store STORE.", param="retrieve"
            )
        try:
            check_text(question, "the question")
        except ValueError as e:
            raise APIError(400, str(e)) from None
        hits = await asyncio.to_thread(retriever.retrieve, question, k)  # k is clamped to the store's size there
        return [h.text for h in hits]

    def _with_documents(content: str, documents: list[str]) -> str:
        """The user's content with the documents before it, laid out as ``engine.build_prompt`` lays them
        out, so a request through the server reuses the same chunk KV as one from Python."""
        engine.register_chunks(documents)
        assert engine.prompts is not None  # a served engine has a tokenizer
        return engine.prompts.user_content(content, documents)

    async def _chat_layout(body: ChatCompletionRequest):
        messages = _messages(body.messages)
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise APIError(400, "messages hold no user message: nothing to answer.", param="messages")
        last = users[-1]
        documents = body.document_texts()

        def rendered() -> tuple[str, bool]:  # tokenizer and chunk-finder work, here and below: off the event loop
            if documents is None and config.pasted_context:
                engine.register_pasted(messages)
            text = engine.render_chat(messages)
            return text, retriever is not None and bool(engine.chunk_finder.find(text))

        text, holds_known = await asyncio.to_thread(rendered)
        # retrieve when asked to, or by default when a store is attached and the text holds no known chunk
        if documents is None and (
            body.retrieve or (body.retrieve is None and retriever is not None and not holds_known)
        ):
            documents = await _retrieved(messages[last]["content"], body.k or config.k)

        def laid_out():
            if not documents:
                return engine.layout_from_text(text)
            messages[last] = {"role": "user", "content": _with_documents(messages[last]["content"], documents)}
            return engine.layout_from_text(engine.render_chat(messages))

        return await asyncio.to_thread(laid_out)

    async def _completion_layout(prompt: str, body: CompletionRequest):
        documents = body.document_texts()
        if documents is None and body.retrieve:
            documents = await _retrieved(prompt, body.k or config.k)

        def laid_out():
            if (
                documents
            ):  # the prompt is the question of the engine's RAG prompt, as engine.generate(prompt, documents)
                return engine.layout_from_text(
                    engine.render_chat([{"role": "user", "content": _with_documents(prompt, documents)}])
                )
            if config.pasted_context:
                engine.register_pasted(prompt)
            return engine.layout_from_text(prompt)  # raw text: known chunks inside it are still reused

        return await asyncio.to_thread(laid_out)

    async def _submit(layouts: list, body: _Common, max_tokens: int | None) -> list["RequestStream"]:
        """One engine request per choice (a prompt's ``n`` choices, or one per prompt of a completion batch)."""
        streams = []
        try:
            for i, layout in enumerate(layouts):
                streams.append(engine.submit(layout, _params(body, max_tokens, layout.num_tokens, i)))
        except BaseException as e:
            for s in streams:  # the choices already queued do not run without the others
                s.close(wait=False)
            _release(len(layouts))
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            raise
        return streams

    def _done(streams: list["RequestStream"]) -> None:
        for s in streams:
            if not s.request.done:
                metrics.aborted.inc()
                s.close(wait=False)  # the client went away: the driver frees its blocks at its next step
        pending[0] -= len(streams)

    async def _results(streams: list["RequestStream"], http: Request) -> list["GenerationResult"]:
        """Every stream's result; the client hanging up aborts them all (their blocks are freed)."""
        tasks = [asyncio.ensure_future(s.aresult()) for s in streams]
        try:
            while True:
                done, _ = await asyncio.wait(tasks, timeout=0.5)
                if len(done) == len(tasks):
                    break
                if await http.is_disconnected():
                    raise asyncio.CancelledError("client disconnected")
            results = [t.result() for t in tasks]  # a request's own error is raised here
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(500, f"The request failed inside the engine: {e}", "server_error") from None
        finally:
            for t in tasks:
                t.cancel()
            _done(streams)
        for r in results:
            metrics.finished(r)
        return results

    async def _merged(streams: list["RequestStream"]) -> AsyncIterator[tuple[int, str | None]]:
        """(choice index, text delta) as any choice produces it; (index, None) when that choice ends."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream):
            try:
                async for delta in stream:
                    await queue.put((i, delta))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            ended = 0
            while ended < len(streams):
                item = await queue.get()
                ended += item[1] is None
                yield item
        finally:
            for t in tasks:
                t.cancel()

    def _finish_reason(result: "GenerationResult") -> str:
        return "stop" if result.finish_reason == "stop" else "length"

    def _usage(results: list["GenerationResult"]) -> dict:
        s = [r.stats for r in results]
        return usage(sum(x.prompt_tokens for x in s), sum(x.new_tokens for x in s), sum(x.tokens_reused for x in s))

    def _lazyrag_info(results: list["GenerationResult"]) -> dict:
        """What lazyrag adds to a response: per choice, the reuse stats and time to first token."""
        return {"choices": [{"ttft_s": r.ttft_s, "total_s": r.total_s, **r.stats.as_dict()} for r in results]}

    def _chat_logprobs(logprobs) -> dict:
        return {**openai_chat_logprobs(logprob_entries(engine.tokenizer, logprobs)), "refusal": None}

    def _completion_logprobs(logprobs, offset: int = 0) -> dict:
        return openai_completion_logprobs(logprob_entries(engine.tokenizer, logprobs), offset)

    class _LogprobsSent:
        """A streamed choice's logprobs: each chunk carries those of the tokens generated since the last one."""

        def __init__(self, stream, chat: bool):
            self.request, self.chat, self.sent, self.offset = stream.request, chat, 0, 0

        def next(self):
            if self.request.logprobs is None:
                return None
            new = self.request.logprobs[self.sent :]
            self.sent += len(new)
            if self.chat:
                return _chat_logprobs(new)
            out = _completion_logprobs(new, self.offset)
            self.offset += sum(map(len, out["tokens"]))
            return out

    def _sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    def _streaming(streams, chunk_of, head: dict, include_usage: bool, chat: bool) -> StreamingResponse:
        """``chunk_of(i, delta, finish_reason, logprobs)``: choice i's event (delta None: its opening one, or None)."""
        sent = [_LogprobsSent(s, chat) for s in streams]

        async def events():
            try:
                for i in range(len(streams)):
                    opening = chunk_of(i, None, None)
                    if opening is not None:
                        yield _sse(opening)
                async for i, delta in _merged(streams):
                    if delta is not None:
                        yield _sse(chunk_of(i, delta, None, sent[i].next()))
                        continue
                    try:
                        result = streams[i].request.result()
                    except Exception as e:  # the request's own fault: reported in the stream, others go on
                        yield _sse(error_body(f"The request failed inside the engine: {e}", "server_error", 500))
                        continue
                    metrics.finished(result)
                    yield _sse(chunk_of(i, "", _finish_reason(result), sent[i].next()))
                if include_usage:
                    results = [s.request.result() for s in streams if s.request.error is None]
                    yield _sse({**head, "choices": [], "usage": _usage(results), "lazyrag": _lazyrag_info(results)})
                yield _sse("[DONE]")
            finally:
                _done(streams)  # also on a client that hung up: Starlette cancels this generator

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        _check(body, body.n)
        try:
            layout = await _chat_layout(body)
        except BaseException as e:
            _release(body.n)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="messages") from None
            raise
        streams = await _submit([layout] * body.n, body, body.max_completion_tokens or body.max_tokens)
        rid, created = new_id("chatcmpl"), now()
        head = {"id": rid, "created": created, "model": config.model_name}
        if body.stream:

            def chunk_of(i, delta, reason, logprobs=None):
                d = {"role": "assistant", "content": ""} if delta is None else ({"content": delta} if delta else {})
                return {
                    **head,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": d, "finish_reason": reason, "logprobs": logprobs}],
                }

            return _streaming(
                streams, chunk_of, {**head, "object": "chat.completion.chunk"}, body.include_usage(), chat=True
            )
        results = await _results(streams, http)
        return {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r.text},
                    "finish_reason": _finish_reason(r),
                    "logprobs": None if r.logprobs is None else _chat_logprobs(r.logprobs),
                }
                for i, r in enumerate(results)
            ],
            "usage": _usage(results),
            "lazyrag": _lazyrag_info(results),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is an empty list: send a string or a list of strings.", param="prompt")
        _check(body, len(prompts) * body.n)
        try:
            layouts = [await _completion_layout(p, body) for p in prompts]
        except BaseException as e:
            _release(len(prompts) * body.n)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="prompt") from None
            raise
        streams = await _submit([lay for lay in layouts for _ in range(body.n)], body, body.max_tokens)
        rid, created = new_id("cmpl"), now()
        head = {"id": rid, "created": created, "model": config.model_name}
        if body.stream:

            def chunk_of(i, delta, reason, logprobs=None):
                if delta is None:
                    return None  # completions streams have no role chunk
                return {
                    **head,
                    "object": "text_completion",
                    "choices": [{"index": i, "text": delta, "finish_reason": reason, "logprobs": logprobs}],
                }

            return _streaming(
                streams, chunk_of, {**head, "object": "text_completion"}, body.include_usage(), chat=False
            )
        results = await _results(streams, http)
        return {
            **head,
            "object": "text_completion",
            "choices": [
                {
                    "index": i,
                    "text": r.text,
                    "finish_reason": _finish_reason(r),
                    "logprobs": None if r.logprobs is None else _completion_logprobs(r.logprobs),
                }
                for i, r in enumerate(results)
            ],
            "usage": _usage(results),
            "lazyrag": _lazyrag_info(results),
        }

    return app


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
