"""Reuse of pasted context over HTTP: stock RAG clients against ``lazyrag serve``, no ``documents`` field.

A RAG app asks several questions over the same retrieved passages; its vector store returns the same top-k,
reranked per question, and the app pastes them into its prompt. This script measures what ``lazyrag serve``
(the real app, ``build_app`` + uvicorn in a thread on loopback, over the embedded default model) reuses of
such pasted passages, and the time to first token each client sees.

The passages: the ``--passages`` paragraphs (title, newline, text) of item ``--item`` of a HotpotQA-style
multi-hop set (``--dataset``, default 2WikiMultihopQA: ten paragraphs a question, two of them gold; the
repository's ``benchmarks/data`` copy, else the sample shipped in the package, ``lazyrag.eval.default_data``).
The questions (``--questions``): the item's own, then "What does the context say about <title>?" for the
passages' titles in turn. Each question gets the passages in a new order (a seeded shuffle, no order twice):
the first question the data's order.

The clients, one after another, each on a fresh server (a new app, its own /metrics) over an engine whose chunk
cache and chunk finder start empty (the engine, loaded once, is kept: its weights and compiled state are warm):
* ``langchain``: LangChain's stock stuffing chain, ``ChatPromptTemplate`` (the RAG tutorial's system prompt with
  ``{context}``, the documents joined by blank lines; the question as the human message) ``| ChatOpenAI``,
  streamed (``stream_usage``): pasted context, no ``documents`` field;
* ``llamaindex``: LlamaIndex's ``RetrieverQueryEngine`` over ``OpenAILike`` (chat), streaming, with a retriever
  that returns the passages in the question's order: pasted by LlamaIndex's own text-QA template;
* ``documents``: the ``openai`` client with ``extra_body={"documents": passages}``, streamed: the exact-chunk
  path, the reference;
* ``no-reuse``: the ``langchain`` chain against a server started with ``pasted_context=False`` (``lazyrag serve
  --no-pasted-context``): pasted context that the server does not look for, the baseline without reuse.
Before its questions each client answers one warm-up question over another item's passages (the client
library's first-call costs, the connection), then the cache and chunk finder are emptied again, so that
question 1 is what a running server sees for passages it has not seen before.

Per question: the client-side TTFT (the request sent, or the chain / query engine called, to the first streamed
delta carrying text); the cached prompt tokens (``usage.prompt_tokens_details.cached_tokens`` where the client
exposes it: the openai client, LangChain's ``usage_metadata``; else the /metrics ``lazyrag_cached_prompt_tokens_total``
delta, as the tests read it, which is also recorded for every client); the context tokens (each passage tokenized as
a chunk, as the tests count them); the answer. Cached % = cached tokens / context tokens: the tests' measure (issue
43's ">= 80% of context tokens reused"). It counts every prompt token not computed for the request, so a cached
prompt prefix and a template's own paragraphs (LlamaIndex's system prompt is cut into passages too) count, and it
can pass 100%. So the server's engine is also watched (its ``submit`` wrapped, in this process) for what it did
with each request: how many of the passages it laid out as chunks (found in the pasted text), chunks hit and
missed, the tokens it prefilled (computed now: what reuse saves) and recomputed (``lazy+recover``), the prefix
and chunk tokens reused, and its own TTFT (arrival at the scheduler to the first token).

    .venv/bin/python benchmarks/pasted_context.py                        # the default size, ~3 min on 2 CPU cores
    .venv/bin/python benchmarks/pasted_context.py --questions 2 --passages 3 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the script's own folder off the path: its kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks.serving_http import Server  # noqa: E402

CLIENTS = ("langchain", "llamaindex", "documents", "no-reuse")
PASTED_CLIENTS = ("langchain", "llamaindex")  # pasted context, the server finding the passages
# LangChain's RAG tutorial prompt (as tests/server/test_serve.py writes it)
LANGCHAIN_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, say that you don't know.\n\n{context}"
)
QUESTION_TEMPLATE = "What does the context say about {}?"
CACHED = "lazyrag_cached_prompt_tokens_total"
STATS = (
    "prompt_tokens",
    "chunks_hit",
    "chunks_missed",
    "tokens_prefilled",
    "tokens_recomputed",
    "tokens_reused",
    "prefix_tokens_reused",
    "chunk_tokens_reused",
    "plan_s",
)  # RequestStats fields kept per question


# -- the workload -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    dataset: str
    data: str
    item: int
    passages: list[str]  # in the data's (the retriever's first) order
    questions: list[str]
    orders: list[list[int]]  # per question: the passages' indices, in the order the client gets them
    warmup_passages: list[str]  # another item's, for each client's warm-up question
    warmup_question: str


def load_workload(
    dataset: str, item: int, n_passages: int, n_questions: int, seed: int, data: Path | None = None
) -> Workload:
    from lazyrag.eval import default_data, load_chunked

    path = Path(data) if data is not None else default_data(dataset)
    items = load_chunked(path, item + 2, shuffle=False, seed=seed)
    if len(items) < item + 2:
        raise SystemExit(
            f"{path} has {len(items)} items: --item {item} needs {item + 2} (the next one is the warm-up's)"
        )
    chosen, warm = items[item], items[item + 1]
    passages = chosen["chunks"][:n_passages]
    if len(passages) < n_passages:
        raise SystemExit(f"item {item} of {path} has {len(passages)} passages, fewer than --passages {n_passages}")
    titles = [p.split("\n", 1)[0] for p in passages]
    questions = [chosen["question"]] + [
        QUESTION_TEMPLATE.format(titles[k % len(titles)]) for k in range(n_questions - 1)
    ]
    orders, seen = [list(range(n_passages))], {tuple(range(n_passages))}
    for q in range(1, n_questions):
        rng = random.Random(f"order:{seed}:{q}")
        order = list(range(n_passages))
        for _ in range(100):  # a new order while there are any left (3 passages: 6 orders)
            rng.shuffle(order)
            if tuple(order) not in seen:
                break
        seen.add(tuple(order))
        orders.append(list(order))
    return Workload(
        dataset, str(path), item, passages, questions, orders, warm["chunks"][:n_passages], warm["question"]
    )


# -- the clients -------------------------------------------------------------------------------------
# Each: make(server, args) -> ask(passages in order, question) -> {"ttft_s", "answer", "usage_cached"}


def langchain_client(server: Server, args):
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        model=server.config.model_name,
        temperature=0,
        max_tokens=args.max_tokens,
        max_retries=0,
        timeout=600,
        streaming=True,
        stream_usage=True,
    )
    prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_SYSTEM), ("human", "{question}")])
    chain = prompt | llm

    def ask(passages: list[str], question: str) -> dict:
        docs = [Document(page_content=p) for p in passages]  # what a retriever returns
        start, first, parts, usage = time.perf_counter(), None, [], None
        for chunk in chain.stream({"context": "\n\n".join(d.page_content for d in docs), "question": question}):
            if chunk.content and first is None:
                first = time.perf_counter()
            parts.append(chunk.content)
            if chunk.usage_metadata:
                usage = chunk.usage_metadata
        cached = None if usage is None else (usage.get("input_token_details") or {}).get("cache_read")
        return {"ttft_s": None if first is None else first - start, "answer": "".join(parts), "usage_cached": cached}

    return ask


def llamaindex_client(server: Server, args):
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.llms.openai_like import OpenAILike

    class Ranked(BaseRetriever):  # a vector store's top-k, in this question's order
        passages: list[str] = []

        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=t), score=1.0 - k / 100) for k, t in enumerate(self.passages)]

    retriever = Ranked()
    llm = OpenAILike(
        model=server.config.model_name,
        api_base=f"{server.url}/v1",
        api_key="unused",
        context_window=args.context_window,
        max_tokens=args.max_tokens,
        max_retries=0,
        timeout=600,
        temperature=0.0,
        is_chat_model=True,
    )
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm, streaming=True)

    def ask(passages: list[str], question: str) -> dict:
        retriever.passages = passages
        start, first, parts = time.perf_counter(), None, []
        response = engine.query(question)
        for delta in response.response_gen:
            if delta and first is None:
                first = time.perf_counter()
            parts.append(delta)
        return {"ttft_s": None if first is None else first - start, "answer": "".join(parts), "usage_cached": None}

    return ask


def documents_client(server: Server, args):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(passages: list[str], question: str) -> dict:
        start, first, parts, usage = time.perf_counter(), None, [], None
        for chunk in client.chat.completions.create(
            model=server.config.model_name,
            messages=[{"role": "user", "content": question}],
            max_tokens=args.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"documents": passages},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        cached = (
            None if usage is None or usage.prompt_tokens_details is None else usage.prompt_tokens_details.cached_tokens
        )
        return {"ttft_s": None if first is None else first - start, "answer": "".join(parts), "usage_cached": cached}

    return ask


MAKERS = {
    "langchain": langchain_client,
    "llamaindex": llamaindex_client,
    "documents": documents_client,
    "no-reuse": langchain_client,
}


# -- the runs ----------------------------------------------------------------------------------------


def fresh_state(engine) -> None:
    """The engine's chunk cache and chunk finder as a new server's: nothing cached, no passage known."""
    from lazyrag.prompt import ChunkFinder

    assert not engine.has_unfinished_requests() and engine.cache.num_pinned == 0, "requests still in flight"
    engine.cache.reconfigure(engine.cache.config)  # the device pool emptied, the configured tiers new
    engine.cache.reset()  # and the statistics
    engine.chunk_finder = ChunkFinder()


class Watched:
    """The engine's requests as the server submits them (``engine.submit`` wrapped on the instance): each one's
    layout and stream, whose result carries the request's stats and engine TTFT."""

    def __init__(self, engine):
        self.engine, self.submitted = engine, []

    def __enter__(self):
        submit = self.engine.submit

        def watched(layout, *a, **kw):
            stream = submit(layout, *a, **kw)
            self.submitted.append((layout, stream))
            return stream

        self.engine.submit = watched
        return self

    def __exit__(self, *exc):
        del self.engine.submit  # the class's method again

    def take(self) -> list:
        out, self.submitted = self.submitted, []
        return out


