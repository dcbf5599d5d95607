"""The split merge (``kvloop.merge_splits``) alone: rows per program x warps, on the shapes the engine
launches (the TTFT prefill: 64 tokens x 32 heads x 8 splits; decode at batch 1, 8 and 32), checked against
a float64 reference on fresh random partials and timed from CUDA graphs of 32 merges (as in a forward
pass: one per layer, partials fresh in L2).

    python benchmarks/split_merge.py [--out PATH]

Prints a table (µs per merge, ratio to the current default) and writes JSON (default
benchmarks/results/split_merge.json, or $OUT/split_merge.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

from lazyrag.kernels import kvloop

LAYERS = 32
# (label, rows r0, heads, splits): prefill rows are tokens, decode rows sequences
SHAPES = [("prefill TTFT, 64 tokens", 64, 32, 8), ("prefill, 64 tokens, 16 splits", 64, 32, 16),
          ("decode B=1, 8k", 1, 32, 48), ("decode B=8, 8k", 8, 32, 8), ("decode B=32, 8k", 32, 32, 2)]
VARIANTS = [(1, 4), (1, 2), (1, 1), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8)]  # (rows per program, warps)


def reference(acc, ml):
    m, l = ml[..., 0].double(), ml[..., 1].double()
    w = torch.exp2(m - m.max(-1, keepdim=True).values)
    return (acc.double() * w[..., None]).sum(-2) / (l * w).sum(-1)[..., None]


def main():
    ap = argparse.ArgumentParser()
    default_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    ap.add_argument("--out", default=os.path.join(default_dir, "split_merge.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    print(f"{'shape':<32} {'rows':>4} {'warps':>5} {'us':>7} {'x default':>9} {'err':>8}")
    for label, r0, hq, splits in SHAPES:
        # LAYERS independent partial sets, as a forward's layers would leave them
        accs = [torch.randn(r0, hq, splits, 128, device=dev) for _ in range(LAYERS)]
        mls = [torch.stack((torch.randn(r0, hq, splits, device=dev) * 4, torch.rand(r0, hq, splits, device=dev) + 0.5),
                           -1) for _ in range(LAYERS)]
        outs = [torch.empty(r0, hq, 128, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        ref = reference(accs[0], mls[0])
        graphs, results = [], []
        for rows, warps in VARIANTS:
            outs[0].fill_(float("nan"))
            kvloop.merge_splits(accs[0], mls[0], outs[0], splits, rows=rows, num_warps=warps)
            err = float((outs[0].double() - ref).norm() / ref.norm())
            assert err < 1e-2 and not outs[0].isnan().any(), (label, rows, warps, err)

            def run(rows=rows, warps=warps):
                for acc, ml, o in zip(accs, mls, outs):
                    kvloop.merge_splits(acc, ml, o, splits, rows=rows, num_warps=warps)
            run()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            graphs.append(g)
            results.append(dict(shape=label, r0=r0, heads=hq, splits=splits, rows=rows, warps=warps, err=err, us=[]))
        for _ in range(5):  # alternating rounds
            for g, res in zip(graphs, results):
                res["us"].append(1e3 * triton.testing.do_bench(g.replay, warmup=5, rep=30, return_mode="median") / LAYERS)
        base = statistics.median(results[0]["us"])
        for res in results:
            res["us_median"] = statistics.median(res["us"])
            res["ratio"] = res["us_median"] / base
            print(f"{label:<32} {res['rows']:>4} {res['warps']:>5} {res['us_median']:7.2f} {res['ratio']:9.3f} "
                  f"{res['err']:8.1e}")
        rows_out += results
        del graphs
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), command="python " + " ".join(sys.argv),
                       default=[kvloop.MERGE_ROWS, kvloop.MERGE_WARPS], results=rows_out), f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
