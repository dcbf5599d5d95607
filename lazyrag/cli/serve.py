"""``lazyrag serve``: the model over HTTP with the OpenAI API (one engine, or replicas on Ray Serve)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lazyrag.cli.common import (
    HelpFormatter,
    UsageError,
    adapter_arg,
    adapter_kwargs,
    check_embedder,
    check_model,
    check_store,
    model_args,
    passage_arg,
    passage_kwargs,
    require,
    size_arg,
    store_embedder_arg,
    tensor_parallel_arg,
    tensor_parallel_kwargs,
)
from lazyrag.defaults import API_KEY_ENV, MAX_K
from lazyrag.strategy_names import check_strategy

SERVE_HELP = """\
Serve the model over HTTP with the OpenAI API, the way vLLM and SGLang are run: any OpenAI client
(the openai package, LangChain's ChatOpenAI, LlamaIndex's OpenAILike) points its base URL at
http://HOST:PORT/v1 and works unchanged; every chunk's KV is cached once and reused at any position.

MODEL, as for `vllm serve`: a local Llama, Mistral, Qwen2/2.5 or Qwen3 folder, a .gguf file, or a Hugging
Face model id found in the local Hugging Face cache (never downloaded: `hf download ID` first); clients then
send it as "model" (the model's folder or file name is accepted too). --config FILE.yaml takes any option below as a
key (port: 8001, max-num-seqs: 32, ...); options on the command line win over the file's.

Endpoints: POST /v1/chat/completions and /v1/completions (stream=true for server-sent events),
GET /v1/models, /health, /metrics (Prometheus: requests, TTFT and inter-token histograms, chunk
hits and misses, cache bytes per tier), and vLLM's GET /version, POST /tokenize and /detokenize.

Chunks reach a request three ways: an extra "documents" field (a list of texts), chunks already
known to the engine found inside the message text, or, with --store, the top --k chunks retrieved
for the last user message. Extra request fields: "documents", "strategy", "k", "retrieve", and vLLM's
"top_k" and "repetition_penalty"; logprobs (chat: logprobs/top_logprobs, completions: logprobs) and
presence/frequency penalties as in OpenAI's API.
usage.prompt_tokens_details.cached_tokens counts the prompt tokens whose KV was reused (the shared
prefix's included; the response's "lazyrag" stats split it into prefix_tokens_reused and chunk_tokens_reused).
"""

SERVE_EPILOG = """\
examples:
  lazyrag serve                                           # embedded model on http://127.0.0.1:8000/v1
  lazyrag serve --store stores/nq --k 5                   # answer questions from a pre-cached corpus
  lazyrag serve ~/models/Llama-3.1-8B-Instruct --device cuda --host 0.0.0.0 --api-key "$KEY"
  lazyrag serve HuggingFaceTB/SmolLM2-135M-Instruct --max-model-len 4096 --max-num-seqs 32   # from the HF cache
  lazyrag serve --config serve.yaml --port 8001           # options from a YAML file; the command line wins
  lazyrag serve --allowed-origins '["http://localhost:3000"]' --ssl-keyfile key.pem --ssl-certfile cert.pem
  lazyrag serve --replicas 2 --store stores/nq           # 2 engines behind one endpoint, on Ray Serve

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "messages": [{"role": "user", "content": "Who discovered penicillin?"}],
    "documents": ["Alexander Fleming discovered penicillin in 1928."], "stream": true}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-');
  print(c.chat.completions.create(model='SmolLM2-135M-Instruct', messages=[{'role': 'user', 'content': 'Hi'}]))"

  curl http://127.0.0.1:8000/tokenize -H 'Content-Type: application/json' -d '{"prompt": "Hello there"}'
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat, completions, streaming, metrics)",
        description=SERVE_HELP,
        epilog=SERVE_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model takes it (either one; default: the embedded SmolLM2-135M-Instruct)",
    )
    model_args(p)
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="read options from a YAML file: keys are the options' names without -- (dashes or underscores: "
        "max-num-seqs or max_num_seqs), e.g. {model: ~/models/x, port: 8001, allowed-origins: ['*']}; "
        "options given on the command line override the file's",
    )
    adapter_arg(p)
    passage_arg(p)
    tensor_parallel_arg(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s; 0.0.0.0 for every interface)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id clients send and /v1/models lists; more names are accepted too (default: MODEL as "
        "given, also answering to the model's folder or file name; without MODEL, the model's name)",
    )
    _request_default_args(p)
    _cache_args(p)
    _request_limit_args(p)
    _scheduler_args(p)
    _http_args(p)
    _replica_args(p)
    return p


