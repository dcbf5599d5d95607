"""Serving under load on one GPU: TTFT, throughput and hit rate of full / prefix / position-aware / lazy.

The paper's workload (``hit_rate.Workload``): 100 documents x 2048 tokens, 5 distinct
documents per prompt drawn by Zipf(2.1) popularity (or uniformly), a 32-token shared
prefix, a 32-token question and 16 output tokens (end-of-turn ignored), on a
Llama-3.1-8B-shaped model with random bf16 weights (speed does not depend on the values).
Every strategy runs in the same process, on the same model and engine: the continuous-
batching scheduler (``lazyrag/engine/scheduler.py``), Triton kernels and CUDA graphs. A request's
missing documents are encoded when it is admitted (prefix caching: its uncached prompt
tail is prefilled), and each strategy's cache holds at most the KV budget; the pool has
``--work-gb`` more for the requests in flight.

Experiments (``--experiments``, each a list of runs that start from an empty cache):
* ``rates``: Poisson arrivals at each ``--rates`` (requests/s), Zipf, ``--budget`` GB;
* ``budgets``: Zipf at ``--rate`` for each of ``--budgets`` GB;
* ``uniform``: uniform popularity at ``--rate``, ``--budget`` GB;
* ``throughput``: closed loop, ``--concurrency`` clients each sending its next request when
  the last one is answered (the paper's 16), Zipf, ``--budget`` GB: requests/s (``--unbatched``: lazy
  without the step's batched encode too, the one-request-at-a-time path);
* ``host``: ``--budget`` GB on the device plus a ``--host-gb`` host-RAM tier that holds the corpus: the
  closed loop, then Poisson at ``--rate``.

``--strategies`` applies to every experiment; besides the engine's strategies it takes
``reorder+prefix``: prefix caching over prompts whose chunks are sorted in one global popularity
order (ContextPilot-style; exact KV, only the order the model reads changes).

Time is the wall clock of the stepping loop with idle gaps skipped: when no request is in
flight and the next has not arrived, the clock jumps to its arrival. Busy time is measured,
never simulated, and the device never waits on purpose (a 0.5 req/s run costs only its
busy time). ``full`` keeps no cache, so it is run once per arrival pattern, not per budget.

    python benchmarks/serving.py --out benchmarks/results/serving_h200.json            # all, ~15 min on an H200
    python benchmarks/serving.py --experiments rates --requests 40 --out /tmp/rates.json
    python benchmarks/serving.py --plot benchmarks/results/serving_h200.json           # tables and PNG from saved runs
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the script's own folder off the path: its kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks.hit_rate import Workload  # noqa: E402

STRATEGIES = ["full", "prefix", "reorder+prefix", "position_aware", "position_aware:rerotate", "lazy"]
GiB = 1 << 30
ENGINE_STRATEGIES = [s for s in STRATEGIES if s != "reorder+prefix"]
UNBATCHED = "lazy (one at a time)"  # lazy with each request encoding its own misses (SchedulerConfig.batch_encodes off)


def reorder_by_popularity(prompts):
    """ContextPilot-style exact reuse for a stock prefix cache: every prompt's chunks sorted in one global order,
    the most requested first (counted over the workload, as a front end counts what it has seen), so prompts that
    share popular chunks share a prefix. The KV stays exact; only the order the model reads the chunks in changes."""
    from collections import Counter

    from lazyrag.prompt import PromptLayout

    counts = Counter(tuple(c) for layout in prompts for c in layout.chunk_ids)
    rank = {c: i for i, (c, _) in enumerate(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))}
    return [
        PromptLayout(layout.prefix_ids, sorted(layout.chunk_ids, key=lambda c: rank[tuple(c)]), layout.question_ids)
        for layout in prompts
    ]


class SkipIdleClock:
    """perf_counter since start, plus the idle gaps the loop skipped."""

    def __init__(self):
        self.start, self.skipped = time.perf_counter(), 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.start + self.skipped

    def skip_to(self, t: float) -> None:
        self.skipped += max(0.0, t - self())


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def run(
    engine,
    strategy: str,
    prompts,
    params,
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    budget_gb: float,
    policy: str = "lru",
    seed: int = 0,
    host_gb: float = 0.0,
) -> dict:
    """Serve ``prompts`` with Poisson arrivals at ``rate`` req/s, or closed-loop with ``concurrency`` clients.

    ``policy``: the cache's eviction policy (lru, lfu, gdsf), ``+admit`` for TinyLFU admission. ``host_gb``: a host-RAM
    tier below the device budget; every kind a strategy caches spills there (copies and prefix blocks too, as KV
    offloading does for position-bound caches). ``strategy`` may also be ``reorder+prefix`` (prefix caching over
    reordered prompts) or ``lazy (one at a time)`` (lazy without the step's batched encode)."""
    from lazyrag.kv.cache import CacheConfig, SegmentKind

    label = strategy
    if strategy == "reorder+prefix":
        prompts, strategy = reorder_by_popularity(prompts), "prefix"
    batch_encodes = strategy != UNBATCHED
    strategy = "lazy" if strategy == UNBATCHED else strategy
    name, _, admit = policy.partition("+")
    kinds = tuple(SegmentKind) if host_gb else CacheConfig.demote_kinds
    engine.cache.reconfigure(
        CacheConfig(
            policy=name,
            admission=bool(admit),
            budget_bytes=int(budget_gb * GiB),
            host_bytes=int(host_gb * GiB),
            demote_kinds=kinds,
        )
    )
    was_batching, engine.scheduler.config.batch_encodes = engine.scheduler.config.batch_encodes, batch_encodes
    try:
        row = _serve(engine, strategy, prompts, params, rate, concurrency, seed)
    finally:
        engine.scheduler.config.batch_encodes = was_batching
        engine.cache.reconfigure(CacheConfig(budget_bytes=int(budget_gb * GiB)))  # the host tier's RAM goes back
    return {
        "strategy": label,
        "policy": policy,
        "rate": rate,
        "concurrency": concurrency,
        "budget_gb": budget_gb,
        "host_gb": host_gb,
        **row,
    }


def _serve(engine, strategy: str, prompts, params, rate, concurrency, seed) -> dict:
    import torch

    clock = SkipIdleClock()
    engine.scheduler.clock = clock
    tier_hits0, prefetched0 = engine.cache.stats.tier_hits, engine.cache.stats.prefetched
    # e.g. the CUDA-graph scratch block
    held_outside = engine.cache.pool.num_blocks - engine.cache.pool.num_free - engine.cache.cached_blocks
    rng = random.Random(seed)
    todo = deque(prompts)
    reqs = []
    if rate is not None:
        t, arrivals = 0.0, deque()
        for layout in todo:
            t += rng.expovariate(rate)
            arrivals.append((t, layout))
        while arrivals or engine.has_unfinished_requests():
            now = clock()
            while arrivals and arrivals[0][0] <= now:
                at, layout = arrivals.popleft()
                reqs.append(engine.add_request(layout, replace(params, strategy=strategy), arrival=at))
            if not engine.has_unfinished_requests():
                clock.skip_to(arrivals[0][0])
                continue
            engine.step()
    else:
        in_flight = []
        while todo or in_flight:
            while todo and len(in_flight) < concurrency:
                in_flight.append(engine.add_request(todo.popleft(), replace(params, strategy=strategy)))
            engine.step()
            done = [r for r in in_flight if r.done]
            reqs += done
            in_flight = [r for r in in_flight if not r.done]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    results = [r.result() for r in reqs]
    assert all(len(r.token_ids) == params.max_new_tokens for r in results)
    assert engine.cache.num_pinned == 0, "a finished request left a pin"
    assert engine.cache.pool.num_free + engine.cache.cached_blocks + held_outside == engine.cache.pool.num_blocks, (
        "leaked blocks"
    )
    ttft = [r.ttft_s for r in results]
    first = min(r.arrival for r in reqs)
    makespan = max(r.finished_at for r in reqs) - first
    hits = sum(r.stats.chunks_hit for r in results)
    lookups = hits + sum(r.stats.chunks_missed for r in results)
    return {
        "requests": len(results),
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "latency_p50_ms": 1e3 * percentile([r.total_s for r in results], 50),
        "throughput_rps": len(results) / makespan,
        "output_tokens_per_s": sum(len(r.token_ids) for r in results) / makespan,
        "chunk_hit_rate": hits / lookups if lookups else 0.0,
        "tier_hits": engine.cache.stats.tier_hits - tier_hits0,  # chunk and prefix lookups promoted from the host tier
        # segments promoted ahead of their request while others ran (SchedulerConfig.prefetch_waiting)
        "prefetched": engine.cache.stats.prefetched - prefetched0,
        "tokens_prefilled_per_request": statistics.fmean(r.stats.tokens_prefilled for r in results),
        "makespan_s": makespan,
        "skipped_idle_s": clock.skipped,
    }


def tiny_engine(pool_bytes: int, max_running: int = 64):
    """A tiny random Llama on the CPU (2 layers, 2 KV heads of 16): the real scheduler, planner and cache manager
    at a speed where a whole workload replays in seconds; checks the loop and its hit rates, not the speed."""
    from benchmarks.e2e_gpu import llama31_8b_config
    from lazyrag.engine import LazyEngine, SchedulerConfig

    config = llama31_8b_config(2)
    config.update(
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
        )
    )
    return LazyEngine.from_config(
        config, device="cpu", kv_budget=pool_bytes, scheduler=SchedulerConfig(max_running=max_running)
    )


