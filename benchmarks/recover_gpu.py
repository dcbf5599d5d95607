"""What the quality recovery costs on one GPU: TTFT of ``lazy+recover`` beside ``lazy`` and ``full`` at Llama-3.1-8B
shapes (random bf16 weights; speed does not depend on the values), documents cached, each request a new order.

    python benchmarks/recover_gpu.py --docs 5,40 --out benchmarks/results/recover_h100.json [--profile]

Sizes: 32 prefix tokens, DOCS documents of 512 tokens, a 64-token question (5 -> 2,656 tokens, 40 -> 20,576).
Prints a table (median ms, ratio to full) and writes JSON; ``--profile`` adds each size's top GPU kernels and host
ops of one ``lazy+recover`` request. Run the same command with an older tree installed to compare (see
benchmarks/serving_gpu.sh PART=r).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

# the repository's root first; not this folder, whose kernels.py would shadow the 'kernels' that transformers imports
sys.path[0] = str(Path(__file__).resolve().parents[1])

STRATEGIES = ("lazy", "lazy+recover", "full")


def profile_recover(engine, layout, one, top: int = 25) -> dict:
    """GPU kernels and host ops (self time) of one lazy+recover request, top by total."""
    from torch.profiler import ProfilerActivity, profile

    params = replace(one, strategy="lazy+recover")
    engine.submit(layout, params).result()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = engine.submit(layout, params).result()
        torch.cuda.synchronize()
    rows = prof.key_averages()
    gpu = sorted((e for e in rows if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    cpu = sorted(rows, key=lambda e: -e.self_cpu_time_total)
    out = {
        "ttft_ms_under_profiler": 1e3 * r.ttft_s,
        "gpu_ms_total": sum(e.device_time_total for e in gpu) / 1e3,
        "launches": sum(e.count for e in gpu),
        "gpu_top": [(e.key[:90], e.count, round(e.device_time_total / 1e3, 3)) for e in gpu[:top]],
        "host_top": [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in cpu[:top]],
    }
    print(
        f"  profile: TTFT {out['ttft_ms_under_profiler']:.1f} ms under the profiler, {out['gpu_ms_total']:.1f} ms "
        f"of GPU kernels in {out['launches']} launches"
    )
    for k, c, t in out["gpu_top"][:15]:
        print(f"    gpu  {t:9.3f} ms  x{c:<6} {k}")
    for k, c, t in out["host_top"][:12]:
        print(f"    host {t:9.3f} ms  x{c:<6} {k}")
    return out


def sweep_kernels(n_ctx: int = 20576, running: int = 3072, reps: int = 20) -> dict:
    """The recovery's two kernels at Llama-3.1-8B shapes (32 q heads, 8 KV heads, head dim 128): the attention
    of ``running`` sorted queries over prefixes of ``n_ctx`` keys under each launch, and the context gather."""
    import triton.testing

    from lazyrag.kernels.recompute import gather_rotated, prefix_attention
    from lazyrag.kernels.reference import rope_tables

    g = torch.Generator().manual_seed(0)
    q = torch.randn(running, 32, 128, generator=g).cuda().bfloat16()
    k, v = (torch.randn(n_ctx, 8, 128, generator=g).cuda().bfloat16() for _ in range(2))
    limit = torch.randperm(n_ctx, generator=g)[:running].sort().values.cuda() + 1
    flops = 4 * float(limit.sum()) * 32 * 128
    out = {"attention": [], "gather": None}
    for block_n in (64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                try:
                    ms = triton.testing.do_bench(
                        lambda block_n=block_n, warps=warps, stages=stages: prefix_attention(
                            q, k, v, limit, 128**-0.5, block_n, warps, stages
                        ),
                        rep=reps * 10,
                    )
                except Exception as e:  # e.g. out of shared memory
                    print(f"  attention block_n={block_n} warps={warps} stages={stages}: {type(e).__name__}")
                    continue
                out["attention"].append(
                    {"block_n": block_n, "num_warps": warps, "num_stages": stages, "ms": ms, "tflops": flops / ms / 1e9}
                )
                print(
                    f"  attention block_n={block_n:3d} warps={warps} stages={stages}: {ms:.3f} ms "
                    f"({flops / ms / 1e9:.0f} TFLOP/s)",
                    flush=True,
                )
    pool_k, pool_v = (torch.randn(2 * n_ctx, 8, 128, generator=g).cuda().bfloat16() for _ in range(2))
    cos, sin = (t.cuda() for t in rope_tables(1.0 / 500000 ** (torch.arange(0, 128, 2) / 128), 1 << 17))
    slots = torch.randperm(2 * n_ctx, generator=g)[:n_ctx].cuda()
    delta = torch.randint(0, 1 << 16, (n_ctx,), generator=g).cuda()
    ms = triton.testing.do_bench(lambda: gather_rotated(pool_k, pool_v, slots, delta, cos, sin), rep=reps * 10)
    moved = 4 * n_ctx * 8 * 128 * 2  # K and V read and written
    out["gather"] = {"ms": ms, "gb_per_s": moved / ms / 1e6}
    print(f"  gather of {n_ctx} tokens: {ms:.3f} ms ({moved / ms / 1e6:.0f} GB/s)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default="5,40", help="document counts, comma-separated (512 tokens each)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--label", default="", help="a name for this tree in the JSON (e.g. old, new)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="first time the recovery's kernels alone, under each launch")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/recover_gpu.json"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    from transformers import LlamaForCausalLM

    from benchmarks.e2e_gpu import llama31_8b_config
    from lazyrag.engine import LazyEngine, SamplingParams
    from lazyrag.prompt import PromptLayout

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(llama31_8b_config(args.layers)).eval()
    torch.set_default_dtype(torch.float32)
    engine = LazyEngine.from_hf(hf, None, device="cuda", dtype=torch.bfloat16, kv_budget=8 << 30)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 120000) for _ in range(n)]  # noqa: E731
    one = SamplingParams(max_new_tokens=1)
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "label": args.label,
        "command": "python " + " ".join(sys.argv),
        "sizes": {},
    }
    if args.sweep:
        res["kernels"] = sweep_kernels()
    for n_docs in (int(d) for d in args.docs.split(",")):
        prefix, docs, question = ids(32), [ids(512) for _ in range(n_docs)], ids(64)
        layout = PromptLayout(prefix, docs, question)
        engine.submit(layout, one).result()  # the documents encoded and cached
        ttft, recomputed = {s: [] for s in STRATEGIES}, []
        for strategy in STRATEGIES:
            for i in range(args.reps + 2):
                order = docs[:]
                rng.shuffle(order)
                r = engine.submit(PromptLayout(prefix, order, question), replace(one, strategy=strategy)).result()
                assert r.stats.chunks_missed == 0 or strategy == "full", r.stats
                if i >= 2:
                    ttft[strategy].append(1e3 * r.ttft_s)
                    if strategy == "lazy+recover":
                        recomputed.append(r.stats.tokens_recomputed)
        med = {s: statistics.median(v) for s, v in ttft.items()}
        size = {
            "prompt_tokens": layout.num_tokens,
            "ttft_ms": med,
            "ttft_ms_all": ttft,
            "recover_over_full": med["lazy+recover"] / med["full"],
            "tokens_recomputed": statistics.median(recomputed),
        }
        print(
            f"{args.label or 'tree'} {layout.num_tokens:>6} tokens: "
            + "  ".join(f"{s} {m:8.1f} ms" for s, m in med.items())
            + f"  recover/full {size['recover_over_full']:.2f}x  ({size['tokens_recomputed']:.0f} tokens recomputed)",
            flush=True,
        )
        if args.profile:
            size["profile"] = profile_recover(engine, layout, one)
        res["sizes"][str(layout.num_tokens)] = size
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