def _request_default_args(p: argparse.ArgumentParser) -> None:
    """Retrieval from a store, and what requests that name none get."""
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="a corpus store from `lazyrag precache`: its chunk KV is "
        "loaded from disk, and chat requests that bring no chunks get the top --k retrieved from it",
    )
    p.add_argument(
        "--k",
        type=int,
        default=5,
        help=f"chunks retrieved per chat request from --store (default: %(default)s, at most {MAX_K})",
    )
    store_embedder_arg(p)
    p.add_argument(
        "--strategy",
        default="lazy+recover",
        help="the strategy of requests that name none (default: %(default)s; "
        "lazy is fastest, full is the quality reference; see `lazyrag ask --help`)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=256, help="max_tokens of requests that give none (default: %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="temperature of requests that give none (default: %(default)s, greedy)",
    )


def _cache_args(p: argparse.ArgumentParser) -> None:
    """The KV pool, the host tier below it, and the pool's admission filter."""
    p.add_argument(
        "--kv-budget",
        type=size_arg("--kv-budget"),
        default=None,
        metavar="SIZE",
        help="the paged KV pool: 4GiB, 512MB, or a bare number of GiB (default: 1GiB on CPU, 8GiB on CUDA)",
    )
    p.add_argument(
        "--host-gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="a host-RAM tier below the GPU pool (GiB, page-locked): chunk KV evicted from the pool, or not "
        "admitted for want of room, waits there and comes back by a copy instead of an encode (default: none)",
    )
    p.add_argument(
        "--cache-admission",
        action="store_true",
        help="when the pool is full, keep a new chunk only if it was asked for at least as often as the chunks it "
        "would evict (TinyLFU): popular documents stay cached under a stream of one-off ones (at a 1 GB pool on an "
        "H200, +17%% requests/s on a Zipf-popular corpus; benchmarks/NOTES.md). Default: plain LRU",
    )


def _request_limit_args(p: argparse.ArgumentParser) -> None:
    """What a request may bring and who may send it: limits, the API key, pasted context."""
    p.add_argument(
        "--max-pending",
        type=int,
        default=256,
        help="generations in flight before new requests get HTTP 503; a request's n choices times its prompts "
        "count, reserved before any retrieval or tokenizing (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=8.0,
        metavar="MB",
        help="a larger request body gets HTTP 413 before it is read (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else no key). A key on the "
        "command line shows in `ps`: prefer the variable or --api-key-file",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request body whose next part takes longer than this gets HTTP 408 (default: %(default)s)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="uvicorn's: connections and tasks at once before new ones get HTTP 503 (default: no limit). Slow "
        "clients that never finish their headers are a reverse proxy's to stop (nginx, a load balancer)",
    )
    p.add_argument(
        "--api-key-file", type=Path, default=None, metavar="PATH", help="read the API key from this file's first line"
    )
    p.add_argument(
        "--api-key-covers",
        default="v1",
        choices=["v1", "all"],
        help="what the key guards: the /v1/ API (default, as vLLM), or all routes (also /metrics, /docs, "
        "/openapi.json, /tokenize); /health and /version stay open",
    )
    p.add_argument(
        "--no-pasted-context",
        dest="pasted_context",
        action="store_false",
        help="reuse only chunks sent as `documents` or already known; by default the paragraphs pasted into a "
        "prompt (a LangChain or LlamaIndex RAG prompt's retrieved texts) are cached on first sight and "
        "reused in any order from the next request on",
    )


def _scheduler_args(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags: the scheduler's limits, the context length, the seed."""
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="sequences decoding at once (SchedulerConfig.max_running; default: 64); more wait in the queue",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="new prompt tokens prefilled in one step (SchedulerConfig.max_prefill_tokens; default: 8192)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        metavar="N",
        help="a prompt with more new tokens is prefilled N at a step, so that a cancelled request stops "
        "between pieces and other requests are admitted meanwhile (SchedulerConfig.long_prefill_tokens; "
        "default: 8192 on a GPU, 2048 on the CPU)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prompt plus answer tokens a request may take: a longer prompt gets HTTP 400 (default: the "
        "model's max_position_embeddings, which it cannot exceed)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed the random generators (torch's, Python's) once the model is loaded, as vLLM's --seed: "
        "sampling requests without a seed of their own then draw the same numbers in the same order "
        'after every start; a request\'s "seed" still makes that request reproducible on its own '
        "(default: not seeded)",
    )


def _http_args(p: argparse.ArgumentParser) -> None:
    """uvicorn's: the log, CORS, HTTPS, a proxy's root path."""
    p.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="log_level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per request in the log")
    p.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=None,
        metavar="LIST",
        help="CORS: origins a browser page may call the API from, a JSON list or commas: "
        "'[\"http://localhost:3000\"]', '*' for any (default: none, no CORS headers; vLLM's is '*')",
    )
    p.add_argument(
        "--allowed-methods",
        type=_string_list,
        default=["*"],
        metavar="LIST",
        help="CORS: methods allowed with --allowed-origins (default: *)",
    )
    p.add_argument(
        "--allowed-headers",
        type=_string_list,
        default=["*"],
        metavar="LIST",
        help="CORS: request headers allowed with --allowed-origins (default: *)",
    )
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="HTTPS: the private key file (PEM)")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE", help="HTTPS: the certificate file (PEM)")
    p.add_argument(
        "--root-path",
        default=None,
        metavar="PATH",
        help="the path prefix a proxy strips before requests reach the server (uvicorn's root_path, e.g. "
        "/lazyrag); the API docs' links then carry it",
    )


