"""Several ``lazyrag serve`` replicas behind one OpenAI-compatible endpoint, on Ray Serve.

    lazyrag serve --replicas 2 [--router chunk_affinity] [--store stores/nq] ...

Each replica is one Ray Serve deployment (one actor) running the very app of ``lazyrag serve``
(``lazyrag.server.build_app``: same endpoints, errors, streaming and metrics) over its own engine, called in process
through ASGI; all replicas may attach one corpus store on a shared filesystem (read-only: one
``lazyrag precache`` writes it beforehand). A front deployment takes the HTTP traffic, computes the
content keys of a request's ``documents`` (the chunks it brings), asks the router
(``lazyrag/server/routing.py``) where to send it, and relays the answer. Replicas publish the chunk
keys entering and leaving their pools (``CacheManager.subscribe``); the front polls them.

Faults: a request whose replica fails before any byte of the answer was sent is retried on another
replica; one that fails mid-stream ends with an error event for that client alone. A replica that fails
a request or a health check is marked down and gets nothing until it answers again (Ray Serve restarts
a dead replica; its cache starts empty). Every other request goes on.

The same code spans one host or a cluster: ``ray start --head`` on one machine and ``ray start
--address ...`` on others, then this command on the head (``--ray-address auto``).

Exposure: the front's HTTP proxy listens on ``--host`` (loopback unless asked) and checks the API key
(``--api-key``, ``--api-key-covers``) with the rule of ``lazyrag serve`` before it routes anything. A Ray
this command starts itself (no ``--ray-address``) runs without its dashboard. Ray's own ports listen on the
node's address (Ray has no loopback-only mode: it turns a 127.0.0.1 node address into the host's); what
guards them is Ray's token authentication, which Ray turns on for a new local cluster (2.60 does, saying
so; ``RAY_AUTH_MODE`` is Ray's switch, read when ray is imported). A cluster joined with ``--ray-address``
keeps its own settings.
"""

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from lazyrag.kv.identity import chunk_key
from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE

log = logging.getLogger("lazyrag.replicas")
REPLICA_HEADER = "x-lazyrag-replica"


@dataclass
class ReplicaSpec:
    """What every replica is started with (the engine's and the server's settings)."""

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    kv_budget: int | None = None
    encoding_passage: str | None = DEFAULT_ENCODING_PASSAGE  # EngineConfig's
    store: str | None = None  # a corpus store path every replica can read
    embedder: str | None = (
        None  # the store's embedder as the user named it (serve --embedder; retriever.store_embedder)
    )
    cache: dict = field(default_factory=dict)  # CacheConfig fields (serve --host-gb, --cache-admission)
    adapter: str | None = None  # EngineConfig's: a LoRA adapter merged at load
    server: dict = field(default_factory=dict)  # ServerConfig fields (model_name set from the engine if absent)
    scheduler: dict = field(default_factory=dict)  # SchedulerConfig fields (serve --max-num-seqs, ...)
    seed: int | None = None  # serve --seed: each replica seeds its sampling generators once loaded


async def call_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes):
    """Run one HTTP request through an ASGI app in process; yields its ``http.response.*`` messages as the app
    sends them (a streaming response arrives piece by piece). Closing the generator disconnects the client."""
    sent: asyncio.Queue = asyncio.Queue()
    done_reading = asyncio.Event()

    async def receive():
        if not done_reading.is_set():
            done_reading.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # nothing more to read until the app is cancelled (a disconnect)

    async def send(message):
        await sent.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("front", 0),
        "server": ("replica", 80),
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the app ended without a full response: its error
                getter.cancel()
                task.result()
                raise RuntimeError("the replica's app ended without a response")
            message = getter.result()
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
    finally:
        if not task.done():
            task.cancel()