def run_client(engine, name: str, wl: Workload, args) -> list[dict]:
    server = Server(
        engine, args.max_tokens, 1, args.log_level, strategy=args.strategy, pasted_context=name != "no-reuse"
    )
    try:
        with Watched(engine) as watched:
            fresh_state(engine)
            ask = MAKERS[name](server, args)
            ask(wl.warmup_passages, wl.warmup_question)  # the client's first-call costs; then the cache starts over
            fresh_state(engine)
            watched.take()
            context_tokens = sum(len(engine.prompts.encode_chunk(p)) for p in wl.passages)
            rows = []
            for q, (question, order) in enumerate(zip(wl.questions, wl.orders), start=1):
                before = server.scrape()[CACHED]
                got = ask([wl.passages[i] for i in order], question)
                metrics_cached = int(server.scrape()[CACHED] - before)
                ((layout, stream),) = watched.take()  # one request a question
                result = stream.request.result()
                stats = result.stats.as_dict()
                laid_out = {t.strip() for t in layout.chunk_texts or ()}
                cached = metrics_cached if got["usage_cached"] is None else int(got["usage_cached"])
                row = {
                    "client": name,
                    "question": q,
                    "text": question,
                    "order": order,
                    "ttft_ms": None if got["ttft_s"] is None else 1e3 * got["ttft_s"],
                    "engine_ttft_ms": 1e3 * result.ttft_s,
                    "context_tokens": context_tokens,
                    "cached_tokens": cached,
                    "cached_source": "metrics" if got["usage_cached"] is None else "usage",
                    "metrics_cached_tokens": metrics_cached,
                    "cached_pct": 100.0 * cached / context_tokens,
                    "passages_as_chunks": sum(p.strip() in laid_out for p in wl.passages),
                    "segments": len(layout.chunk_ids),
                    **{k: stats[k] for k in STATS},
                    "answer": got["answer"],
                }
                rows.append(row)
                ttft = "-" if row["ttft_ms"] is None else f"{row['ttft_ms']:.0f}"
                print(
                    f"{name:<11} q{q}  TTFT {ttft:>6} ms (engine {row['engine_ttft_ms']:.0f})  cached {cached:>5} of "
                    f"{context_tokens} context tokens ({row['cached_pct']:5.1f}%); passages as chunks "
                    f"{row['passages_as_chunks']}/{len(wl.passages)}, hit {row['chunks_hit']}, missed "
                    f"{row['chunks_missed']}, prefilled {row['tokens_prefilled']}  {row['answer'][:40]!r}",
                    flush=True,
                )
        return rows
    finally:
        server.stop()


