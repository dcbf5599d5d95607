"""The closed-loop serving load through ``lazyrag serve``'s HTTP app: what the HTTP layer costs, measured.

The workload is ``serving.py``'s closed-loop throughput experiment (``hit_rate.Workload``: Zipf(``--alpha``)
popularity over ``--docs`` documents, 5 distinct documents per prompt, the engine's shared prefix (system
prompt and chat-template head), a short question, 16 output tokens with end-of-turn ignored; ``--concurrency``
clients each sending its next request when its last is answered, ``--requests`` in all, ``--budget`` GB of
chunk KV), with the documents and questions as TEXT: each document is ``--doc-tokens`` words drawn by a seeded
RNG from the tokenizer's one-token words, so that it tokenizes to about that many tokens, the same text every
run. Requests pick their documents with the same draws as ``serving.py``'s (the same seed).

One process, one engine, the same request sequence, each run from an empty cache:
* ``offline``: ``--concurrency`` threads calling ``engine.generate(question, documents, strategy="lazy")``;
* ``http-stream`` / ``http``: lazyrag's own app (``lazyrag.server.build_app``, as ``lazyrag serve`` builds it)
  over that engine, run by uvicorn in a thread on 127.0.0.1, and ``--concurrency`` threads each with its own
  ``openai.OpenAI`` client sending ``/v1/chat/completions`` (documents as ``extra_body={"documents": [...]}``,
  ``max_tokens=16``, ``ignore_eos``, ``strategy: lazy``); streamed (server-sent events, with a last usage chunk)
  or not (``--http``).

Reported per run: requests/s over the makespan (the first request sent to the last answered), TTFT p50
(``offline``: the engine's, from each result; ``http-stream``: the client's, to the first chunk carrying text;
``http``: none, a plain response comes whole, so its latency p50 stands in; every run also reports the engine's
own TTFT p50, which the server returns in each response's ``lazyrag`` object), chunk hit rate (from each request's
stats; for HTTP runs also the server's ``/metrics`` counters), and each HTTP run's requests/s over offline's.

    python benchmarks/serving_http.py --smoke                           # the embedded model on the CPU, ~1 min
    python benchmarks/serving_http.py --random-8b .snap/smol --budget 1 --concurrency 16 --requests 160 \\
        --out benchmarks/results/serving_http_h100.json                 # Llama-3.1-8B shapes, random bf16, on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the script's own folder off the path: its kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks.hit_rate import Workload  # noqa: E402
from benchmarks.serving import GiB, budget_in_documents, percentile  # noqa: E402

RUNS = ("offline", "http-stream", "http")
_FIRST_DOC_ID = 100_000  # Workload(vocab_size=None) gives document d the ids 100_000 + d * doc_tokens + i


# -- the workload as text ----------------------------------------------------------------------------


def word_pool(tokenizer) -> list[str]:
    """Lower-case words that are one token after a space in this tokenizer (byte-level BPE's 'Ġword', SentencePiece's
    '▁word'), so that N of them joined by spaces tokenize to about N tokens."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words = sorted({t[1:] for t in tokens if isinstance(t, str) and re.fullmatch(r"[Ġ▁][a-z]{3,12}", t)})
    if len(words) >= 500:
        return words
    rng = random.Random(0)  # a tokenizer without such tokens: pronounceable made-up words
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(5000)})


def document_text(pool: list[str], d: int, n_words: int, seed: int) -> str:
    rng = random.Random(1_000_003 * (seed + 1) + d)
    return " ".join(rng.choice(pool) for _ in range(n_words))


@dataclasses.dataclass
class TextRequest:
    question: str
    documents: list[str]