def _replica_args(p: argparse.ArgumentParser) -> None:
    """Engines behind one endpoint on Ray Serve."""
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engines behind the one endpoint, each its own process (Ray Serve; pip install 'lazyrag[replicas]'). "
        "A request goes where most of its documents' KV already is (--router); all replicas read the same "
        "--store. Use replicas for more traffic than one engine serves; a model too big for one GPU "
        "needs tensor parallelism instead (default: %(default)s, no Ray)",
    )
    p.add_argument(
        "--router",
        default="chunk_affinity",
        choices=["chunk_affinity", "least_loaded", "round_robin"],
        help="with --replicas: how a request picks its replica (default: %(default)s: least queued work plus "
        "the request's documents a replica lacks, from the replicas' KV events)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: join this Ray cluster ('auto' for the one `ray start` made here) instead of "
        "starting Ray on this machine",
    )


def _string_list(value: str) -> list[str]:
    """``--allowed-origins`` and kin: a JSON list (vLLM's form) or comma-separated values."""
    if value.strip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list ({e})") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(
                f"{value!r}: give a JSON list of strings, e.g. '[\"http://localhost:3000\"]'"
            )
        return items
    return [v.strip() for v in value.split(",") if v.strip()]


def _api_key(args) -> None:
    """``args.api_key`` from --api-key, else --api-key-file, else $LAZYRAG_API_KEY (None: no key)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError("Pass the API key once: --api-key or --api-key-file.")
    if args.api_key_file is not None:
        try:
            args.api_key = (
                args.api_key_file.read_text().splitlines()[0].strip() if args.api_key_file.stat().st_size else ""
            )
        except OSError as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: {e.strerror}.") from None
    elif args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("The API key is empty: give a key, or none to serve without one.")
    if args.api_key is not None and not args.api_key.isprintable():
        raise UsageError("The API key holds control characters; it must fit in an HTTP header.")


def check(args) -> None:
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise UsageError(f"Two models given: {args.model_tag} (MODEL) and --model {args.model}; pass one of them.")
    args.model = args.model_tag if args.model_tag is not None else args.model
    _api_key(args)
    check_strategy(args.strategy)
    check_model(args.model)
    _check_engine_limits(args)
    _check_http(args)
    _check_request_limits(args)
    require("lazyrag serve", "fastapi", "prometheus_client", "uvicorn")
    _check_replicas(args)
    if args.store is not None:
        args.store = check_store(args.store)
    check_embedder(args)


def _check_engine_limits(args) -> None:
    """The scheduler's sizes and --seed."""
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}.")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be in [0, 2**63); got {args.seed}.")