class LazyragReplica:
    """One engine and its ``lazyrag serve`` app (a Ray Serve deployment's class)."""

    def __init__(self, spec: dict):
        from lazyrag.engine import LazyEngine, SchedulerConfig
        from lazyrag.server.app import build_app, model_aliases, seed_sampling
        from lazyrag.server.config import ServerConfig

        settings = ReplicaSpec(**spec)
        kw: dict[str, Any] = {"kv_budget": settings.kv_budget} if settings.kv_budget else {}
        if settings.scheduler:
            kw["scheduler"] = SchedulerConfig(**settings.scheduler)
        if settings.cache:
            from lazyrag.kv.cache import CacheConfig

            kw["cache"] = CacheConfig(**settings.cache)
        self.engine = LazyEngine.from_pretrained(
            settings.model,
            device=settings.device,
            dtype=settings.dtype,
            adapter=settings.adapter,
            encoding_passage=settings.encoding_passage,
            **kw,
        )
        if settings.seed is not None:
            seed_sampling(settings.seed)
        retriever = None
        if settings.store is not None:
            from lazyrag.store.retriever import Retriever

            retriever = Retriever(self.engine.attach_store(settings.store), settings.embedder)
        named = (
            "model_name" in settings.server
        )  # --served-model-name or MODEL: the names serve gives (aliases too), as vLLM does
        config = ServerConfig(
            **{
                "model_name": self.engine.model_name,
                "aliases": () if named else model_aliases(self.engine.model_name),
                **settings.server,
            }
        )
        self.app = build_app(self.engine, config, retriever)
        self._events: deque = deque()
        self.engine.cache.subscribe(lambda event, key: self._events.append((event, key)))

    def identity(self) -> dict:
        """What the front needs to compute this replica's chunk keys: the model fingerprint and encoding prefix."""
        prompts = self.engine.require_prompts()
        return {
            "fingerprint": self.engine.fingerprint,
            "prefix_ids": prompts.prefix_ids(),
            "passage_ids": prompts.passage_ids(),
            "model_name": self.engine.model_name,
            "held": self.engine.cache.resident_keys(),
        }

    def kv_events(self) -> list[tuple[str, str]]:
        """The KV events since the last call (stored / removed chunk keys), oldest first."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def check_health(self) -> None:  # Ray Serve's health check: the engine answers
        assert self.engine.cache is not None

    async def serve_http(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """The app's response messages for one HTTP request (a streaming generator across Ray)."""
        async for message in call_asgi(self.app, method, path, query, headers, body):
            yield message


class ChunkKeys:
    """The content keys a replica files a request's ``documents`` under, computed without the model's weights:
    its tokenizer, fingerprint and encoding prefix (from ``LazyragReplica.identity``)."""

    def __init__(self, model: str | None, identity: dict, system_prompt: str | None = None):
        from transformers import AutoTokenizer

        from lazyrag.model.loader import resolve_model_source
        from lazyrag.prompt import DEFAULT_SYSTEM_PROMPT, PromptBuilder

        source = resolve_model_source(model)
        tokenizer = AutoTokenizer.from_pretrained(source.folder, **source.kwargs())
        self.prompts = PromptBuilder(tokenizer, system_prompt or DEFAULT_SYSTEM_PROMPT)
        self.prefix_ids = list(identity["prefix_ids"])
        # the planner's own key rule (``Strategy.chunk_key``), no cache needed
        self.fingerprint, self.passage_ids = identity["fingerprint"], list(identity["passage_ids"])

    def __call__(self, documents: list[str]) -> list[str]:
        return [
            chunk_key(self.fingerprint, self.prefix_ids, self.prompts.encode_chunk(d), self.passage_ids)
            for d in documents
        ]


def documents_of(body: bytes) -> tuple[list[str], bool]:
    """(the request's ``documents``, whether it asks to stream); a body that is not JSON routes with no keys."""
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return [], False
    if not isinstance(data, dict):
        return [], False
    docs = data.get("documents") or []
    return [d for d in docs if isinstance(d, str)] if isinstance(docs, list) else [], bool(data.get("stream"))


class KeyGate:
    """Pure ASGI middleware of the front: ``lazyrag serve``'s API key rule (``middleware.key_refused``), checked before
    the front reads a body or routes anything."""

    def __init__(self, app, api_key: str | None, covers: str = "v1"):
        if covers not in ("v1", "all"):
            raise ValueError(f"api_key_covers must be 'v1' or 'all'; got {covers!r}.")
        self.app, self.api_key, self.covers = app, api_key, covers

    async def __call__(self, scope, receive, send):
        from lazyrag.server.errors import json_error
        from lazyrag.server.middleware import WRONG_KEY, key_refused, route_path

        if scope["type"] == "http" and key_refused(
            self.api_key, self.covers, route_path(scope), dict(scope["headers"]).get(b"authorization", b"")
        ):
            return await json_error(401, WRONG_KEY, "authentication_error")(scope, receive, send)
        await self.app(scope, receive, send)


