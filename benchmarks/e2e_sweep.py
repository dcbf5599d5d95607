"""The pieces of one e2e step (benchmarks/e2e_gpu.py) timed alone, replayed from CUDA graphs:

* lazy prefill (64 new tokens over 5 x 512 cached docs + a 32-token prefix, batch 1) and lazy
  decode (batch 1, same context) for each split count and kernel config, with the block table
  padded to the width the engine's CUDA graphs use (a power of two >= 64 blocks);
* the layer GEMMs of Llama-3.1-8B at M = 1 and M = 64 under cuBLAS and cuBLASLt, cycling through copies
  of each weight so that it is read from HBM (not L2), as in the real model;
* each decode projection at M = 1 as the engine runs it (elementwise kernel + cuBLAS) against the fused
  Triton GEMVs of kernels/gemv.py, every candidate config; the fastest per shape lands in ``gemv_adopt``.
* each layer projection at M = 64 under cuBLAS against the skinny Triton GEMM of kernels/gemm.py, every
  candidate config; the fastest per shape, where it beats cuBLAS, lands in ``skinny_adopt`` (``--only skinny``).

    python benchmarks/e2e_sweep.py --out $OUT/e2e_sweep.json
"""
from __future__ import annotations

import argparse
import json
import math
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


def timed_row(label: str, fn, **row) -> dict:
    """``row`` with ``fn``'s graph-replayed µs (or the error, e.g. out of shared memory for a tile shape)."""
    try:
        row["us"] = round(graph_us(fn), 2)
    except Exception as e:
        row["error"] = repr(e)[:120]
    print(label, row, flush=True)
    return row


