"""Routing across real replicas: chunk affinity vs least loaded vs round robin, on Ray Serve.

The deployment ``lazyrag serve --replicas N`` runs (``lazyrag/server/replicas.py``: N engine replicas and the
routing front, loopback only), started once per router on a cold cache, and the same seeded workload sent to
each through the OpenAI endpoint: chat requests carrying their ``documents``, streamed
(``stream_options.include_usage``: the last event holds ``usage`` and the ``lazyrag`` reuse stats).

Workload: the simulation's (``benchmarks/routing.py``, ``hit_rate.Workload``): D documents, k distinct ones a
request by Zipf(``--alpha``) popularity, Poisson arrivals at ``--rate`` requests/s per replica. Documents are
seeded random text cut to ``--doc-tokens`` tokens of the model's tokenizer (what a replica encodes is a chunk of
about that many tokens). Each replica's ``--kv-budget`` (its whole KV pool) is small enough that it holds only
some of the documents, so where a request goes decides what it finds cached.

Measured per request at the client: TTFT (request sent to first content token) and total time; from the last
event: chunks hit / missed, prompt / cached / generated tokens, tokens run through the model; from the
``x-lazyrag-replica`` header: where it went. Per router: chunk hit rate, TTFT p50 / p99, requests/s and
tokens/s (from the first arrival to the last answer), the busiest replica's share.

    python benchmarks/replicas.py  # CPU default: 2 replicas of the embedded model -> results/replicas_cpu.{json,png}
    # the paper's scale on one GPU, two replicas sharing it with a split budget:
    python benchmarks/replicas.py --device cuda --model PATH --replicas 2 4 --docs 100 --doc-tokens 2048 \\
        --docs-per-prompt 5 --requests-per-replica 100 --rate 8 --kv-budget 4GiB --gpus-per-replica auto \\
        --out benchmarks/results/replicas_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# not this folder (its kernels.py would shadow the ``kernels`` package transformers imports), the repository root
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks.hit_rate import Workload  # noqa: E402
from lazyrag.server.routing import ROUTERS  # noqa: E402
from lazyrag.sizes import parse_bytes  # noqa: E402

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "de",
    "fa",
    "gu",
    "ha",
    "ji",
    "ko",
    "lu",
    "ma",
    "no",
    "pe",
    "ra",
    "si",
    "to",
    "va",
    "we",
    "yo",
    "zi",
    "bra",
    "cle",
    "dro",
    "fin",
    "gol",
    "har",
    "kel",
    "mor",
    "nix",
    "pal",
    "quo",
    "ren",
    "sol",
    "tam",
    "vor",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]  # nearest rank below, as benchmarks/routing.py


def make_workload(args, n_replicas: int, tokenizer) -> tuple[list[str], list[dict]]:
    """The documents' texts and the requests (their documents by index, question, arrival time)."""
    wl = Workload(
        num_docs=args.docs,
        doc_tokens=args.doc_tokens,
        docs_per_prompt=args.docs_per_prompt,
        requests=args.requests_per_replica * n_replicas,
        seed=args.seed,
    )
    text = random.Random(args.seed + 1)
    docs = []
    for d in range(args.docs):
        words = " ".join(
            "".join(text.choice(SYLLABLES) for _ in range(text.randint(1, 3))) for _ in range(args.doc_tokens)
        )
        ids = tokenizer.encode(f"Record {d}. {words}", add_special_tokens=False)[: args.doc_tokens]
        docs.append(tokenizer.decode(ids).strip())
    rng = random.Random(wl.seed)  # arrivals as benchmarks/routing.py draws them
    t, requests = 0.0, []
    for i, layout in enumerate(wl.prompts(args.alpha)):  # the simulation's documents: ids 100_000 + d * doc_tokens + j
        t += rng.expovariate(args.rate * n_replicas) if args.rate > 0 else 0.0
        picked = [(ids[0] - 100_000) // args.doc_tokens for ids in layout.chunk_ids]
        requests.append(
            {
                "i": i,
                "docs": picked,
                "arrival_s": t,
                "question": f"Question {i}: what do the records say about {text.choice(SYLLABLES)}?",
            }
        )
    return docs, requests


async def send_all(base_url: str, model: str, docs: list[str], requests: list[dict], args) -> tuple[list[dict], float]:
    import httpx

    async with httpx.AsyncClient(
        base_url=base_url,
        timeout=args.request_timeout,
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
    ) as client:
        t0 = time.perf_counter()

        async def one(req: dict) -> dict:
            await asyncio.sleep(max(0.0, req["arrival_s"] - (time.perf_counter() - t0)))
            body = {
                "model": model,
                "messages": [{"role": "user", "content": req["question"]}],
                "documents": [docs[d] for d in req["docs"]],
                "max_tokens": args.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.strategy:
                body["strategy"] = args.strategy
            sent = time.perf_counter()
            out = {"i": req["i"], "docs": req["docs"], "sent_s": sent - t0, "ttft_s": None, "error": None}
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    out["replica"], out["status"] = r.headers.get("x-lazyrag-replica"), r.status_code
                    if r.status_code != 200:
                        out["error"] = (await r.aread()).decode(errors="replace")[:300]
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                out["error"] = out["error"] or event["error"].get("message", str(event["error"]))[:300]
                            elif event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                                if out["ttft_s"] is None:
                                    out["ttft_s"] = time.perf_counter() - sent
                            elif event.get("usage") and event.get("lazyrag", {}).get("choices"):
                                out["usage"], out["stats"] = event["usage"], event["lazyrag"]["choices"][0]
            except Exception as e:  # the client's own failure: counted, the run goes on
                out["error"] = out["error"] or f"{type(e).__name__}: {e}"
            out["done_s"] = time.perf_counter() - t0
            out["total_s"] = time.perf_counter() - sent
            if out["error"] is None and ("stats" not in out or out["ttft_s"] is None):
                out["error"] = "no content or no usage event"
            return out

        results = await asyncio.gather(*(one(r) for r in requests))
    return list(results), t0


def summarize(router: str, n: int, results: list[dict], args) -> dict:
    ok = [r for r in results if r["error"] is None]
    row = {
        "router": router,
        "replicas": n,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "rate_per_replica": args.rate,
    }
    if not ok:
        return row
    hit = sum(r["stats"]["chunks_hit"] for r in ok)
    looked = hit + sum(r["stats"]["chunks_missed"] for r in ok)
    span = max(r["done_s"] for r in ok) - min(r["sent_s"] for r in ok)
    ttft = [1e3 * r["ttft_s"] for r in ok]
    total = [1e3 * r["total_s"] for r in ok]
    per_replica = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    row.update(
        {
            "chunk_hit_rate": hit / max(1, looked),
            "cached_token_share": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
            / max(1, sum(r["usage"]["prompt_tokens"] for r in ok)),
            "tokens_prefilled_per_request": statistics.mean(r["stats"]["tokens_prefilled"] for r in ok),
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": percentile(ttft, 0.99),
            "ttft_mean_ms": statistics.mean(ttft),
            "total_p50_ms": statistics.median(total),
            "total_p99_ms": percentile(total, 0.99),
            "server_ttft_p50_ms": statistics.median(1e3 * r["stats"]["ttft_s"] for r in ok),
            "throughput_rps": len(ok) / span,
            "prompt_tokens_per_s": sum(r["usage"]["prompt_tokens"] for r in ok) / span,
            "completion_tokens_per_s": sum(r["usage"]["completion_tokens"] for r in ok) / span,
            "busiest_replica_share": max(per_replica.values()) / len(ok),
            "per_replica": dict(sorted(per_replica.items())),
            "span_s": span,
        }
    )
    return row


def run_router(router: str, n: int, docs: list[str], requests: list[dict], args) -> tuple[dict, list[dict]]:
    """Deploy ``lazyrag serve --replicas n --router router`` (cold caches), warm each replica, send the workload."""
    import httpx
    from ray import serve

    from lazyrag.server.replicas import ReplicaSpec, run

    server = {"max_tokens": args.max_tokens, "max_pending": 4096}
    spec = ReplicaSpec(model=args.model, device=args.device, dtype=args.dtype, kv_budget=args.kv_budget, server=server)
    options = {
        "ray_actor_options": {"num_cpus": 0, **({"num_gpus": args.gpus_per_replica} if args.gpus_per_replica else {})}
    }
    port = free_port()
    t0 = time.perf_counter()
    run(spec, n, router, "127.0.0.1", port, blocking=False, replica_options=options)
    started = time.perf_counter() - t0
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=300) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            c.get("/routing").raise_for_status()  # the front loads its tokenizer for the chunk keys
        # warm every replica the same way (its prompt prefix cached, first forward done), straight to each one
        warm = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 1}
        ).encode()
        for i in range(n):
            handle = serve.get_deployment_handle(f"replica-{i}", app_name="lazyrag")
            gen = handle.options(stream=True).serve_http.remote(
                "POST", "/v1/chat/completions", b"", [(b"content-type", b"application/json")], warm
            )
            for _ in gen:
                pass
        time.sleep(0.5)  # the front has polled the warm-ups' KV events (the prefix) before the first request
        results, _ = asyncio.run(send_all(base, model, docs, requests, args))
        with httpx.Client(base_url=base, timeout=60) as c:
            state = c.get("/routing").json()
    finally:
        serve.shutdown()
    row = summarize(router, n, results, args)
    row["deploy_s"], row["end_state"] = round(started, 1), state
    return row, results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2])
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    ap.add_argument("--docs", type=int, default=24, help="documents in the corpus (the paper: 100)")
    ap.add_argument("--doc-tokens", type=int, default=96, help="tokens a document (the paper: 2048)")
    ap.add_argument("--docs-per-prompt", type=int, default=3, help="documents a request (the paper: 5)")
    ap.add_argument("--requests-per-replica", type=int, default=30)
    ap.add_argument("--rate", type=float, default=0.4, help="Poisson arrivals, requests/s per replica (0: all at once)")
    ap.add_argument("--alpha", type=float, default=2.1, help="Zipf exponent of document popularity")
    ap.add_argument(
        "--kv-budget",
        type=parse_bytes,
        default=parse_bytes("40MiB"),
        help="each replica's KV pool, bytes or 40MiB / 4GiB (the CPU default: 910 tokens of float32 SmolLM2-135M KV, "
        "45 KiB a token: ~6 of its 24 documents besides the requests in flight)",
    )
    ap.add_argument("--max-tokens", type=int, default=4, help="generated tokens a request")
    ap.add_argument(
        "--strategy",
        default="lazy",
        help="the requests' strategy ('' = the server's default, lazy+recover; "
        "lazy, as the simulation models: a request with every chunk cached computes only its question)",
    )
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: the engine's choice)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument(
        "--gpus-per-replica",
        default=None,
        help="Ray num_gpus of each replica: a fraction shares one GPU (0.5 for 2 on one); 'auto' = 1/N",
    )
    ap.add_argument("--num-cpus", type=int, default=None, help="ray.init's CPUs (default: the machine's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "replicas_cpu.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from lazyrag.model.loader import resolve_model_source

    t_all = time.perf_counter()
    source = resolve_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source.folder, **source.kwargs())
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    rows, per_request = [], {}
    gpus = args.gpus_per_replica
    print(
        f"{'replicas':>8} {'router':<15}{'hit rate':>9}{'TTFT p50':>10}{'p99 ms':>9}{'total p50':>10}{'req/s':>7}"
        f"{'tok/s':>8}{'busiest':>9}{'errors':>7}",
        flush=True,
    )
    try:
        for n in args.replicas:
            args.gpus_per_replica = (1.0 / n if gpus == "auto" else float(gpus)) if gpus else None
            docs, requests = make_workload(args, n, tokenizer)
            for router in args.routers:
                row, results = run_router(router, n, docs, requests, args)
                rows.append(row)
                per_request[f"{n}/{router}"] = results
                if "chunk_hit_rate" not in row:
                    print(f"{n:>8} {router:<15} every request failed: {results[0]['error']}", flush=True)
                    continue
                print(
                    f"{n:>8} {router:<15}{row['chunk_hit_rate']:>9.1%}{row['ttft_p50_ms']:>10.0f}"
                    f"{row['ttft_p99_ms']:>9.0f}{row['total_p50_ms']:>10.0f}{row['throughput_rps']:>7.2f}"
                    f"{row['prompt_tokens_per_s'] + row['completion_tokens_per_s']:>8.0f}"
                    f"{row['busiest_replica_share']:>9.1%}{row['errors']:>7}",
                    flush=True,
                )
    finally:
        args.gpus_per_replica = gpus
        if started_ray:
            ray.shutdown()
    for n in args.replicas:
        by = {r["router"]: r for r in rows if r["replicas"] == n and "chunk_hit_rate" in r}
        if "chunk_affinity" in by and "round_robin" in by:
            a, b = by["chunk_affinity"], by["round_robin"]
            print(
                f"{n:>3} replicas: affinity / round robin  TTFT p50 {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x, "
                f"p99 {a['ttft_p99_ms'] / b['ttft_p99_ms']:.2f}x, "
                f"hit rate {a['chunk_hit_rate']:.1%} vs {b['chunk_hit_rate']:.1%}"
            )
    wl = {
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "docs_per_prompt": args.docs_per_prompt,
        "alpha": args.alpha,
        "requests_per_replica": args.requests_per_replica,
        "rate_per_replica": args.rate,
        "max_tokens": args.max_tokens,
        "kv_budget_bytes_per_replica": args.kv_budget,
        "seed": args.seed,
    }
    meta = {
        "workload": wl,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": "python benchmarks/replicas.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": source.folder if args.model is None else args.model,
        "seconds": round(time.perf_counter() - t_all, 1),
        "note": "real replicas (Ray Serve, loopback); one engine thread per replica on CPU (Ray sets "
        "OMP_NUM_THREADS=1 for num_cpus=0 actors); p99 of a few dozen requests is close to their maximum",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "per_request": per_request}, indent=1, default=str))
    wrote = [str(args.out)]
    if not args.no_plot and any("chunk_hit_rate" in r for r in rows):
        try:
            plot(rows, args.out.with_suffix(".png"), args)
            wrote.append(str(args.out.with_suffix(".png")))
        except ImportError:
            pass
    print(f"wrote {' and '.join(wrote)} ({meta['seconds']} s)")
    return 0


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "chunk_hit_rate" in r]
    ns = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / len(args.routers)
    for j, name in enumerate(args.routers):
        mine = {r["replicas"]: r for r in rows if r["router"] == name}
        xs = [k + j * width for k in range(len(ns)) if ns[k] in mine]
        got = [mine[n] for n in ns if n in mine]
        axes[0].bar(xs, [100 * r["chunk_hit_rate"] for r in got], width, color=f"C{j}", label=name)
        axes[1].bar(xs, [r["ttft_p50_ms"] for r in got], width, color=f"C{j}", label=f"{name} p50")
        axes[1].scatter(xs, [r["ttft_p99_ms"] for r in got], color=f"C{j}", marker="_", s=300, label=f"{name} p99")
        axes[2].bar(xs, [r["throughput_rps"] for r in got], width, color=f"C{j}", label=name)
    for ax, title in zip(axes, ("chunk hit rate (%)", "TTFT ms (bar p50, dash p99)", "requests/s")):
        ax.set_xticks([k + width * (len(args.routers) - 1) / 2 for k in range(len(ns))], [f"{n} replicas" for n in ns])
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6)
    fig.suptitle(
        f"routing, real replicas (Ray Serve): Zipf {args.alpha} over {args.docs} docs x {args.doc_tokens} tokens, "
        f"{args.docs_per_prompt} a request, {args.kv_budget / (1 << 20):.0f} MiB KV a replica, "
        f"{args.rate:g} req/s a replica, {args.device or 'default device'}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
