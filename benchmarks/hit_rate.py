"""Cache hit rate of prefix / position-aware / lazy caching under one KV budget, per eviction policy.

Drives the real code: ``CacheManager`` (budget, eviction policies, admission) and each
strategy's ``plan``/``finish`` (so the keys, the copies and the prefix hash chains are
exactly the engine's). Only the model is left out: a no-op runner stands in for it and the
block pool lives on the ``meta`` device, so Llama-3.1-8B-sized budgets cost no memory.

Workload (the paper's): 100 documents x 2048 tokens, 5 distinct documents per prompt drawn
by Zipf(alpha) popularity (or uniformly), 200 requests one after another, a 32-token
system prefix and a 32-token question. KV: Llama-3.1-8B bf16, 32 layers x 8 KV heads x 128
= 128 KiB per token, blocks of 16 tokens.

Budget: bytes of cached KV (``CacheConfig.budget_bytes``). The pool itself is larger by one
request's working set, as in the paper, where the budget bounds the cache, not the batch.

Hit rate:
* chunk hit rate = chunk lookups served from cache / chunk lookups (for prefix caching, a
  chunk counts as hit when all of its tokens lie in the reused prefix; for position-aware
  caching, when the copy at the needed position was cached);
* token hit rate = chunk tokens whose KV came from cache / chunk tokens (prefix caching
  gets credit for a partly reused chunk).

    python benchmarks/hit_rate.py                       # full sweep -> benchmarks/results/hit_rate.{json,png}
    python benchmarks/hit_rate.py --budgets 1 --requests 50   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lazyrag.engine.reuse import LazyStitching, PositionAware, PrefixCaching, RerotatingPositionAware  # noqa: E402
from lazyrag.engine.runner import SeqState  # noqa: E402
from lazyrag.kv.block_pool import BlockPool, KVShape  # noqa: E402
from lazyrag.kv.cache import CacheConfig, CacheManager  # noqa: E402
from lazyrag.prompt import PromptLayout  # noqa: E402

LLAMA_8B_KV = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
STRATEGIES = {s.name: s for s in (PrefixCaching, PositionAware, RerotatingPositionAware, LazyStitching)}
POLICIES = [("lru", False), ("lfu", False), ("gdsf", False), ("lru", True), ("gdsf", True)]
GiB = 1 << 30


class NullRunner:
    """Stands in for the model: advances the sequences, computes nothing."""

    def __init__(self):
        self.tokens_forwarded = 0

    def prefill(self, seqs, new_ids, logits=True):
        for s, ids in zip(seqs, new_ids):
            s.num_written += len(ids)
            s.next_pos += len(ids)
            self.tokens_forwarded += len(ids)

    def copy_rotated(self, src, dst_blocks, delta):
        pass


@dataclass
class Workload:
    num_docs: int = 100
    doc_tokens: int = 2048
    docs_per_prompt: int = 5
    requests: int = 200
    prefix_tokens: int = 32
    question_tokens: int = 32
    output_tokens: int = 16
    seed: int = 0
    vocab_size: int | None = None  # real token ids for a model (random, < vocab_size); None = distinct ids, no model

    def prompts(self, alpha: float | None) -> list[PromptLayout]:
        """``alpha`` None = uniform popularity; otherwise Zipf: weight of the i-th doc ~ 1 / i^alpha."""
        rng = random.Random(self.seed)
        if self.vocab_size is None:
            docs = [[100_000 + d * self.doc_tokens + i for i in range(self.doc_tokens)] for d in range(self.num_docs)]
        else:
            text = random.Random(self.seed + 1)  # its own stream: the same documents are picked either way
            docs = [[text.randrange(self.vocab_size) for _ in range(self.doc_tokens)] for _ in range(self.num_docs)]
        weights = [1.0] * self.num_docs if alpha is None else [1.0 / (i + 1) ** alpha for i in range(self.num_docs)]
        prefix = list(range(1, 1 + self.prefix_tokens))
        out = []
        for r in range(self.requests):
            picked: list[int] = []
            while len(picked) < self.docs_per_prompt:  # distinct docs, popularity-weighted
                d = rng.choices(range(self.num_docs), weights)[0]
                if d not in picked:
                    picked.append(d)
            question = (
                [50_000 + r * self.question_tokens + i for i in range(self.question_tokens)]
                if self.vocab_size is None
                else [text.randrange(self.vocab_size) for _ in range(self.question_tokens)]
            )
            out.append(PromptLayout(prefix, [docs[d] for d in picked], question))
        return out

    def max_prompt_tokens(self) -> int:
        return self.prefix_tokens + self.docs_per_prompt * self.doc_tokens + self.question_tokens + self.output_tokens


def run_one(
    strategy: str, prompts: list[PromptLayout], budget_bytes: int, policy: str, admission: bool, wl: Workload
) -> dict:
    shape = LLAMA_8B_KV
    # Working room: a prefix-caching request holds its whole prompt; a position-aware one the
    # base chunks and their copies: twice a prompt covers both, on top of the cache budget.
    work_blocks = 2 * shape.blocks_for(wl.max_prompt_tokens()) + 2 * wl.docs_per_prompt + 4
    pool = BlockPool(shape, budget_bytes // shape.bytes_per_block + work_blocks, torch.device("meta"))
    cache = CacheManager(pool, CacheConfig(policy=policy, admission=admission, budget_bytes=budget_bytes))
    strat = STRATEGIES[strategy](cache, NullRunner(), "llama-3.1-8b")
    hit = total = hit_tokens = total_tokens = 0
    for layout in prompts:
        plan = strat.plan(layout)
        # The scheduler's request lifecycle (Scheduler._plan, _prefill, _release), minus the model.
        seq = SeqState(
            context=plan.context,
            blocks=cache.allocate(shape.blocks_for(len(plan.new_ids) + wl.output_tokens)),
            next_pos=plan.new_start,
        )
        strat.runner.prefill([seq], [plan.new_ids])
        strat.finish(plan, seq)
        pool.decref(seq.blocks)
        strat.release(plan)
        assert cache.cached_bytes <= budget_bytes, "budget exceeded"
        n_chunk_tokens = sum(map(len, layout.chunk_ids))
        hit += plan.chunks_hit
        total += len(layout.chunk_ids)
        total_tokens += n_chunk_tokens
        if strategy == "prefix":
            hit_tokens += min(max(0, plan.tokens_context - len(layout.prefix_ids)), n_chunk_tokens)
        else:
            hit_tokens += plan.chunks_hit * wl.doc_tokens
    assert pool.num_free + cache.cached_blocks == pool.num_blocks, "leaked blocks"
    return {
        "strategy": strategy,
        "policy": policy + ("+admit" if admission else ""),
        "budget_gb": budget_bytes / GiB,
        "chunk_hit_rate": hit / total,
        "token_hit_rate": hit_tokens / total_tokens,
        "evictions": cache.stats.evictions,
        "rejected": cache.stats.rejected,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 1, 2, 4, 8], help="cache budgets in GiB")
    ap.add_argument("--alpha", type=float, default=2.1, help="Zipf exponent of document popularity")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3, help="workloads averaged (seed 0, 1, ...)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    rows = []
    for dist, alpha in (("zipf", args.alpha), ("uniform", None)):
        workloads = [Workload(requests=args.requests, seed=s) for s in range(args.seeds)]
        prompts = [wl.prompts(alpha) for wl in workloads]
        for budget in args.budgets:
            for strategy in STRATEGIES:
                for policy, admission in POLICIES:
                    runs = [
                        run_one(strategy, p, int(budget * GiB), policy, admission, wl)
                        for wl, p in zip(workloads, prompts)
                    ]
                    row = dict(runs[0], distribution=dist)
                    for k in ("chunk_hit_rate", "token_hit_rate", "evictions", "rejected"):
                        row[k] = sum(r[k] for r in runs) / len(runs)
                    rows.append(row)
    elapsed = time.perf_counter() - t0
    print_table(rows, args.budgets)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "workload": asdict(Workload(requests=args.requests)),
        "alpha": args.alpha,
        "seeds": args.seeds,
        "kv_bytes_per_token": LLAMA_8B_KV.bytes_per_block // LLAMA_8B_KV.block_size,
        "block_size": LLAMA_8B_KV.block_size,
        "command": "python benchmarks/hit_rate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(elapsed, 1),
    }
    (args.out / "hit_rate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / "hit_rate.png", args.alpha)
    print(f"\nwrote {args.out / 'hit_rate.json'} and hit_rate.png ({elapsed:.0f} s)")
    return 0


def print_table(rows: list[dict], budgets: list[float]) -> None:
    for dist in ("zipf", "uniform"):
        print(f"\nchunk hit rate, {dist} popularity (token hit rate in brackets where it differs)")
        print(f"{'strategy':<25}{'policy':<11}" + "".join(f"{b:>14g} GB" for b in budgets))
        keys = sorted({(r["strategy"], r["policy"]) for r in rows}, key=lambda k: (list(STRATEGIES).index(k[0]), k[1]))
        for s, p in keys:
            cells = []
            for b in budgets:
                r = next(
                    r
                    for r in rows
                    if r["distribution"] == dist and r["strategy"] == s and r["policy"] == p and r["budget_gb"] == b
                )
                c, t = 100 * r["chunk_hit_rate"], 100 * r["token_hit_rate"]
                cells.append(f"{c:6.1f}%" + (f" [{t:4.1f}]" if abs(c - t) > 0.05 else " " * 7))
            print(f"{s:<25}{p:<11}" + "".join(f"{x:>17}" for x in cells))


def plot(rows: list[dict], path: Path, alpha: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = sorted({r["policy"] for r in rows})
    fig, axes = plt.subplots(2, len(STRATEGIES), figsize=(4.6 * len(STRATEGIES), 7.5), sharex=True, sharey="row")
    for i, dist in enumerate(("zipf", "uniform")):
        for j, strategy in enumerate(STRATEGIES):
            ax = axes[i, j]
            for p in policies:
                pts = sorted(
                    (r["budget_gb"], 100 * r["chunk_hit_rate"])
                    for r in rows
                    if r["distribution"] == dist and r["strategy"] == strategy and r["policy"] == p
                )
                ax.plot(*zip(*pts), marker="o", label=p)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{strategy}, {'Zipf a=%g' % alpha if dist == 'zipf' else 'uniform'}")
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("chunk hit rate (%)")
            if i == 1:
                ax.set_xlabel("KV cache budget (GiB, Llama-3.1-8B KV)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Hit rate vs budget: 100 docs x 2048 tokens, 5 per prompt, 200 requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