def budget_in_documents(engine, wl: Workload, docs: float) -> float:
    """The budget (GB) that holds ``docs`` of the workload's documents on this engine: 1 GB holds 4 documents of
    2,048 tokens at Llama-3.1-8B's 128 KiB a token, so a tiny model replays the paper's 1 GB as 4 documents."""
    shape = engine.cache.pool.shape
    return docs * wl.doc_tokens * shape.bytes_per_block / shape.block_size / GiB


def build_engine(args):
    import torch

    from benchmarks.e2e_gpu import llama31_8b_config
    from lazyrag.engine import LazyEngine, SchedulerConfig

    if args.smoke:
        return tiny_engine(64 << 20, args.max_running)
    pool_bytes = int((max(args.budgets + [args.budget]) + args.work_gb) * GiB)
    return LazyEngine.from_config(
        llama31_8b_config(args.layers),
        device="cuda",
        dtype=torch.bfloat16,
        kv_budget=pool_bytes,
        scheduler=SchedulerConfig(max_running=args.max_running),
    )


def warm_up(engine, wl: Workload, params) -> float:
    """Compile and capture what the runs will use (batch sizes 1..64, long and short prefills)."""
    t = time.perf_counter()
    prompts = Workload(**{**asdict(wl), "requests": 64, "seed": 999}).prompts(2.1)
    for strategy in ENGINE_STRATEGIES:
        engine.submit(prompts[0], replace(params, strategy=strategy)).result()
    batch = 1
    while batch <= engine.scheduler.config.max_running:
        for layout in prompts[:batch]:
            engine.add_request(layout, params)
        while engine.has_unfinished_requests():
            engine.step()
        batch *= 2
    engine.cache.clear()
    return time.perf_counter() - t