def summarize(rows: list[dict]) -> dict:
    first, rest = rows[0], rows[1:]
    ttft_rest = [r["ttft_ms"] for r in rest if r["ttft_ms"] is not None]
    out = {
        "questions": len(rows),
        "ttft_q1_ms": first["ttft_ms"],
        "engine_ttft_q1_ms": first["engine_ttft_ms"],
        "ttft_rest_median_ms": statistics.median(ttft_rest) if ttft_rest else None,
        "engine_ttft_rest_median_ms": statistics.median(r["engine_ttft_ms"] for r in rest) if rest else None,
        "cached_pct_q1": first["cached_pct"],
        "cached_pct_rest_median": statistics.median(r["cached_pct"] for r in rest) if rest else None,
        "cached_pct_rest_min": min(r["cached_pct"] for r in rest) if rest else None,
        # the engine's chunk_tokens_reused / context tokens: the cached prompt prefix left out (a template's own
        # paragraphs, found as passages, still in: LlamaIndex's system prompt)
        "chunk_reused_pct_rest_median": (
            statistics.median(100.0 * r["chunk_tokens_reused"] / r["context_tokens"] for r in rest) if rest else None
        ),
        "recomputed_rest_median": statistics.median(r["tokens_recomputed"] for r in rest) if rest else None,
        "prefilled_q1": first["tokens_prefilled"],
        "prefilled_rest_median": statistics.median(r["tokens_prefilled"] for r in rest) if rest else None,
        "passages_as_chunks_rest_min": min(r["passages_as_chunks"] for r in rest) if rest else None,
    }
    if out["ttft_rest_median_ms"] and first["ttft_ms"]:
        out["ttft_q1_over_rest"] = first["ttft_ms"] / out["ttft_rest_median_ms"]
    return out


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def busy_processes(min_pcpu: float = 10.0) -> list[str]:
    """Other processes using the CPU (``ps``'s %CPU: their lifetime average), with their command lines cut short."""
    import subprocess

    try:
        out = subprocess.run(["ps", "-eo", "pid=,pcpu=,args="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.splitlines():
        pid, pcpu, args = (line.split(None, 2) + ["", ""])[:3]
        if pid.isdigit() and int(pid) != os.getpid() and not args.startswith("ps -eo") and float(pcpu or 0) >= min_pcpu:
            rows.append(f"{pcpu}% {args[:100]}")
    return rows


def load_note(start: list[float] | None, end: list[float] | None, cores: int, busy: list[list[str]]) -> str:
    """``busy``: the other busy processes seen at each look (the start, before each client, the end)."""
    if start is None:
        return "no /proc/loadavg on this machine: load unknown"
    seen = sorted({p.split(" ", 1)[1] for look in busy for p in look})
    note = (
        f"1/5/15-min load averages {start} at the start (before this script's own work) and {end} at the end "
        f"(with it), on {cores} cores. "
    )
    if seen:
        return note + (
            f"Other processes used the CPU at {sum(map(bool, busy))} of {len(busy)} looks (the start, before "
            f"each client, the end; see each summary's busy_processes): {'; '.join(s[:60] for s in seen)}. The "
            "timings are from a shared machine and noisy; the clients ran one after another, so a client that "
            "ran while others worked is slower for that alone."
        )
    if start[0] >= 0.5:
        return note + (
            "No other process used >= 10% CPU at any look (the start, before each client, the end); the "
            "1-minute load at the start was still falling from earlier work. A process that ran only between "
            "two looks would not show here."
        )
    return note + "The machine was about idle at the start, and no other process used >= 10% CPU at any look."


def benchmark(engine, args, command: str = "") -> dict:
    import torch

    load_start, busy_start = loadavg(), busy_processes()
    wl = load_workload(args.dataset, args.item, args.passages, args.questions, args.seed, args.data)
    saved_finder, original = engine.chunk_finder, engine.cache.config
    clients, looks, t0 = {}, {}, time.perf_counter()
    try:
        for name in args.clients:
            looks[name] = {"loadavg": loadavg(), "busy_processes": busy_processes()}
            clients[name] = run_client(engine, name, wl, args)
    finally:
        engine.chunk_finder = saved_finder
        if not engine.has_unfinished_requests():
            engine.cache.reconfigure(original)
            engine.cache.reset()
    load_end, busy_end = loadavg(), busy_processes()
    cores = os.cpu_count() or 0
    device = (
        torch.cuda.get_device_name()
        if engine.device.type == "cuda"
        else f"{cores}-core CPU"
        + (f" ({torch.get_num_threads()} torch threads)" if torch.get_num_threads() != cores else "")
    )
    meta = {
        "command": command,
        "device": device,
        "torch": torch.__version__,
        "model": getattr(args, "model_label", engine.model_name),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "strategy": args.strategy,
        "max_tokens": args.max_tokens,
        "dataset": wl.dataset,
        "data": os.path.relpath(wl.data, ROOT) if wl.data.startswith(str(ROOT)) else wl.data,
        "item": wl.item,
        "passages": len(wl.passages),
        "passage_tokens": [len(engine.prompts.encode_chunk(p)) for p in wl.passages],
        "context_tokens": sum(len(engine.prompts.encode_chunk(p)) for p in wl.passages),
        "questions": wl.questions,
        "orders": wl.orders,
        "passage_texts": wl.passages,
        "seed": args.seed,
        "clients": list(args.clients),
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "busy_processes_start": busy_start,
        "busy_processes_end": busy_end,
        "load_note": load_note(
            load_start, load_end, cores, [busy_start, *(v["busy_processes"] for v in looks.values()), busy_end]
        ),
        "seconds": time.perf_counter() - t0,
        "ttft": "client side: the chain / query engine / request called to the first streamed delta carrying text",
        "engine_ttft": "the server engine's, from each request's result: arrival at the scheduler to the first token",
        "cached_pct": "cached prompt tokens (usage where the client exposes it, else the /metrics delta) / context "
        "tokens (the tests' measure): every prompt token not computed now, a cached prompt prefix and a "
        "template's own paragraphs included, so it can pass 100%; see tokens_prefilled and passages_as_chunks",
    }
    return {
        "meta": meta,
        "summary": {name: {**summarize(rows), **looks[name]} for name, rows in clients.items()},
        "rows": [r for rows in clients.values() for r in rows],
    }


def print_table(result: dict) -> None:
    m = result["meta"]
    print(
        f"\n{m['model']} on {m['device']}, strategy {m['strategy']}: {m['dataset']} item {m['item']}, {m['passages']} "
        f"passages ({m['context_tokens']} context tokens), {len(m['questions'])} questions, each a new order"
    )
    print(
        f"{'client':<11} {'q':>2} {'TTFT ms':>8} {'engine ms':>9} {'cached':>7} {'cached %':>9} {'as chunks':>9} "
        f"{'hit':>4} {'prefilled':>9}"
    )
    for r in result["rows"]:
        ttft = "-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.0f}"
        print(
            f"{r['client']:<11} {r['question']:>2} {ttft:>8} {r['engine_ttft_ms']:>9.0f} {r['cached_tokens']:>7} "
            f"{r['cached_pct']:>8.1f}% {r['passages_as_chunks']:>4}/{m['passages']:<4} {r['chunks_hit']:>4} "
            f"{r['tokens_prefilled']:>9}"
        )

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)

    print(
        f"\n{'client':<11} {'TTFT q1':>8} {'TTFT q2..N':>11} {'q1 / rest':>9} {'cached % q2..N':>15} "
        f"{'chunk % q2..N':>14} {'prefilled q1':>13} {'q2..N':>6}   "
        f"(medians of q2..N; chunk %: the cached prefix left out)"
    )
    for name, s in result["summary"].items():
        print(
            f"{name:<11} {f(s['ttft_q1_ms'], '{:.0f}'):>8} {f(s['ttft_rest_median_ms'], '{:.0f}'):>11} "
            f"{f(s.get('ttft_q1_over_rest'), '{:.2f}x'):>9} {f(s['cached_pct_rest_median'], '{:.1f}%'):>15} "
            f"{f(s['chunk_reused_pct_rest_median'], '{:.1f}%'):>14} {s['prefilled_q1']:>13} "
            f"{f(s['prefilled_rest_median'], '{:.0f}'):>6}"
        )
    print(m["load_note"])


def build_engine(args):
    from lazyrag.engine import LazyEngine
    from lazyrag.model.loader import resolve_model_source

    args.model_label = resolve_model_source(args.model).name
    return LazyEngine.from_pretrained(args.model)  # as `lazyrag serve` loads it, with its defaults


def parse_args(argv=None):
    from lazyrag.server import ServerConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="a model folder or .gguf (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--dataset", default="2wiki", help="a benchmarks/data set of HotpotQA-style items: 2wiki, musique")
    ap.add_argument("--data", type=Path, default=None, help="its file (default: lazyrag.eval.default_data(dataset))")
    ap.add_argument(
        "--item", type=int, default=0, help="the item whose passages are retrieved (the next one: the warm-up's)"
    )
    ap.add_argument("--passages", type=int, default=10, help="passages per prompt (2wiki has 10 an item)")
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--clients", default=",".join(CLIENTS), type=lambda s: s.split(","), help=", ".join(CLIENTS))
    ap.add_argument("--max-tokens", type=int, default=32, help="answer tokens")
    ap.add_argument(
        "--strategy", default=ServerConfig.strategy, help="the server's default strategy (lazyrag serve's: %(default)s)"
    )
    ap.add_argument("--context-window", type=int, default=8192, help="what LlamaIndex is told the model holds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="warning", help="uvicorn's")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pasted_context_cpu.json")
    args = ap.parse_args(argv)
    unknown = [c for c in args.clients if c not in CLIENTS]
    if unknown:
        ap.error(f"unknown clients {unknown}: pick from {', '.join(CLIENTS)}")
    if args.questions < 1 or args.passages < 1:
        ap.error("--questions and --passages must be at least 1")
    return args


def main(argv=None, engine=None) -> int:
    """``engine``: one already loaded (a test's), else the embedded default model is loaded as ``serve`` does."""
    args = parse_args(argv)
    command = ".venv/bin/python benchmarks/pasted_context.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0, load_s = time.perf_counter(), None
    if engine is None:
        engine = build_engine(args)
        load_s = time.perf_counter() - t0
        print(f"{args.model_label}: loaded in {load_s:.1f} s", flush=True)
    result = benchmark(engine, args, command.strip())
    result["meta"]["model_load_s"] = load_s
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