def text_workload(engine, wl: Workload, alpha: float) -> tuple[list[TextRequest], dict]:
    """``wl``'s requests (the same Zipf draws as serving.py's token-id workload) with text documents and questions;
    and how many tokens they came to."""
    pool = word_pool(engine.tokenizer)
    prompts = engine.prompts
    docs = []
    for d in range(wl.num_docs):
        words = wl.doc_tokens
        text = document_text(pool, d, words, wl.seed)
        excess = len(prompts.encode_chunk(text)) - wl.doc_tokens  # the chunk's "\n\n", a first word of two tokens
        if excess > 0:
            text = document_text(pool, d, words - excess, wl.seed)
        docs.append(text)
    layouts = Workload(**{**asdict(wl), "vocab_size": None}).prompts(alpha)  # ids that name each picked document
    out = []
    for r, layout in enumerate(layouts):
        picked = [(ids[0] - _FIRST_DOC_ID) // wl.doc_tokens for ids in layout.chunk_ids]
        rng = random.Random(7_000_003 * (wl.seed + 1) + r)
        question = (
            "What do the documents say about "
            + " ".join(rng.choice(pool) for _ in range(max(1, wl.question_tokens - 8)))
            + "?"
        )
        out.append(TextRequest(question, [docs[d] for d in picked]))
    sizes = {
        "doc_tokens_mean": statistics.fmean(len(prompts.encode_chunk(t)) for t in docs),
        "question_tokens_mean": statistics.fmean(len(prompts.question_ids(r.question)) for r in out),
        "prefix_tokens": len(prompts.prefix_ids()),
        "encoding_passage_tokens": len(prompts.passage_ids()),
        "prompt_tokens_mean": statistics.fmean(
            engine.build_prompt(r.question, r.documents).num_tokens for r in out[:20]
        ),
        "word_pool": len(pool),
    }
    return out, sizes


# -- the runs ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    start: float
    end: float
    ttft_s: float | None  # what the run reports as TTFT (None: a plain HTTP response, which comes whole)
    engine_ttft_s: float  # the engine's, from arrival at the scheduler to the first token
    new_tokens: int
    stats: dict  # RequestStats.as_dict()


def closed_loop(requests: list[TextRequest], concurrency: int, send) -> list[Sample]:
    """``concurrency`` threads, each sending its next request (``send(i, request) -> Sample``) when its last one is
    answered, until all are; a request's failure is raised here."""
    lock, todo, out, errors = threading.Lock(), iter(range(len(requests))), [None] * len(requests), []

    def client(k: int):
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                out[i] = send(k, requests[i])
            except BaseException as e:  # noqa: BLE001 -- re-raised below, in the caller's thread
                errors.append(e)

    threads = [threading.Thread(target=client, args=(k,), name=f"client-{k}") for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def offline_sender(engine, params):
    def send(_k: int, req: TextRequest) -> Sample:
        start = time.perf_counter()
        r = engine.generate(req.question, req.documents, params)
        end = time.perf_counter()
        return Sample(start, end, r.ttft_s, r.ttft_s, len(r.token_ids), r.stats.as_dict())

    return send


def http_sender(clients, model: str, max_tokens: int, stream: bool):
    def send(k: int, req: TextRequest) -> Sample:
        body = dict(
            model=model,
            messages=[{"role": "user", "content": req.question}],
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"documents": req.documents, "ignore_eos": True, "strategy": "lazy"},
        )
        start = time.perf_counter()
        if not stream:
            r = clients[k].chat.completions.create(**body)
            end = time.perf_counter()
            first, usage, info = None, r.usage, (r.model_extra or {}).get("lazyrag")
        else:
            first = usage = info = None
            for chunk in clients[k].chat.completions.create(
                **body, stream=True, stream_options={"include_usage": True}
            ):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    usage, info = chunk.usage, (chunk.model_extra or {}).get("lazyrag")
            end = time.perf_counter()
        if info is None or usage is None:
            raise RuntimeError("the server's answer carried no usage or lazyrag stats")
        choice = info["choices"][0]
        stats = {k: v for k, v in choice.items() if k not in ("ttft_s", "total_s")}
        return Sample(
            start, end, None if first is None else first - start, choice["ttft_s"], usage.completion_tokens, stats
        )

    return send


def summarize(samples: list[Sample], output_tokens: int) -> dict:
    assert all(s.new_tokens == output_tokens for s in samples), "a request did not get all its output tokens"
    makespan = max(s.end for s in samples) - min(s.start for s in samples)
    ttft = [s.ttft_s for s in samples if s.ttft_s is not None]
    hits = sum(s.stats["chunks_hit"] for s in samples)
    lookups = hits + sum(s.stats["chunks_missed"] for s in samples)
    return {
        "requests": len(samples),
        "makespan_s": makespan,
        "throughput_rps": len(samples) / makespan,
        "output_tokens_per_s": sum(s.new_tokens for s in samples) / makespan,
        "ttft_samples": len(ttft),  # http-stream: requests whose stream carried text (a random model's may not)
        "ttft_p50_ms": 1e3 * percentile(ttft, 50) if ttft else None,
        "ttft_p99_ms": 1e3 * percentile(ttft, 99) if ttft else None,
        "engine_ttft_p50_ms": 1e3 * percentile([s.engine_ttft_s for s in samples], 50),
        "latency_p50_ms": 1e3 * percentile([s.end - s.start for s in samples], 50),
        "latency_p99_ms": 1e3 * percentile([s.end - s.start for s in samples], 99),
        "chunk_hits": hits,
        "chunk_lookups": lookups,
        "chunk_hit_rate": hits / lookups if lookups else 0.0,
        "tokens_prefilled": sum(s.stats["tokens_prefilled"] for s in samples),
        "tokens_reused": sum(s.stats["tokens_reused"] for s in samples),
        "prompt_tokens": sum(s.stats["prompt_tokens"] for s in samples),
    }


def cache_counters(engine) -> dict:
    s = engine.cache.stats
    return {"hits": s.hits, "misses": s.misses, "tier_hits": s.tier_hits, "evictions": s.evictions}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``lazyrag serve``'s app over ``engine``, run by uvicorn in a thread on a free loopback port. ``config``:
    other ``ServerConfig`` fields (``strategy`` is ``lazy`` unless given; ``pasted_context=False``, say)."""

    def __init__(self, engine, max_tokens: int, concurrency: int, log_level: str, **config):
        import uvicorn

        from lazyrag.server import ServerConfig, build_app, wait_until_ready

        self.config = ServerConfig(
            model_name=engine.model_name,
            max_tokens=max_tokens,
            **{"strategy": "lazy", "max_pending": max(256, 2 * concurrency), **config},
        )
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                build_app(engine, self.config),
                host="127.0.0.1",
                port=port,
                log_level=log_level,
                timeout_graceful_shutdown=5,
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        wait_until_ready(self.url, timeout_s=120)  # polls GET /health

    def scrape(self) -> dict[str, float]:
        """Every sample of the server's /metrics, by its series as written there (``name{label="value"}``)."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {m[0]: float(m[1]) for m in re.findall(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", text, flags=re.M)}

    def chunk_counters(self) -> dict:
        """The server's /metrics chunk hit and miss counters."""
        found = self.scrape()
        return {"hits": int(found["lazyrag_chunk_hits_total"]), "misses": int(found["lazyrag_chunk_misses_total"])}

    def clients(self, n: int):
        import openai

        return [openai.OpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=600) for _ in range(n)]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def benchmark(engine, args, command: str = "") -> dict:
    """Every run of ``args.runs`` on ``engine`` (its cache config restored afterwards); the JSON the script writes."""
    import torch

    from lazyrag.engine import SamplingParams

    wl = Workload(
        num_docs=args.docs,
        doc_tokens=args.doc_tokens,
        requests=args.requests,
        question_tokens=args.question_tokens,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    if wl.doc_tokens * wl.docs_per_prompt + 512 > engine.max_context:
        raise SystemExit(
            f"{wl.docs_per_prompt} documents of {wl.doc_tokens} tokens do not fit the model's "
            f"{engine.max_context}-token context: lower --doc-tokens."
        )
    t0 = time.perf_counter()
    requests, sizes = text_workload(engine, wl, args.alpha)
    warm, _ = text_workload(
        engine,
        dataclasses.replace(wl, requests=max(args.warmup_requests, args.concurrency), seed=wl.seed + 999),
        args.alpha,
    )
    text_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=wl.output_tokens, ignore_eos=True, strategy="lazy")
    budget_bytes = int(args.budget * GiB)
    if args.smoke:  # a GB of the flags is 4 documents, as at 8B shapes, plus the shared prefix and encoding passage,
        shape = engine.cache.pool.shape  # which 8B-sized documents dwarf but 64-token ones do not
        shared = shape.blocks_for(sizes["prefix_tokens"] + sizes["encoding_passage_tokens"]) + 2
        budget_bytes = int(args.budget * budget_in_documents(engine, wl, 4) * GiB) + shared * shape.bytes_per_block
    original = engine.cache.config
    rows, server = {}, None

    def fresh():  # an empty cache of the budget, nothing in flight
        assert not engine.has_unfinished_requests()
        engine.cache.reconfigure(dataclasses.replace(original, budget_bytes=budget_bytes))

    def measure(name: str, send) -> None:
        fresh()
        before, scraped = cache_counters(engine), server.chunk_counters() if server is not None else None
        t = time.perf_counter()
        samples = closed_loop(requests, args.concurrency, send)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        row = {
            "run": name,
            "concurrency": args.concurrency,
            "budget_gb": args.budget,
            **summarize(samples, wl.output_tokens),
            "engine_cache": {k: v - before[k] for k, v in cache_counters(engine).items()},
            "wall_s": round(time.perf_counter() - t, 2),
        }
        if scraped is not None:
            after = server.chunk_counters()
            row["metrics_chunk_hits"], row["metrics_chunk_misses"] = (
                after["hits"] - scraped["hits"],
                after["misses"] - scraped["misses"],
            )
        assert engine.cache.num_pinned == 0, "a finished request left a pin"
        rows[name] = row
        ttft = "-" if row["ttft_p50_ms"] is None else f"{row['ttft_p50_ms']:.1f}"
        print(
            f"{name:<12} {row['throughput_rps']:7.2f} req/s, TTFT p50 {ttft} ms (engine "
            f"{row['engine_ttft_p50_ms']:.1f}), "
            f"latency p50 {row['latency_p50_ms']:.1f} ms, hit {100 * row['chunk_hit_rate']:.1f}% ({row['wall_s']} s)",
            flush=True,
        )

    try:
        t = time.perf_counter()
        fresh()  # warm-up, offline: every batch size up to the concurrency, then a closed loop (CUDA graphs, Triton)
        c = 1
        while c <= args.concurrency:
            closed_loop(warm[:c], c, offline_sender(engine, params))
            c *= 2
        closed_loop(warm[: args.warmup_requests], args.concurrency, offline_sender(engine, params))
        warm_s = time.perf_counter() - t
        if "offline" in args.runs:
            measure("offline", offline_sender(engine, params))
        http_runs = [r for r in args.runs if r != "offline"]
        if http_runs:
            t = time.perf_counter()
            server = Server(engine, wl.output_tokens, args.concurrency, args.log_level)
            start_s = time.perf_counter() - t
            clients = server.clients(args.concurrency)
            fresh()  # warm-up, HTTP: each client once (the app's first requests, the connections)
            closed_loop(
                warm[: args.concurrency],
                args.concurrency,
                http_sender(clients, server.config.model_name, wl.output_tokens, True),
            )
            for name in http_runs:
                measure(name, http_sender(clients, server.config.model_name, wl.output_tokens, name == "http-stream"))
            for cl in clients:
                cl.close()
    finally:
        if server is not None:
            server.stop()
        if not engine.has_unfinished_requests():
            engine.cache.reconfigure(original)
    if "offline" in rows:
        for name in rows:
            if name != "offline":
                rows[name]["rps_vs_offline"] = rows[name]["throughput_rps"] / rows["offline"]["throughput_rps"]
    device = (
        torch.cuda.get_device_name() if engine.device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    )
    meta = {
        "command": command,
        "device": device,
        "torch": torch.__version__,
        "model": getattr(args, "model_label", engine.model_name),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "workload": asdict(wl),
        **sizes,
        "alpha": args.alpha,
        "budget_gb": args.budget,
        "budget_bytes": budget_bytes,
        "concurrency": args.concurrency,
        "strategy": "lazy",
        "kv_pool_bytes": engine.cache.pool.num_blocks * engine.cache.pool.shape.bytes_per_block,
        "max_running": engine.scheduler.config.max_running,
        "uvicorn_log_level": args.log_level,
        "ttft": {
            "offline": "engine TTFT from each GenerationResult (arrival at the scheduler to the first token)",
            "http-stream": "client side: request sent to the first streamed chunk carrying text",
            "http": "none (a plain response comes whole): see latency_p50_ms; engine_ttft_p50_ms is the server's",
        },
        "text_workload_s": text_s,
        "warm_up_s": warm_s,
        "server_start_s": start_s if server is not None else None,
        "smoke": bool(args.smoke),
    }
    return {"meta": meta, "rows": list(rows.values())}