def keep_best(res: dict, label: str, rows: list[dict]) -> None:
    ok = [r for r in rows if "us" in r]
    if ok:
        res[f"{label}_best"] = min(ok, key=lambda r: r["us"])
        print(f"{label} best", res[f"{label}_best"], flush=True)


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
    # round 5 timed two configs with 1-8 splits (and the in-kernel merge: slower); round 6 widens the configs,
    # the split counts and the rotation schedule (ROT 3: rotate once per document, then the plain loop)
    variants = [(cfg, splits, False, rot) for cfg in [pre.DEFAULT_CONFIG, (64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                                                       (128, 128, 8, 3), (64, 128, 4, 2), (128, 64, 4, 3)]
                for splits in (4, 8, 12, 16) for rot in (2, 3)]
    for cfg, splits, merge, rot in variants:
        def f(cfg=cfg, splits=splits, merge=merge, rot=rot):
            pre.lazy_prefill(q, kn, vn, cu, k, v, meta, n, cos, sin, D ** -0.5, max_seqlen_q=T, config=cfg,
                             num_splits=splits, tile_cache={}, fused_merge=merge, rotation_mode=rot)
        rows.append(timed_row("prefill", f, config=list(cfg), splits=splits, fused_merge=merge, rotation_mode=rot))
    keep_best(res, "prefill", rows)

    def auto():
        pre.lazy_prefill(q, kn, vn, cu, k, v, meta, n, cos, sin, D ** -0.5, max_seqlen_q=T, tile_cache={})
    res["prefill_auto_us"] = round(graph_us(auto), 2)
    res["prefill"] = rows
    print("prefill auto", res["prefill_auto_us"], flush=True)

    qd = torch.randn(1, HQ, D, device=dev, dtype=DT)
    nd = torch.tensor([nctx + 1], dtype=torch.int32, device=dev)
    rows = []
    # round 5: the default config, 1-32 splits, merge in or out of the kernel (in: slower); round 6: configs x
    # splits x rotation schedule (ROT 2: flat loop, q re-rotated when the delta changes; ROT 3: per document)
    for cfg in [dec.DEFAULT_CONFIG, (64, 4, 4, 128), (64, 2, 3, None), (32, 4, 3, None), (128, 4, 3, 128)]:
        for splits in (8, 16, 24, 32):
            for rot in (2, 3):
                def f(cfg=cfg, splits=splits, rot=rot):
                    dec.lazy_decode(qd, k, v, meta, nd, cos, sin, D ** -0.5, config=cfg, num_splits=splits,
                                    tile_cache={}, rotation_mode=rot)
                rows.append(timed_row("decode", f, config=list(cfg), splits=splits, rotation_mode=rot))
    keep_best(res, "decode", rows)

    def dauto():
        dec.lazy_decode(qd, k, v, meta, nd, cos, sin, D ** -0.5, tile_cache={})
    res["decode_auto_us"] = round(graph_us(dauto), 2)
    res["decode"] = rows
    print("decode auto", res["decode_auto_us"], flush=True)


SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def weight_copies(dev, n: int, k: int, total_bytes: float = 6e8) -> list[torch.Tensor]:
    """Distinct copies of one weight shape, cycled through in a timed graph: together they are well over
    the 50 MB L2 (wo alone, 33.5 MB, fits in it), so each call reads HBM as a layer of the real model does."""
    copies = max(2, min(16, int(total_bytes // (n * k * 2)) + 1))
    return [torch.randn(n, k, device=dev, dtype=DT) * k ** -0.5 for _ in range(copies)]


def per_weight_us(fn, ws) -> float:
    """µs per call of ``fn(w)``, each weight of ``ws`` once per pass, passes replayed from a graph."""
    return graph_us(lambda: [fn(w) for w in ws], reps=4) / len(ws)


def gemms(dev, res):
    import torch.nn.functional as F

    from lazyrag.engine.runner import blas_library

    out = {}
    for lib in ("cublas", "cublaslt"):
        try:
            with blas_library(lib):
                for name, (n, k) in SHAPES.items():
                    ws = weight_copies(dev, n, k)
                    for m in (1, 64):
                        x = torch.randn(m, k, device=dev, dtype=DT)
                        us = per_weight_us(lambda w: F.linear(x, w), ws)
                        out[f"{lib} M={m} {name}"] = (round(us, 1), tbps(n, k, us))
                        print(f"gemm {lib} M={m} {name}: {us:.1f} us, {tbps(n, k, us)} TB/s", flush=True)
                    del ws
        except Exception as e:  # e.g. a torch built without cuBLASLt
            out[lib] = repr(e)
    # one layer's four GEMMs x 32 + lm_head at M=1 (decode) and M=64 (the TTFT prefill; lm_head at M=1)
    for lib in ("cublas", "cublaslt"):
        if not isinstance(out.get(f"{lib} M=1 wqkv"), tuple):
            continue
        for m in (1, 64):
            layer = sum(out[f"{lib} M={m} {n}"][0] for n in ("wqkv", "wo", "gate_up", "down"))
            out[f"{lib} M={m} model_ms"] = round((32 * layer + out[f"{lib} M=1 lm_head"][0]) / 1e3, 3)
            print(f"{lib} M={m}: 32 layers + lm_head {out[f'{lib} M={m} model_ms']} ms", flush=True)
    res["gemm"] = out


def tbps(n: int, k: int, us: float) -> float:
    """TB/s of a bf16 weight [N, K] read in ``us`` µs (x and y are < 1 % of it)."""
    return round(n * k * 2 / us / 1e6, 2)


def time_candidates(label: str, configs, run, ref: torch.Tensor, ws, n: int, k: int) -> dict:
    """Each config: ``run(w, cfg)``'s output on ``ws[0]`` against ``ref`` first, then (rel err < 1e-2) µs a call
    over the weight copies ``ws``. Returns ``{"candidates": {config: row}}`` and the fastest: best, best_us, best_tbps."""
    rows = {}
    for cfg in configs:
        key = str(list(cfg))
        try:
            err = float((run(ws[0], cfg).float() - ref).norm() / ref.norm())
            us = per_weight_us(lambda w: run(w, cfg), ws) if err < 1e-2 else float("nan")
            rows[key] = {"us": round(us, 2), "tbps": tbps(n, k, us), "rel_err": err}
        except Exception as e:  # e.g. out of shared memory
            rows[key] = {"error": repr(e)[:160]}
        print(f"{label} {cfg}: {rows[key]}", flush=True)
    out = {"candidates": rows}
    ok = {c: v["us"] for c, v in rows.items() if "us" in v and not math.isnan(v["us"])}
    if ok:
        best = min(ok, key=ok.get)
        out.update(best=best, best_us=ok[best], best_tbps=tbps(n, k, ok[best]))
    print(f"{label}: best {out.get('best')} {out.get('best_us')} us ({out.get('best_tbps')} TB/s)", flush=True)
    return out


def one_token(dev, res):
    """Each decode projection at M=1 as the engine runs it: the elementwise kernel before it (compiled, as on
    CUDA) then cuBLAS, against kernels/gemv.py's fused GEMV for every candidate config (each checked against
    the unfused output first). Picks the fastest config per shape: ``res["gemv_adopt"]`` (e2e_gpu.py
    --gemv-configs)."""
    import torch.nn.functional as F

    from lazyrag.kernels import gemv as G
    from lazyrag.model.llama import ElementwiseOps

    ops = ElementwiseOps.compiled()
    eps, rows, adopt = 1e-5, {}, {}
    for name, pro in (("wqkv", G.ADD_NORM), ("wo", G.PLAIN), ("gate_up", G.ADD_NORM), ("down", G.SILU)):
        n, k = SHAPES[name]
        ws = weight_copies(dev, n, k)
        x = torch.randn(1, 2 * k if pro == G.SILU else k, device=dev, dtype=DT)
        r, nw = torch.randn(1, k, device=dev, dtype=DT), (1 + 0.2 * torch.randn(k, device=dev)).to(DT)
        if pro == G.ADD_NORM:
            unfused = lambda w: F.linear(ops.add_rms_norm(x, r, nw, eps)[1], w)  # noqa: E731
        elif pro == G.SILU:
            unfused = lambda w: F.linear(ops.silu_mul(x, k), w)  # noqa: E731
        else:
            unfused = lambda w: F.linear(x, w)  # noqa: E731

        def fused(w, cfg):
            got = G.gemv(x, w, prologue=pro, residual=r, norm_weight=nw, eps=eps, config=cfg)
            return got[1] if pro == G.ADD_NORM else got

        row = {"unfused_us": round(per_weight_us(unfused, ws), 2)}
        print(f"gemv {name}: unfused {row['unfused_us']} us", flush=True)
        # the launch each candidate means at this K (G.resolve): one-shot candidates collapse, each is timed once
        launches = list(dict.fromkeys(G.resolve(cfg, k) for cfg in G.CANDIDATES))
        row.update(time_candidates(f"gemv {name}", launches, fused, unfused(ws[0]).float(), ws, n, k))
        if "best" in row:
            adopt[f"{n},{k},{pro}"] = json.loads(row["best"])
        rows[name] = row
        del ws
    res["gemv"], res["gemv_adopt"] = rows, adopt


def elementwise(dev, res):
    """The norms, silu*up and the greedy argmax as the engine ran them in round 5 (torch.compile, torch's argmax)
    against kernels/elementwise.py, at M = 1 (decode) and M = 64 (the TTFT prefill)."""
    from lazyrag.kernels import elementwise as E
    from lazyrag.model.llama import ElementwiseOps

    c = ElementwiseOps.compiled()
    H, I, V = 4096, 14336, 128256
    out = {}
    for m in (1, 64):
        x, r = torch.randn(m, H, device=dev, dtype=DT), torch.randn(m, H, device=dev, dtype=DT)
        w = torch.randn(H, device=dev, dtype=DT)
        gu = torch.randn(m, 2 * I, device=dev, dtype=DT)
        for name, fc, ft in (("add_rms_norm", lambda: c.add_rms_norm(x, r, w, 1e-5), lambda: E.add_rms_norm(x, r, w, 1e-5)),
                             ("silu_mul", lambda: c.silu_mul(gu, I), lambda: E.silu_mul(gu, I))):
            out[f"{name} M={m}"] = {"compiled_us": round(graph_us(fc), 2), "triton_us": round(graph_us(ft), 2)}
            print(f"elementwise {name} M={m}: {out[f'{name} M={m}']}", flush=True)
    logits = torch.randn(1, V, device=dev)
    for name, fn in (("torch", lambda: logits.argmax(-1).tolist()), ("triton", lambda: E.greedy_tokens(logits).tolist())):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(50):  # eager with the host copy, as the scheduler calls it
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        out[f"argmax B=1 {name}_us"] = round(sorted(times)[25], 2)
    out["argmax B=1 kernel_only_us"] = {"torch": round(graph_us(lambda: logits.argmax(-1)), 2)}
    print(f"elementwise argmax: {out}", flush=True)
    res["elementwise"] = out


def skinny(dev, res):
    """Each layer projection at M = 64 (the TTFT prefill's 64 new tokens) under cuBLAS against kernels/gemm.py's
    skinny GEMM, every candidate config (each checked against F.linear first; rel err < 1e-2). The fastest
    candidate per shape that beats cuBLAS lands in ``res["skinny_adopt"]`` ("N,K,BLOCK_M": config; e2e_gpu.py
    --gemv-configs)."""
    import torch.nn.functional as F

    from lazyrag.kernels import gemm as G

    m, rows, adopt = 64, {}, {}
    for name in ("wqkv", "wo", "gate_up", "down"):
        n, k = SHAPES[name]
        ws = weight_copies(dev, n, k)
        x = torch.randn(m, k, device=dev, dtype=DT)
        us = per_weight_us(lambda w: F.linear(x, w), ws)
        row = {"cublas_us": round(us, 2), "cublas_tbps": tbps(n, k, us)}
        print(f"skinny {name}: cuBLAS {row['cublas_us']} us ({row['cublas_tbps']} TB/s)", flush=True)
        row.update(time_candidates(f"skinny {name}", G.CANDIDATES, lambda w, cfg: G.skinny_linear(x, w, config=cfg),
                                   F.linear(x, ws[0]).float(), ws, n, k))
        if "best" in row and row["best_us"] < row["cublas_us"]:
            adopt[f"{n},{k},{G.block_m(m)}"] = json.loads(row["best"])
        rows[name] = row
        del ws
    res["skinny"], res["skinny_adopt"] = rows, adopt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_sweep.json"))
    ap.add_argument("--only", default="attention,gemm,gemv,elementwise", help="comma list of the sections to run")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv)}
    sections = [("gemv", one_token), ("attention", attention), ("elementwise", elementwise), ("gemm", gemms),
                ("skinny", skinny)]  # the e2e run needs gemv's table first
    for name, fn in sections:
        if name not in args.only.split(","):
            continue
        try:
            fn(dev, res)
        except Exception as e:
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = repr(e)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))  # after each section: a run cut short keeps what it has
    return 0


if __name__ == "__main__":
    sys.exit(main())