def add_front_gates(front_api: FastAPI, server: dict, api_key: str | None, covers: str = "v1") -> None:
    """The front's checks, before it reads a body or routes anything: ``lazyrag serve``'s API key (``KeyGate``,
    outermost), then the replicas' own body limits (``server``'s ``max_request_bytes`` and ``body_timeout_s``,
    ``lazyrag serve --max-request-mb / --body-timeout``), answered in OpenAI's error shape."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from lazyrag.server.config import ServerConfig
    from lazyrag.server.errors import http_error_handler
    from lazyrag.server.middleware import BodyLimits

    defaults = {f.name: f.default for f in fields(ServerConfig)}
    limits = {k: server.get(k, defaults[k]) for k in ("max_request_bytes", "body_timeout_s")}
    front_api.add_middleware(BodyLimits, **limits)
    front_api.add_middleware(KeyGate, api_key=api_key, covers=covers)
    front_api.exception_handler(StarletteHTTPException)(http_error_handler)


class FrontRelay:
    """The front's work (the base of its Ray Serve deployment, whose routes ``build_app`` declares): the replicas'
    chunk keys and liveness, polled, and each request relayed to the replica the router picks."""

    def __init__(self, handles: dict, router, spec: ReplicaSpec, poll_s: float):
        self.handles, self.router, self.spec, self.poll_s = handles, router, spec, poll_s
        self.keys: ChunkKeys | None = None
        self._poller = None

    async def _ready(self):
        if self.keys is None:
            identity = await next(iter(self.handles.values())).identity.remote()
            self.keys = await asyncio.to_thread(
                ChunkKeys, self.spec.model, identity, self.spec.server.get("system_prompt")
            )
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self):
        """Apply the replicas' KV events and mark replicas up or down by whether they answer."""
        while True:
            for name, handle in self.handles.items():
                try:
                    events = await asyncio.wait_for(handle.kv_events.remote(), timeout=5)
                except Exception:
                    self.router.mark_down(name)
                    continue
                replica = self.router.replicas[name]
                if not replica.alive:
                    self.router.mark_up(name)
                for event, key in events:
                    replica.on_kv_event(event, key)
            await asyncio.sleep(self.poll_s)

    def routing(self) -> dict:
        return {
            n: {"alive": r.alive, "held": len(r.held), "in_flight": r.in_flight}
            for n, r in self.router.replicas.items()
        }

    async def _opened(self, request: Request, path: str, body: bytes):
        """(route, the replica's answer stream, its first message), from the first replica that answers; or the
        error response when none is up or every one up has failed this request."""
        from lazyrag.server.protocol import error_body
        from lazyrag.server.routing import NoReplica

        documents, _ = documents_of(body)
        assert self.keys is not None  # _ready made it
        keys = self.keys(documents) if documents else []
        headers = [(k.encode(), v.encode()) for k, v in request.headers.items()]
        tried = set()
        while True:
            try:
                route = self.router.start(keys)
            except NoReplica as e:
                return JSONResponse(error_body(str(e), "server_error", 503), status_code=503)
            if route.replica in tried:  # every replica up has failed this request
                self.router.finish(route)
                return JSONResponse(
                    error_body("every replica failed this request", "server_error", 502), status_code=502
                )
            tried.add(route.replica)
            stream = (
                self.handles[route.replica]
                .options(stream=True)
                .serve_http.remote(request.method, "/" + path, request.url.query.encode(), headers, body)
            )
            try:
                return route, stream, await stream.__anext__()
            except Exception as e:  # nothing sent yet: mark it down, try another replica
                log.warning("lazyrag: %s failed a request before answering (%s); retrying elsewhere", route.replica, e)
                self.router.finish(route)
                self.router.mark_down(route.replica)

    async def relayed(self, path: str, request: Request):
        await self._ready()
        opened = await self._opened(request, path, await request.body())
        if isinstance(opened, JSONResponse):
            return opened
        route, stream, start = opened
        out_headers = {
            k.decode(): v.decode()
            for k, v in start.get("headers", [])
            if k.lower() not in (b"content-length", b"transfer-encoding")
        }
        out_headers[REPLICA_HEADER] = route.replica
        return StreamingResponse(self._body_parts(route, stream), status_code=start["status"], headers=out_headers)

    async def _body_parts(self, route, stream):
        from lazyrag.server.protocol import error_body

        try:
            async for message in stream:
                if message.get("body"):
                    yield message["body"]
        except Exception as e:  # the replica died mid-answer: this client alone gets an error event
            self.router.mark_down(route.replica)
            yield (
                "data: "
                + json.dumps(error_body(f"replica {route.replica} failed mid-answer: {e}", "server_error", 502))
                + "\n\n"
            ).encode()
        finally:
            self.router.finish(route)


