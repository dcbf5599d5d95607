"""The pieces of one e2e step (benchmarks/e2e_gpu.py) timed alone, replayed from CUDA graphs:

* lazy prefill (64 new tokens over 5 x 512 cached docs + a 32-token prefix, batch 1) and lazy
  decode (batch 1, same context) for each split count and kernel config, with the block table
  padded to the width the engine's CUDA graphs use (a power of two >= 64 blocks);
* the layer GEMMs of Llama-3.1-8B at M = 1 and M = 64 under cuBLAS and cuBLASLt.

    python benchmarks/e2e_sweep.py --out $OUT/e2e_sweep.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HQ, HKV, D, BS = 32, 8, 128, 16
DT = torch.bfloat16


def graph_us(fn, reps: int = 200) -> float:
    """Device time per call (µs): ``reps`` calls captured in one graph, replayed, median of 5."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(out)[2]


def layout(dev, width: int):
    """The e2e prompt's context: a 32-token prefix and 5 documents of 512 tokens at shuffled blocks."""
    from lazyrag.kernels.common import pack_block_meta

    lens, starts = [32] + [512] * 5, [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    nblk = sum(-(-n // BS) for n in lens)
    perm = torch.randperm(nblk + 8)
    ids, dl, vl, p = [], [], [], 0
    for n, s in zip(lens, starts):
        nb = -(-n // BS)
        ids += perm[p: p + nb].tolist()
        p += nb
        dl += [s - (32 if s else 0)] * nb  # documents were encoded after the prefix
        vl += [BS] * (nb - 1) + [n - (nb - 1) * BS]
    return ids, dl, vl, nblk, perm[p:].tolist()


def attention(dev, res):
    from lazyrag.kernels import decode as dec
    from lazyrag.kernels import prefill as pre
    from lazyrag.kernels.common import pack_block_meta
    from lazyrag.kernels.reference import rope_tables

    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    cos, sin = (t.to(dev) for t in rope_tables(inv, 1 << 15))
    ids, dl, vl, nctx, own = layout(dev, 256)  # noqa: F841
    total = nctx + 8
    k = torch.randn(total, BS, HKV, D, device=dev, dtype=DT)
    v = torch.randn(total, BS, HKV, D, device=dev, dtype=DT)
    width = 256  # the engine's graph bucket for 166-170 blocks
    meta = torch.zeros(1, width, dtype=torch.int64)
    meta[0, :nctx] = pack_block_meta(torch.tensor(ids), torch.tensor(dl), torch.tensor(vl))
    meta = meta.to(dev)
    n = torch.tensor([nctx], dtype=torch.int32, device=dev)
    T = 64
    q = torch.randn(T, HQ, D, device=dev, dtype=DT)
    kn, vn = torch.randn(T, HKV, D, device=dev, dtype=DT), torch.randn(T, HKV, D, device=dev, dtype=DT)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    rows = []
    for cfg in [pre.DEFAULT_CONFIG, (64, 128, 4, 3), (64, 64, 4, 3)]:
        for splits in (1, 2, 4, 8, 12):
            def f(cfg=cfg, splits=splits):
                pre.lazy_prefill(q, kn, vn, cu, k, v, meta, n, cos, sin, D ** -0.5, max_seqlen_q=T, config=cfg,
                                 num_splits=splits, tile_cache={})
            try:
                rows.append({"config": list(cfg), "splits": splits, "us": round(graph_us(f), 2)})
            except Exception as e:  # e.g. out of shared memory
                rows.append({"config": list(cfg), "splits": splits, "error": repr(e)[:120]})
            print("prefill", rows[-1], flush=True)

    def auto():
        pre.lazy_prefill(q, kn, vn, cu, k, v, meta, n, cos, sin, D ** -0.5, max_seqlen_q=T, tile_cache={})
    res["prefill_auto_us"] = round(graph_us(auto), 2)
    res["prefill"] = rows
    print("prefill auto", res["prefill_auto_us"], flush=True)

    qd = torch.randn(1, HQ, D, device=dev, dtype=DT)
    nd = torch.tensor([nctx + 1], dtype=torch.int32, device=dev)
    rows = []
    for cfg in [dec.DEFAULT_CONFIG]:
        for splits in (1, 4, 8, 16, 32):
            def f(cfg=cfg, splits=splits):
                dec.lazy_decode(qd, k, v, meta, nd, cos, sin, D ** -0.5, config=cfg, num_splits=splits, tile_cache={})
            try:
                rows.append({"config": list(cfg), "splits": splits, "us": round(graph_us(f), 2)})
            except Exception as e:
                rows.append({"config": list(cfg), "splits": splits, "error": repr(e)[:120]})
            print("decode", rows[-1], flush=True)

    def dauto():
        dec.lazy_decode(qd, k, v, meta, nd, cos, sin, D ** -0.5, tile_cache={})
    res["decode_auto_us"] = round(graph_us(dauto), 2)
    res["decode"] = rows
    print("decode auto", res["decode_auto_us"], flush=True)


def gemms(dev, res):
    import torch.nn.functional as F

    shapes = {"wqkv": (6144, 4096), "wo": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    ws = {k: torch.randn(*s, device=dev, dtype=DT) * 0.02 for k, s in shapes.items()}
    out = {}
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except Exception as e:
            out[lib] = repr(e)
            continue
        for m in (1, 64):
            for name, w in ws.items():
                x = torch.randn(m, w.shape[1], device=dev, dtype=DT)
                us = graph_us(lambda: F.linear(x, w), reps=50)
                tb = w.numel() * 2 / us / 1e6
                out[f"{lib} M={m} {name}"] = (round(us, 1), round(tb, 2))
                print(f"gemm {lib} M={m} {name}: {us:.1f} us, {tb:.2f} TB/s", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    # one layer's four GEMMs x 32 + lm_head at M=1 (decode) and M=64 (the TTFT prefill; lm_head at M=1)
    for lib in ("cublas", "cublaslt"):
        if not isinstance(out.get(f"{lib} M=1 wqkv"), tuple):
            continue
        for m in (1, 64):
            layer = sum(out[f"{lib} M={m} {n}"][0] for n in ("wqkv", "wo", "gate_up", "down"))
            out[f"{lib} M={m} model_ms"] = round((32 * layer + out[f"{lib} M=1 lm_head"][0]) / 1e3, 3)
            print(f"{lib} M={m}: 32 layers + lm_head {out[f'{lib} M={m} model_ms']} ms", flush=True)
    res["gemm"] = out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_sweep.json"))
    ap.add_argument("--skip-gemm", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv)}
    try:
        attention(dev, res)
    except Exception as e:
        import traceback

        traceback.print_exc()
        res["attention_error"] = repr(e)
    if not args.skip_gemm:
        gemms(dev, res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