def host_note(row: dict) -> str:
    return f" + host {row['host_gb']:g} GB" if row.get("host_gb") else ""


def experiments(args, engine, wl: Workload, params, save) -> list[dict]:
    zipf = wl.prompts(args.alpha)
    rows = []

    def go(tag, strategy, prompts, budget_gb, host_gb=0.0, **kw):
        t = time.perf_counter()
        scale = getattr(args, "gb_scale", 1.0)  # --smoke: a GB of the flags is 4 of the tiny model's documents
        row = run(engine, strategy, prompts, params, budget_gb=budget_gb * scale, host_gb=host_gb * scale, **kw)
        row = dict(
            row,
            budget_gb=budget_gb,
            host_gb=host_gb,
            experiment=tag,
            distribution="uniform" if tag == "uniform" else "zipf",
            wall_s=round(time.perf_counter() - t, 1),
        )
        rows.append(row)
        print(
            f"{tag:<11}{strategy:<24}{row['policy']:<10}rate={row['rate']} conc={row['concurrency']} "
            f"{row['budget_gb']:g} GB{host_note(row)}: "
            f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms p99 {row['ttft_p99_ms']:8.1f} ms, "
            f"{row['throughput_rps']:.2f} req/s, hit {100 * row['chunk_hit_rate']:5.1f}%, "
            f"{row['tokens_prefilled_per_request']:.0f} tokens prefilled/request ({row['wall_s']} s)",
            flush=True,
        )
        save(rows)  # a run cut short by a time limit keeps what it measured

    strategies = args.strategies
    caching = [s for s in strategies if s != "full"]
    closed_loop = strategies + ([UNBATCHED] if args.unbatched else [])
    for exp in args.experiments:
        if exp == "rates":
            for rate in args.rates:
                for s in strategies:
                    go("rates", s, zipf, rate=rate, budget_gb=args.budget)
        elif exp == "budgets":
            for b in args.budgets:
                for s in caching:
                    if not (b == args.budget and "rates" in args.experiments and args.rate in args.rates):
                        go("budgets", s, zipf, rate=args.rate, budget_gb=b)
        elif exp == "uniform":
            for s in strategies:
                go("uniform", s, wl.prompts(None), rate=args.rate, budget_gb=args.budget)
        elif exp == "throughput":
            prompts = Workload(**{**asdict(wl), "requests": args.throughput_requests}).prompts(args.alpha)
            for policy in args.policies:
                for s in closed_loop:
                    go("throughput", s, prompts, concurrency=args.concurrency, budget_gb=args.budget, policy=policy)
        elif exp == "host":  # the device budget plus a host-RAM tier: closed loop, then Poisson at --rate
            prompts = Workload(**{**asdict(wl), "requests": args.throughput_requests}).prompts(args.alpha)
            for s in caching:
                go("host", s, prompts, concurrency=args.concurrency, budget_gb=args.budget, host_gb=args.host_gb)
            for s in caching:
                go("host", s, zipf, rate=args.rate, budget_gb=args.budget, host_gb=args.host_gb)
    return rows