def _check_http(args) -> None:
    """TLS files, --root-path (its trailing / dropped), --allowed-origins, --port and the connection limits."""
    for flag in ("ssl_keyfile", "ssl_certfile"):
        if getattr(args, flag) is not None and not Path(getattr(args, flag)).expanduser().is_file():
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not a file.")
    if args.ssl_keyfile and not args.ssl_certfile:
        raise UsageError("--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key).")
    if args.root_path is not None:
        if not args.root_path.startswith("/"):
            raise UsageError(f"--root-path {args.root_path} must start with /, e.g. /lazyrag.")
        args.root_path = args.root_path.rstrip("/")
    if args.allowed_origins is not None and not args.allowed_origins:
        raise UsageError("--allowed-origins is empty; give origins (a JSON list or commas), or '*' for any.")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} must be in 1-65535.")
    if not args.body_timeout > 0 or (args.limit_concurrency is not None and args.limit_concurrency < 1):
        raise UsageError("--body-timeout must be a positive number of seconds and --limit-concurrency at least 1.")


def _check_request_limits(args) -> None:
    """The per-request defaults and bounds, and --host-gb."""
    if not 0 < args.k <= MAX_K or args.max_tokens <= 0 or args.max_pending <= 0 or not args.max_request_mb > 0:
        raise UsageError(
            f"--k must be in 1-{MAX_K}; --max-tokens, --max-pending and --max-request-mb must be positive."
        )
    if not 0 <= args.temperature <= 100:
        raise UsageError("--temperature must be in [0, 100] (0 = greedy).")
    if not args.host_gb >= 0:
        raise UsageError(f"--host-gb must be a number of GiB of at least 0 (0 = no host tier); got {args.host_gb}.")


def _check_replicas(args) -> None:
    """--replicas: at least 1; more needs Ray Serve, and neither the HTTP options nor tensor parallelism."""
    if args.replicas < 1:
        raise UsageError("--replicas must be at least 1.")
    if args.replicas <= 1:
        return
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise UsageError("lazyrag serve --replicas needs Ray Serve: pip install 'lazyrag[replicas]'.") from None
    http = [f for f in ("allowed_origins", "ssl_certfile", "root_path") if getattr(args, f)]
    if http:
        raise UsageError(
            f"--{http[0].replace('_', '-')} is not supported with --replicas yet (Ray Serve's proxy takes "
            "the HTTP traffic): put the endpoint behind your gateway."
        )
    if (args.tensor_parallel_size or 1) > 1:
        raise UsageError(
            "--replicas with --tensor-parallel-size is not supported yet (a replica is one process): run "
            "one tensor-parallel server per set of GPUs, or replicas of a model that fits one device."
        )


def run(args) -> int:
    if args.replicas > 1:
        return _serve_replicas(args)
    from lazyrag.server import run_server

    engine = _load_engine(args)
    retriever = None
    if args.store is not None:
        from lazyrag.store.retriever import Retriever

        retriever = Retriever(engine.attach_store(args.store), args.embedder)
    print(f"ready in {time.perf_counter() - args.started:.1f} s", file=sys.stderr, flush=True)
    if args.seed is not None:
        from lazyrag.server.app import seed_sampling

        seed_sampling(args.seed)
    config = _server_config(args, engine.model_name)
    uvicorn = _uvicorn_options(args)
    scheme = "https" if args.ssl_certfile else "http"
    print(
        f"lazyrag serve: {config.model_name} on {engine.device} at "
        f"{scheme}://{args.host}:{args.port}{args.root_path or ''}/v1 (default strategy "
        f"{config.strategy}{', store ' + str(args.store.path) if args.store is not None else ''})",
        file=sys.stderr,
    )
    run_server(engine, config, args.host, args.port, retriever, args.log_level, **uvicorn)
    return 0


def _load_engine(args):
    """The engine serve's flags ask for, saying what it loads."""
    from lazyrag.engine import LazyEngine
    from lazyrag.model.loader import resolve_model_source

    kw: dict = {"kv_budget": args.kv_budget} if args.kv_budget else {}
    cache = _cache_fields(args)
    if cache:
        from lazyrag.kv.cache import CacheConfig

        kw["cache"] = CacheConfig(**cache)
    scheduler = _scheduler_fields(args)
    if scheduler:
        from lazyrag.engine import SchedulerConfig

        kw["scheduler"] = SchedulerConfig(**scheduler)
    print(f"lazyrag serve: loading {resolve_model_source(args.model).name}...", end=" ", file=sys.stderr, flush=True)
    return LazyEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        **kw,
        **adapter_kwargs(args),
        **passage_kwargs(args),
        **tensor_parallel_kwargs(args),
    )


