"""Routing across replicas, simulated: chunk affinity vs least loaded vs round robin, 2-64 replicas.

Each replica is the real cache manager and the real ``lazy`` planner (``CacheManager``, ``LazyStitching``)
over a block pool on the ``meta`` device, with a Llama-3.1-8B-sized KV budget; only the model is left
out (``hit_rate.NullRunner``), replaced by a cost model. Replicas publish their KV events
(``CacheManager.subscribe``) to the router (``lazyrag/server/routing.py``), which sees nothing else.

Workload (``hit_rate.Workload``, the paper's): 100 documents x 2048 tokens, 5 per prompt by Zipf(2.1)
popularity, a 32-token question; Poisson arrivals at ``--rate`` requests/s per replica. A replica
serves one prefill at a time, first come first served. Its time for a request (H200, Llama-3.1-8B shapes,
``benchmarks/results/e2e_h200_round9.json``): ``--hit-ms`` (lazy TTFT with every document cached, 5.48
ms for 5 x 512 + 64 tokens) plus ``--miss-us-per-token`` for every chunk token it encodes (full prefill
of those 2,656 tokens: 67.5 ms, 25.4 us a token). TTFT = queueing + that time.

    python benchmarks/routing.py                       # -> benchmarks/results/routing_sim.{json,png}
    python benchmarks/routing.py --replicas 2 4 --requests-per-replica 100   # a quick look
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hit_rate import LLAMA_8B_KV, NullRunner, Workload  # noqa: E402
from lazyrag.engine.reuse import LazyStitching  # noqa: E402
from lazyrag.kv.block_pool import BlockPool  # noqa: E402
from lazyrag.kv.cache import CacheConfig, CacheManager  # noqa: E402
from lazyrag.server.routing import ROUTERS, make_router  # noqa: E402

GiB = 1 << 30


class SimReplica:
    """One replica: its own pool, cache and planner; a FIFO queue served one prefill at a time."""

    def __init__(self, name: str, budget_bytes: int, wl: Workload):
        shape = LLAMA_8B_KV
        work = 2 * shape.blocks_for(wl.max_prompt_tokens()) + 2 * wl.docs_per_prompt + 4  # one request's room
        pool = BlockPool(shape, budget_bytes // shape.bytes_per_block + work, torch.device("meta"))
        self.name = name
        self.cache = CacheManager(pool, CacheConfig(budget_bytes=budget_bytes))
        self.planner = LazyStitching(self.cache, NullRunner(), "llama-3.1-8b")
        self.queue: list = []
        self.busy = False

    def keys(self, layout) -> list[str]:
        return [self.planner.chunk_key(layout.encoding_prefix, ids) for ids in layout.chunk_ids]

    def plan_and_release(self, layout) -> tuple[int, int]:
        """Plan the request now, as the replica would when it starts it: its missing chunks are encoded into
        this cache (the stand-in runner counts their tokens). (chunks hit, tokens encoded)."""
        runner = self.planner.runner
        before = runner.tokens_forwarded
        plan = self.planner.plan(layout)
        self.planner.release(plan)
        return plan.chunks_hit, runner.tokens_forwarded - before


def simulate(router_name: str, n: int, wl: Workload, args) -> dict:
    names = [f"r{i}" for i in range(n)]
    router = make_router(router_name, names)
    replicas = {name: SimReplica(name, int(args.budget_gib * GiB), wl) for name in names}
    for name, rep in replicas.items():
        rep.cache.subscribe(router.replicas[name].on_kv_event)
    prompts = Workload(**{**asdict(wl), "requests": args.requests_per_replica * n}).prompts(args.alpha)
    rng = random.Random(wl.seed)
    t, events, seq = 0.0, [], 0
    for i, _layout in enumerate(prompts):
        t += rng.expovariate(args.rate * n)
        heapq.heappush(events, (t, seq, "arrive", i, None))
        seq += 1
    ttft, hits, lookups, encoded_tokens, placed = [], 0, 0, 0, {}
    arrival, routes = {}, {}
    end = 0.0

    def start(rep: SimReplica, now: float):
        nonlocal seq, hits, lookups, encoded_tokens
        i = rep.queue.pop(0)
        layout = prompts[i]
        hit, enc = rep.plan_and_release(layout)
        hits += hit
        lookups += len(layout.chunk_ids)
        encoded_tokens += enc
        rep.busy = True
        service = args.hit_ms / 1e3 + enc * args.miss_us_per_token / 1e6
        heapq.heappush(events, (now + service, seq, "done", i, rep.name))
        seq += 1

    while events:
        now, _, kind, i, name = heapq.heappop(events)
        if kind == "arrive":
            keys = replicas["r0"].keys(prompts[i])
            route = router.start(keys)
            name, routes[i] = route.replica, route
            placed[i], arrival[i] = name, now
            rep = replicas[name]
            rep.queue.append(i)
            if not rep.busy:
                start(rep, now)
        else:
            rep = replicas[name]
            ttft.append(now - arrival[i])
            router.finish(routes[i])
            rep.busy = False
            end = now
            if rep.queue:
                start(rep, now)
    ttft.sort()
    per_replica = [sum(1 for r in placed.values() if r == name) for name in names]
    return {
        "router": router_name,
        "replicas": n,
        "requests": len(prompts),
        "rate_per_replica": args.rate,
        "chunk_hit_rate": hits / lookups,
        "encoded_tokens_per_request": encoded_tokens / len(prompts),
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * ttft[int(0.99 * (len(ttft) - 1))],
        "throughput_rps": len(prompts) / end,
        "busiest_replica_share": max(per_replica) / len(prompts),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    ap.add_argument("--budget-gib", type=float, default=4.0, help="each replica's cache budget (4 GiB: 16 documents)")
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals, requests/s per replica")
    ap.add_argument("--requests-per-replica", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=2.1, help="Zipf exponent of document popularity")
    ap.add_argument("--hit-ms", type=float, default=5.48, help="a request's time with every document cached")
    ap.add_argument("--miss-us-per-token", type=float, default=25.4, help="encode time per missed chunk token")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "routing_sim.json")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    wl = Workload()
    rows = []
    print(
        f"{'replicas':>8} {'router':<15}{'hit rate':>9}{'enc tok/req':>12}{'TTFT p50':>10}{'p99 ms':>9}"
        f"{'req/s':>8}{'busiest':>9}"
    )
    for n in args.replicas:
        for name in args.routers:
            r = simulate(name, n, wl, args)
            rows.append(r)
            print(
                f"{n:>8} {name:<15}{r['chunk_hit_rate']:>9.1%}{r['encoded_tokens_per_request']:>12.0f}"
                f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>9.1f}{r['throughput_rps']:>8.1f}"
                f"{r['busiest_replica_share']:>9.1%}",
                flush=True,
            )
    for n in args.replicas:
        by = {r["router"]: r for r in rows if r["replicas"] == n}
        if "chunk_affinity" in by and "round_robin" in by:
            a, b = by["chunk_affinity"], by["round_robin"]
            print(
                f"{n:>3} replicas: affinity / round robin  TTFT p50 {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x, "
                f"p99 {a['ttft_p99_ms'] / b['ttft_p99_ms']:.2f}x, "
                f"hit rate {a['chunk_hit_rate']:.1%} vs {b['chunk_hit_rate']:.1%}"
            )
    meta = {
        "workload": asdict(wl),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": "python benchmarks/routing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"), args)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({meta['seconds']} s)")
    return 0


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for j, name in enumerate(args.routers):
        mine = sorted((r for r in rows if r["router"] == name), key=lambda r: r["replicas"])
        xs, color = [r["replicas"] for r in mine], f"C{j}"
        axes[0].plot(xs, [100 * r["chunk_hit_rate"] for r in mine], marker="o", color=color, label=name)
        axes[1].plot(xs, [r["ttft_p50_ms"] for r in mine], marker="o", color=color, label=f"{name} p50")
        axes[1].plot(xs, [r["ttft_p99_ms"] for r in mine], marker="x", linestyle="--", color=color, label=f"{name} p99")
        axes[2].plot(xs, [r["encoded_tokens_per_request"] for r in mine], marker="o", color=color, label=name)
    for ax, title in zip(axes, ("chunk hit rate (%)", "TTFT (ms)", "chunk tokens encoded per request")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title, fontsize=9)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6)
    fig.suptitle(
        f"routing, simulated: Zipf {args.alpha} over 100 docs x 2048 tokens, {args.budget_gib:g} GiB KV a "
        f"replica, {args.rate:g} req/s a replica (real cache manager, modelled H200 time)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