def summarize(rows: list[dict], budget: float, rate: float) -> dict:
    """Lazy's factors over each baseline where both ran: TTFT (baseline / lazy) and throughput (lazy / baseline)."""

    def pick(**kw):
        return {r["strategy"]: r for r in rows if all(r.get(k) == v for k, v in kw.items())}

    out = {}
    for base in [s for s in STRATEGIES if s != "lazy"] + [UNBATCHED]:
        for rr in sorted({r["rate"] for r in rows if r["experiment"] == "rates"}):
            by = pick(experiment="rates", rate=rr)
            if "lazy" in by and base in by:
                out[f"rate {rr:g}: TTFT p50 {base}/lazy"] = by[base]["ttft_p50_ms"] / by["lazy"]["ttft_p50_ms"]
                out[f"rate {rr:g}: TTFT p99 {base}/lazy"] = by[base]["ttft_p99_ms"] / by["lazy"]["ttft_p99_ms"]
        for exp in ("throughput", "host"):
            for policy in sorted({r.get("policy", "lru") for r in rows if r["experiment"] == exp}):
                by = pick(experiment=exp, policy=policy, rate=None)
                if "lazy" in by and base in by:
                    out[f"{exp} ({policy}) lazy/{base}"] = by["lazy"]["throughput_rps"] / by[base]["throughput_rps"]
            by = pick(experiment="host", rate=rate)
            if exp == "host" and "lazy" in by and base in by:
                out[f"host, rate {rate:g}: TTFT p50 {base}/lazy"] = by[base]["ttft_p50_ms"] / by["lazy"]["ttft_p50_ms"]
    return out


def print_tables(rows: list[dict]) -> None:
    cols = [
        ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
        ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
        ("throughput_rps", "req/s", "{:.2f}"),
        ("chunk_hit_rate", "hit rate", "{:.1%}"),
        ("tokens_prefilled_per_request", "prefilled/req", "{:.0f}"),
    ]
    for exp in ("rates", "budgets", "uniform", "throughput", "host"):
        sel = [r for r in rows if r["experiment"] == exp]
        if not sel:
            continue
        print(f"\n{exp}")
        print(
            f"{'strategy':<24}{'policy':<10}{'rate':>6}{'conc':>6}{'GB':>7}{'host GB':>8}"
            + "".join(f"{h:>14}" for _, h, _ in cols)
        )
        for r in sel:
            print(
                f"{r['strategy']:<24}{r.get('policy', 'lru'):<10}{str(r['rate'] or '-'):>6}"
                f"{str(r['concurrency'] or '-'):>6}{r['budget_gb']:>7g}{r.get('host_gb', 0):>8g}"
                + "".join(f"{f.format(r[k]):>14}" for k, _, f in cols if k in r)
            )


def color(strategy: str) -> str:
    known = STRATEGIES + [UNBATCHED]
    return f"C{known.index(strategy)}" if strategy in known else "0.6"