def print_table(result: dict) -> None:
    cols = [
        ("throughput_rps", "req/s", "{:.2f}"),
        ("rps_vs_offline", "vs offline", "{:.3f}"),
        ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
        ("engine_ttft_p50_ms", "eng TTFT p50", "{:.1f}"),
        ("latency_p50_ms", "lat p50 ms", "{:.1f}"),
        ("chunk_hit_rate", "hit rate", "{:.1%}"),
        ("tokens_prefilled", "prefilled", "{:d}"),
    ]
    m = result["meta"]
    print(
        f"\n{m['model']} on {m['device']}, torch {m['torch']}: {m['workload']['requests']} requests, concurrency "
        f"{m['concurrency']}, {m['budget_gb']:g} GB, {m['workload']['num_docs']} docs "
        f"x ~{m['doc_tokens_mean']:.0f} tokens"
    )
    print(f"{'run':<12}" + "".join(f"{h:>14}" for _, h, _ in cols))
    for r in result["rows"]:
        print(f"{r['run']:<12}" + "".join(f"{'-' if r.get(k) is None else f.format(r[k]):>14}" for k, _, f in cols))


# -- the engine ---------------------------------------------------------------------------------------


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception:  # an older transformers that does not know the saved tokenizer class
        from transformers import PreTrainedTokenizerFast

        saved = json.loads((folder / "tokenizer_config.json").read_text())
        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"),
            **{k: saved[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in saved},
        )
    template = folder / "chat_template.jinja"
    if not getattr(tok, "chat_template", None) and template.is_file():
        tok.chat_template = template.read_text()
    return tok


