"""Where does the lazy prefill kernel lose to SDPA at full occupancy? A side-by-side of the same work done by

- ``lazy``: ``lazy_prefill`` (paged, shuffled physical blocks, deferred rotation; the engine's kernel),
- ``off``: the same kernel and layout without rotation,
- ``lazy_contig``: ``lazy_prefill`` on a block table whose physical blocks are in order (same kernel, same
  indirection, DRAM/L2 locality of a contiguous cache),
- ``dense sN``: a plain flash-attention kernel in Triton (the fused-attention tutorial's loop, with the same
  packed-GQA rows and 128x128 tiles) over contiguous K/V, with ``N`` pipeline stages: what Triton reaches on this
  GPU when the K/V addresses need no load,
- ``sdpa``: torch SDPA (flash) on a contiguous copy, KV heads repeated,
- ``lazy wgmma (BM, BN, W, S)`` / ``off wgmma ...``: ``lazy_prefill(kernel="wgmma")``, the Gluon kernel
  (kernels/prefill_wgmma.py: two consumer warpgroups and a producer, W = 12), rotation on and off, where the GPU is a
  Hopper. (Its 8-warp build, segment-aligned tiles, no-ping-pong and register-split variants were removed; they are
  at commit 32eec34, NOTES §Kernels, rounds 11-13.)

The dense kernel attends to every key (no causal mask) over ctx + new keys; its FLOPs are counted as such, the
others' with the causal new-token part (``benchmarks/kernels.py``'s count). All timed from CUDA graphs in
alternating rounds. ``--ncu`` instead runs each variant once (for ``ncu --kernel-name regex:...``).

    python benchmarks/prefill_ceiling.py [--batch 8] [--ctx 8192] [--docs 1] [--new 512] [--out PATH] [--ncu]
                                         [--only REGEX]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `kernels` below is benchmarks/kernels.py
from kernels import BS, DT, HKV, HQ, MAX_POS, D, PrefillCase, fmt_info, launch_info, paired_graph_ms  # noqa: E402

from lazyrag.kernels.common import pack_block_meta, unpack_block_meta  # noqa: E402
from lazyrag.kernels.kvloop import load_index  # noqa: E402
from lazyrag.kernels.reference import rope_tables  # noqa: E402


@triton.jit
def _dense_attn_kernel(
    Q,
    K,
    V,
    OUT,
    PAGES,
    qk_scale,
    S,
    stride_qb,
    stride_qt,
    stride_kb,
    stride_ks,
    stride_ob,
    stride_ot,
    NQ,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CARRY_Q: tl.constexpr,
    MASK: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Rows are (query token, q head) pairs of one KV head's group, as in the lazy kernel; K/V contiguous
    [B, S, Hkv, D]; every row attends to all S keys. The tutorial's loop (q loop-invariant, pointers advanced),
    plus what the lazy kernel adds, each on its own switch: CARRY_Q (q loop-carried, as a re-rotated q must
    be), MASK (a per-key validity mask on every tile), GATHER (K/V rows addressed through a block table read
    with kvloop.load_index, blocks in order)."""
    TOK: tl.constexpr = BLOCK_M // G
    tile, kvh, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_r = tl.arange(0, BLOCK_M)
    tok = tile * TOK + offs_r // G
    head = kvh * G + offs_r % G
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = tok < NQ
    q_off = b.to(tl.int64) * stride_qb + tok * stride_qt + head * HEAD_DIM
    q_ptrs = Q + q_off[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(Q.dtype.element_ty)
    kv_base = b.to(tl.int64) * stride_kb + kvh * HEAD_DIM
    k_ptrs = K + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + kv_base + offs_n[:, None] * stride_ks + offs_d[None, :]
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_tiles = S // BLOCK_N
    for t in range(0, n_tiles):
        if CARRY_Q:  # noqa: SIM102  a constexpr `if` (compile time) around a runtime one, as in kernels/*.py
            if t == 0:
                q = (tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale).to(q.dtype)
        keep = offs_n < S - t * BLOCK_N
        if GATHER:
            blk = load_index(
                PAGES + b.to(tl.int64) * (S // BLOCK_SIZE) + t * (BLOCK_N // BLOCK_SIZE) + offs_n // BLOCK_SIZE,
                keep & (t < n_tiles),
                True,
            )  # t < n_tiles: as kvloop's `live`
            rows = blk * BLOCK_SIZE + offs_n % BLOCK_SIZE  # rows of the [B * S] key array
            k = tl.load(K + kvh * HEAD_DIM + rows[:, None] * stride_ks + offs_d[None, :], mask=keep[:, None], other=0.0)
            v = tl.load(V + kvh * HEAD_DIM + rows[:, None] * stride_ks + offs_d[None, :], mask=keep[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k))
        if MASK:
            s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_ks
    o_off = b.to(tl.int64) * stride_ob + tok * stride_ot + head * HEAD_DIM
    tl.store(
        OUT + o_off[:, None] + offs_d[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None]
    )


def dense_attn(
    q, k, v, out, scale, stages, pages, carry_q=False, mask=False, gather=False, block_m=128, block_n=128, warps=8
):
    """q [B, NQ, HQ, D], k/v [B, S, HKV, D] contiguous (S a multiple of block_n); ``pages``: the block table
    GATHER reads (int64 [B * S / BS], blocks in order)."""
    B, NQ, Hq, Dd = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    grid = (triton.cdiv(NQ, block_m // G), Hkv, B)
    _dense_attn_kernel[grid](
        q,
        k,
        v,
        out,
        pages,
        scale * 1.4426950408889634,
        S,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        out.stride(0),
        out.stride(1),
        NQ,
        G=G,
        HEAD_DIM=Dd,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=BS,
        CARRY_Q=carry_q,
        MASK=mask,
        GATHER=gather,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def contiguous_meta(meta):
    """The same block table (deltas, valid lengths) with physical ids in order."""
    ids, delta, valid = unpack_block_meta(meta)
    ordered = torch.arange(ids.numel(), device=ids.device, dtype=ids.dtype).view_as(ids)
    return pack_block_meta(ordered, delta, valid)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "prefill_ceiling.json"))
    ap.add_argument("--ncu", action="store_true", help="run each variant once (no timing), for ncu")
    ap.add_argument("--only", help="time only the variants matching this regex (plus lazy, off and sdpa)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    cos, sin = (t.to(dev) for t in rope_tables(inv_freq, MAX_POS))
    c = PrefillCase(gen, dev, cos, sin, a.batch, a.ctx, a.docs, a.new)
    B, N = a.batch, a.new
    S = a.ctx + N
    # contiguous copies: the valid cached keys (re-rotated) then the new ones, [B, S, Hkv, D]
    ids, _, vl = unpack_block_meta(c.meta)
    keep = torch.arange(BS, device=dev)[None, None, :] < vl[:, :, None]
    kd = torch.cat((c.kk[ids][keep].view(B, a.ctx, HKV, D), c.kn.view(B, N, HKV, D)), 1).contiguous()
    vd = torch.cat((c.v[ids][keep].view(B, a.ctx, HKV, D), c.vn.view(B, N, HKV, D)), 1).contiguous()
    qd = c.q.view(B, N, HQ, D)
    od = torch.empty_like(qd)
    # the same cache, physical blocks in table order
    n_blk = c.meta.numel()
    kc = torch.empty(n_blk, BS, HKV, D, device=dev, dtype=DT)
    vc = torch.empty_like(kc)
    ids_flat = ids.reshape(-1)
    kc.copy_(c.k[ids_flat])
    vc.copy_(c.v[ids_flat])
    meta_c = contiguous_meta(c.meta)
    cache_c = {}

    def lazy_contig():
        from lazyrag.kernels.prefill import lazy_prefill

        return lazy_prefill(
            c.q, c.kn, c.vn, c.cu, kc, vc, meta_c, c.nblk, cos, sin, c.scale, max_seqlen_q=N, tile_cache=cache_c
        )

    ref = c.lazy()().float()
    variants = {"lazy": c.lazy(), "off": c.off(), "lazy_contig": lazy_contig}
    for mode, cfg in ((5, (128, 128, 8, 3)), (7, (128, 128, 8, 3)), (7, (128, 128, 8, 2))):  # the Triton kernel
        variants[f"lazy r{mode} {cfg}"] = c.lazy(rotation_mode=mode, config=cfg)
        variants[f"off r{mode} {cfg}"] = c.off(rotation_mode=mode, config=cfg)
    from lazyrag.kernels import prefill_wgmma

    if prefill_wgmma.supported(c.q.dtype, D, dev, BS, 64):
        for cfg in ((128, 128, 12, 3), (128, 64, 12, 4), (128, 64, 12, 5), (128, 64, 12, 6)):
            variants[f"lazy wgmma {cfg}"] = c.lazy(kernel="wgmma", config=cfg)
            variants[f"off wgmma {cfg}"] = c.off(kernel="wgmma", config=cfg)
    pages = torch.arange(B * S // BS, device=dev, dtype=torch.int64)  # the dense kernel's block table, in order
    for st in (2, 3):
        variants[f"dense s{st}"] = lambda st=st: dense_attn(qd, kd, vd, od, c.scale, st, pages)
    for flags in ("carry_q", "mask", "gather", "carry_q,mask,gather"):
        kw = {f: True for f in flags.split(",")}
        variants[f"dense s3 +{flags}"] = lambda kw=kw: dense_attn(qd, kd, vd, od, c.scale, 3, pages, **kw)
    qs = qd.transpose(1, 2)
    ks = kd.transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vs = vd.transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(N, S)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    variants["sdpa"] = lambda: sdpa(qs, ks, vs, attn_mask=mask, scale=c.scale)
    variants["sdpa_full"] = lambda: sdpa(qs, ks, vs, scale=c.scale)
    if a.only:
        import re

        variants = {
            n: f for n, f in variants.items() if n in ("lazy", "off", "sdpa", "sdpa_full") or re.search(a.only, n)
        }
    flops_causal = c.flops()
    flops_full = 4 * B * HQ * D * N * S
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for name, fn in variants.items():
            out = fn()
            torch.cuda.synchronize()
            if name.startswith("dense"):
                full = variants["sdpa_full"]().transpose(1, 2).float()
                print(f"{name:32} err vs sdpa_full {((out.float() - full).norm() / full.norm()).item():.1e}")
            elif not name.startswith("sdpa"):
                err = ((out.float() - ref).norm() / ref.norm()).item()
                print(f"{name:32} err vs lazy {err:.1e}  {fmt_info(launch_info('prefill'))}", flush=True)
        if a.ncu:
            return
        names = list(variants)
        med, ratio, spread = paired_graph_ms([variants[n] for n in names], cache=c.cache)
    rows = []
    print(f"B={B} ctx={a.ctx} docs={a.docs} new={N}: device ms (CUDA graph, median of alternating rounds)")
    for n, ms, r, sp in zip(names, med, ratio, spread):
        fl = flops_full if n.startswith("dense") or n == "sdpa_full" else flops_causal
        rows.append(dict(variant=n, ms=ms, ratio_to_lazy=r, spread=sp, tflops=fl / ms / 1e9))
        print(f"  {n:32} {ms * 1e3:8.1f} us  x{r:5.3f} of lazy  {fl / ms / 1e9:6.1f} TF/s  spread {100 * sp:.1f}%")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(
            dict(
                device=torch.cuda.get_device_name(),
                triton=triton.__version__,
                torch=torch.__version__,
                command=" ".join(sys.argv),
                batch=B,
                ctx=a.ctx,
                docs=a.docs,
                new=N,
                rows=rows,
            ),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