def _throughput_panel(ax, rows: list[dict]) -> None:
    """Closed-loop requests/s per strategy, the GPU budget alone beside the same budget with a host-RAM tier."""
    closed = [
        r
        for r in rows
        if r["experiment"] in ("throughput", "host") and r["rate"] is None and r.get("policy", "lru") == "lru"
    ]
    groups = [
        (0.0, "GPU budget only"),
        *sorted({(r["host_gb"], f"+ {r['host_gb']:g} GB host tier") for r in closed if r.get("host_gb")}),
    ]
    names = [s for s in STRATEGIES + [UNBATCHED] if any(r["strategy"] == s for r in closed)]
    names = [
        s for s in dict.fromkeys(r["strategy"] for r in closed) if s not in names
    ] + names  # e.g. an older tree's run
    width = 0.8 / max(1, len(groups))
    for g, (host, label) in enumerate(groups):
        labelled = False
        for i, s in enumerate(names):
            r = next((r for r in closed if r["strategy"] == s and r.get("host_gb", 0.0) == host), None)
            if r is not None:
                ax.bar(
                    i + g * width,
                    r["throughput_rps"],
                    width,
                    color=color(s),
                    alpha=1.0 if g == 0 else 0.55,
                    hatch=None if g == 0 else "//",
                    edgecolor="black" if g else None,
                    label=None if labelled else label,
                )
                labelled = True
                ax.text(
                    i + g * width,
                    r["throughput_rps"],
                    f"{r['throughput_rps']:.1f}\n{100 * r['chunk_hit_rate']:.0f}%",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
    if names:
        ax.set_xticks([i + (len(groups) - 1) * width / 2 for i in range(len(names))], names, fontsize=7, rotation=20)
        ax.set(ylabel="requests/s (label: req/s, chunk hit rate)", title="throughput, closed loop")
        ax.legend(fontsize=7)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in rows if r["experiment"] == "rates"]
    if not rates and not any(r["experiment"] == "budgets" for r in rows):  # closed-loop runs only: their panel alone
        fig, ax = plt.subplots(1, 1, figsize=(8, 4.6))
        _throughput_panel(ax, rows)
        ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for s in STRATEGIES:
        pts = sorted((r["rate"], r["ttft_p50_ms"], r["ttft_p99_ms"]) for r in rates if r["strategy"] == s)
        if pts:
            x, p50, p99 = zip(*pts)
            axes[0].plot(x, p50, marker="o", color=color(s), label=f"{s} p50")
            axes[0].plot(x, p99, marker="x", ls="--", color=color(s), label=f"{s} p99")
    axes[0].set(xlabel="arrival rate (req/s, Poisson)", ylabel="TTFT (ms)", yscale="log", title="TTFT vs load (Zipf)")
    axes[0].legend(fontsize=7)
    budget_rows = [r for r in rows if r["experiment"] in ("budgets", "rates")]
    brate = next((r["rate"] for r in rows if r["experiment"] == "budgets"), None)
    for s in STRATEGIES[1:]:
        pts = sorted(
            {
                (r["budget_gb"], r["ttft_p50_ms"], r["chunk_hit_rate"])
                for r in budget_rows
                if r["strategy"] == s and r["rate"] == brate
            }
        )
        if pts:
            x, p50, hit = zip(*pts)
            axes[1].plot(x, p50, marker="o", color=color(s), label=s)
            axes[2].plot(x, [100 * h for h in hit], marker="o", color=color(s), label=s)
    axes[1].set(
        xlabel="KV cache budget (GB)", ylabel="TTFT p50 (ms)", xscale="log", title=f"TTFT vs budget ({brate} req/s)"
    )
    axes[2].set(xlabel="KV cache budget (GB)", ylabel="chunk hit rate (%)", xscale="log", title="hit rate vs budget")
    for ax in axes[1:3]:
        ax.legend(fontsize=8)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.minorticks_off()
    _throughput_panel(axes[3], rows)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--experiments",
        default="rates,budgets,uniform,throughput",
        type=lambda s: s.split(","),
        help="rates, budgets, uniform, throughput (closed loop), host (the budget plus a host-RAM tier)",
    )
    ap.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        type=lambda s: s.split(","),
        help="strategies of every experiment (reorder+prefix: prefix caching over prompts whose chunks are sorted "
        "in one popularity order)",
    )
    ap.add_argument(
        "--unbatched",
        action="store_true",
        help=f"closed loop: also lazy with each request encoding its own misses ('{UNBATCHED}')",
    )
    ap.add_argument("--host-gb", type=float, default=64.0, help="the host-RAM tier of the host experiment (GB)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4], help="Poisson arrival rates (req/s)")
    ap.add_argument("--rate", type=float, default=2.0, help="arrival rate of the budget and uniform runs")
    ap.add_argument(
        "--budget", type=float, default=1.0, help="KV cache budget (GB) of the rate, uniform and throughput runs"
    )
    ap.add_argument("--budgets", type=float, nargs="+", default=[1, 2, 4, 8], help="budgets of the budget runs (GB)")
    ap.add_argument("--requests", type=int, default=60, help="requests per Poisson run")
    ap.add_argument("--throughput-requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--policies",
        default="lru",
        type=lambda s: s.split(","),
        help="cache policies of the throughput runs: lru, lfu, gdsf, each with +admit for TinyLFU admission",
    )
    ap.add_argument("--alpha", type=float, default=2.1)
    ap.add_argument("--work-gb", type=float, default=24.0, help="pool beyond the cache budget, for requests in flight")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving_h200.json")
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny model and workload on the CPU (checks the loop, not the speed)"
    )
    ap.add_argument(
        "--plot", type=Path, nargs="+", default=None, help="only print and plot these saved result files (merged)"
    )
    args = ap.parse_args(argv)
    command = "python benchmarks/serving.py " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.plot:
        runs = [json.loads(p.read_text()) for p in args.plot]
        rows = [r for d in runs for r in d["rows"]]
        meta = next(d["meta"] for d in runs if "title" in d["meta"])
        print_tables(rows)
        summary = summarize(rows, meta["budget_gb"], meta["rate"])
        for k, v in summary.items():
            print(f"{k:<48}{v:.2f}x")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        merged = {
            "meta": {**meta, "merged_from": [str(p) for p in args.plot], "command": command},
            "rows": rows,
            "summary": summary,
        }
        args.out.write_text(json.dumps(merged, indent=1))
        plot(rows, args.out.with_suffix(".png"), meta["title"])
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
        return 0

    import torch

    from lazyrag.engine import SamplingParams

    assert torch.cuda.is_available() or args.smoke, "the serving benchmark needs a CUDA GPU (or --smoke)"
    t0 = time.perf_counter()
    engine = build_engine(args)
    wl = Workload(requests=args.requests, vocab_size=engine.model.args.vocab_size)
    if args.smoke:  # the paper's 100 documents, 64 tokens each; every GB of the flags is 4 documents, as at 8B shapes
        wl = Workload(doc_tokens=64, requests=args.requests, vocab_size=engine.model.args.vocab_size)
        args.gb_scale = budget_in_documents(engine, wl, 4)
    params = SamplingParams(max_new_tokens=wl.output_tokens, ignore_eos=True)
    load_s = time.perf_counter() - t0
    warm_s = warm_up(engine, wl, params)
    print(f"model {load_s:.0f} s, warm-up {warm_s:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def partial(rows):
        return args.out.write_text(json.dumps({"meta": {"partial": True, "command": command}, "rows": rows}, indent=1))

    rows = experiments(args, engine, wl, params, partial)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke test)"
    title = (
        f"Llama-3.1-8B shapes, random bf16, {device}: {wl.num_docs} docs x {wl.doc_tokens} tokens, "
        f"{wl.docs_per_prompt} per prompt, {wl.question_tokens}-token question, {wl.output_tokens} output tokens"
    )
    meta = {
        "title": title,
        "command": command,
        "device": device,
        "torch": torch.__version__,
        "workload": asdict(wl),
        "alpha": args.alpha,
        "budget_gb": args.budget,
        "rate": args.rate,
        "work_gb": args.work_gb,
        "max_running": args.max_running,
        "cache_policy": engine.cache.config.policy,
        "model_load_s": load_s,
        "warm_up_s": warm_s,
        "seconds": time.perf_counter() - t0,
    }
    print_tables(rows)
    summary = summarize(rows, args.budget, args.rate)
    for k, v in summary.items():
        print(f"{k:<48}{v:.2f}x")
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    plot(rows, args.out.with_suffix(".png"), title)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