def answers_in_tokenizer(engine, tokenizer):
    """Zero the lm_head rows of the ids ``tokenizer`` lacks (a random 8B model has 128,256; SmolLM2's tokenizer 49,152)
    and of its special tokens, so that greedy answers are tokens that decode to text: a random model's answer of ids the
    tokenizer drops would stream no chunk, and no client-side TTFT. Random logits of the other rows are N(0, ~1.3):
    their maximum is always above 0. Shapes, and so the work of every step, are unchanged."""
    import torch

    weight = engine.model.lm_head.weight
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    with torch.no_grad():
        weight[len(tokenizer) :] = 0
        weight[sorted(i for i in special if i < weight.shape[0])] = 0
    return engine


def build_engine(args):
    import torch

    from lazyrag.engine import LazyEngine, SchedulerConfig

    scheduler = SchedulerConfig(max_running=args.max_running)
    if args.random_8b is not None:
        from benchmarks.e2e_gpu import llama31_8b_config

        assert torch.cuda.is_available(), "--random-8b needs a CUDA GPU"
        args.model_label = f"Llama-3.1-8B shapes, random bf16 weights, {args.random_8b.name} tokenizer"
        pool, tokenizer = int((args.budget + args.work_gb) * GiB), load_tokenizer(args.random_8b)
        engine = LazyEngine.from_config(
            llama31_8b_config(args.layers),
            tokenizer=tokenizer,
            device="cuda",
            dtype=torch.bfloat16,
            kv_budget=pool,
            scheduler=scheduler,
        )
        return answers_in_tokenizer(engine, tokenizer)
    from lazyrag.model.loader import resolve_model_source

    args.model_label = resolve_model_source(args.model).name
    kw = {} if args.work_gb is None else {"kv_budget": int((args.budget + args.work_gb) * GiB)}
    return LazyEngine.from_pretrained(args.model, scheduler=scheduler, **kw)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="a model folder or .gguf (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument(
        "--random-8b",
        type=Path,
        default=None,
        metavar="TOKENIZER_FOLDER",
        help="a Llama-3.1-8B-shaped model with random bf16 weights on the GPU, with this folder's tokenizer",
    )
    ap.add_argument("--layers", type=int, default=32, help="--random-8b's layers")
    ap.add_argument(
        "--runs",
        default=",".join(RUNS),
        type=lambda s: s.split(","),
        help="offline (engine.generate from threads), http-stream (streamed), http (plain responses)",
    )
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--budget", type=float, default=1.0, help="KV cache budget (GB; --smoke: a GB is 4 documents)")
    ap.add_argument(
        "--work-gb",
        type=float,
        default=None,
        help="pool beyond the budget, for requests in flight "
        "(default: 24 with --random-8b, else the engine's default pool)",
    )
    ap.add_argument("--docs", type=int, default=100, help="documents in the corpus")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=2.1, help="Zipf exponent of document popularity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup-requests", type=int, default=None, help="the warm-up closed loop's requests (default 2 x concurrency)"
    )
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument(
        "--log-level", default="warning", help="uvicorn's (info logs every request, as `lazyrag serve` does by default)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving_http.json")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on the CPU (20 documents of 64 tokens, 8 requests, concurrency 2): "
        "checks the loop, not the speed",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        defaults = {"requests": 8, "concurrency": 2, "docs": 20, "doc_tokens": 64, "question_tokens": 16}
        for k, v in defaults.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.warmup_requests is None:
        args.warmup_requests = 0 if args.smoke else 2 * args.concurrency
    if args.work_gb is None and args.random_8b is not None:
        args.work_gb = 24.0
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}: pick from {', '.join(RUNS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/serving_http.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.perf_counter()
    engine = build_engine(args)
    load_s = time.perf_counter() - t0
    print(f"{args.model_label}: loaded in {load_s:.1f} s", flush=True)
    result = benchmark(engine, args, command)
    result["meta"]["model_load_s"] = load_s
    result["meta"]["seconds"] = time.perf_counter() - t0
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