def _server_config(args, engine_name: str):
    """The app's ServerConfig from serve's flags; ``engine_name``: the loaded model's name."""
    from lazyrag.server import ServerConfig

    model_name, aliases = _served_names(args, engine_name)
    cors = (
        {
            "allowed_origins": tuple(args.allowed_origins),
            "allowed_methods": tuple(args.allowed_methods),
            "allowed_headers": tuple(args.allowed_headers),
            "allow_credentials": args.allow_credentials,
        }
        if args.allowed_origins
        else {}
    )
    return ServerConfig(
        model_name=model_name,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        strategy=args.strategy,
        k=args.k,
        max_pending=args.max_pending,
        max_request_bytes=int(args.max_request_mb * (1 << 20)),
        body_timeout_s=args.body_timeout,
        api_key=args.api_key,
        api_key_covers=args.api_key_covers,
        aliases=aliases,
        pasted_context=args.pasted_context,
        max_model_len=args.max_model_len,
        **cors,
    )


def _uvicorn_options(args) -> dict:
    """uvicorn's keywords from serve's flags, those given."""
    uvicorn = {
        k: v
        for k, v in (
            ("ssl_keyfile", args.ssl_keyfile),
            ("ssl_certfile", args.ssl_certfile),
            ("root_path", args.root_path),
            ("limit_concurrency", args.limit_concurrency),
        )
        if v
    }
    if args.disable_uvicorn_access_log:
        uvicorn["access_log"] = False
    return uvicorn


def _scheduler_fields(args) -> dict:
    """SchedulerConfig fields from vLLM's flags, those given."""
    fields = {
        "max_running": args.max_num_seqs,
        "max_prefill_tokens": args.max_num_batched_tokens,
        "long_prefill_tokens": args.long_prefill_token_threshold,
    }
    return {k: v for k, v in fields.items() if v is not None}


def _served_names(args, engine_name: str) -> tuple[str, tuple[str, ...]]:
    """(the model id responses carry, the other ids accepted), as vLLM names a served model: --served-model-name's
    names, else MODEL as the user wrote it (a hub id, a path) also answering to the model's own name and its
    aliases, else the model's name."""
    if args.served_model_name:
        return args.served_model_name[0], tuple(args.served_model_name[1:])
    from lazyrag.server.app import model_aliases

    if args.model is not None:
        names = (engine_name, *model_aliases(engine_name))
        return args.model, tuple(n for n in dict.fromkeys(names) if n != args.model)
    return engine_name, model_aliases(engine_name)


def _cache_fields(args) -> dict:
    """CacheConfig fields from serve's flags (the host tier, the admission filter), those given."""
    fields = {"host_bytes": int(args.host_gb * (1 << 30)), "admission": args.cache_admission}
    return {k: v for k, v in fields.items() if v}


def _serve_replicas(args) -> int:
    from lazyrag.server.replicas import ReplicaSpec, run

    server = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "strategy": args.strategy,
        "k": args.k,
        "max_pending": args.max_pending,
        "pasted_context": args.pasted_context,
        "max_request_bytes": int(args.max_request_mb * (1 << 20)),
        "body_timeout_s": args.body_timeout,
    }
    if args.max_model_len:
        server["max_model_len"] = args.max_model_len
    if args.served_model_name or args.model is not None:
        from lazyrag.model.loader import resolve_model_source

        server["model_name"], server["aliases"] = _served_names(args, resolve_model_source(args.model).name)
    spec = ReplicaSpec(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_budget=args.kv_budget,
        **passage_kwargs(args),
        store=None if args.store is None else str(args.store.path),
        embedder=args.embedder,
        server=server,
        cache=_cache_fields(args),
        adapter=args.adapter,
        scheduler=_scheduler_fields(args),
        seed=args.seed,
    )
    print(
        f"lazyrag serve: {args.replicas} replicas ({args.router} routing) at http://{args.host}:{args.port}/v1; "
        "GET /routing shows each replica's state; Ctrl-C stops them",
        file=sys.stderr,
    )
    run(
        spec,
        args.replicas,
        args.router,
        args.host,
        args.port,
        args.ray_address,
        api_key=args.api_key,
        api_key_covers=args.api_key_covers,
    )
    return 0