def build_app(
    spec: ReplicaSpec,
    replicas: int = 2,
    router: str = "chunk_affinity",
    poll_s: float = 0.2,
    replica_options: dict | None = None,
    api_key: str | None = None,
    api_key_covers: str = "v1",
):
    """The Ray Serve application: ``replicas`` replica deployments and the front that routes to them.
    ``api_key``: what every request to the front must bring (``lazyrag serve --api-key``; None: no key)."""
    from ray import serve

    from lazyrag.server.routing import make_router

    assert replicas >= 1
    names = [f"replica-{i}" for i in range(replicas)]
    options = {
        "ray_actor_options": {"num_cpus": 0},
        "health_check_period_s": 2,
        "health_check_timeout_s": 10,
        "max_ongoing_requests": 1024,
        **(replica_options or {}),
    }
    Replica = serve.deployment(LazyragReplica, **options)
    front_api = FastAPI(title="lazyrag replicas")
    add_front_gates(front_api, spec.server, api_key, api_key_covers)

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    @serve.ingress(front_api)
    class Front(FrontRelay):  # the routes are declared here, on this front's own FastAPI app
        def __init__(self, *handles):
            super().__init__(dict(zip(names, handles)), make_router(router, names), spec, poll_s)

        @front_api.get("/routing")
        async def routing_state(self):
            """Each replica's state as the router sees it (alive, chunks held, requests in flight)."""
            await self._ready()
            return self.routing()

        @front_api.api_route("/{path:path}", methods=["GET", "POST"])
        async def relay(self, path: str, request: Request):
            return await self.relayed(path, request)

    # ray's stubs: serve.deployment's overloads give a Callable, and the decorated class keeps its own type
    replicas_bound = [Replica.options(name=n).bind(asdict(spec)) for n in names]  # type: ignore[attr-defined]
    return Front.bind(*replicas_bound)  # type: ignore[attr-defined]


def ray_init_options(ray_address: str | None) -> dict:
    """``ray.init``'s arguments: join ``ray_address`` as it is set up, or start a local Ray without its dashboard.
    (No ``_node_ip_address="127.0.0.1"``: Ray replaces a loopback node address with the host's.)"""
    if ray_address is not None:
        return {"address": ray_address, "log_to_driver": False}
    return {"include_dashboard": False, "log_to_driver": False}


def run(
    spec: ReplicaSpec,
    replicas: int,
    router: str,
    host: str,
    port: int,
    ray_address: str | None = None,
    blocking: bool = True,
    replica_options: dict | None = None,
    api_key: str | None = None,
    api_key_covers: str = "v1",
):
    """Start Ray (or join ``ray_address``), deploy, and serve on ``host:port`` until interrupted.
    ``replica_options``: Ray Serve deployment options of each replica (e.g. ``{"ray_actor_options": {"num_cpus": 0,
    "num_gpus": 0.5}}`` for two replicas sharing one GPU; without ``num_gpus`` a replica sees every GPU of its host).
    ``api_key``, ``api_key_covers``: as ``lazyrag serve``'s (``KeyGate``)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(**ray_init_options(ray_address))
    serve.start(http_options={"host": host, "port": port})
    app = build_app(
        spec, replicas, router, replica_options=replica_options, api_key=api_key, api_key_covers=api_key_covers
    )
    handle = serve.run(app, name="lazyrag", route_prefix="/")
    if blocking:
        _serve_until_interrupted()
    return handle


def _serve_until_interrupted() -> None:
    from ray import serve

    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
