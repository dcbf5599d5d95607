"""Attention for selective recompute (engine/blend.py): scattered query tokens over a dense context, each query
seeing a prefix of the keys.

The recomputed tokens are a sorted subset of the request's placed context, and the context is in position order,
so "attend to every context token at or before my position" is "attend to keys ``[0, limit)``" with one ``limit``
per query. A dense mask would cost ``S x N`` memory and, in fp32 SDPA, most of a recovery's time at 20k tokens
(benchmarks/NOTES.md, "Recovery below a third of full prefill"); here a program walks the key tiles up to its rows'
largest limit with a flash-attention loop and masks only by ``limit``.

One program handles ``BLOCK_M`` rows = (query token, q head) pairs of the ``G`` query heads that share one KV head
("packed GQA", as kernels/prefill.py), so each K/V tile is loaded once for the group. The context is already rotated
to its final positions (the recompute rotates the cached keys by their placement's delta once per layer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kvloop import softmax_step
from .reference import prefix_attention_reference

LOG2E = 1.4426950408889634


@triton.jit
def _prefix_attention_kernel(
    Q, K, V, LIMIT, OUT, qk_scale, S,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M // G  # query tokens per program (G need not divide BLOCK_M: the tail rows idle)
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    tok = tl.program_id(0) * TOK + rows // G
    head = kvh * G + rows % G
    row_ok = (rows < TOK * G) & (tok < S)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(K.dtype.element_ty)  # scale and log2(e) folded in: softmax in base 2
    limit = tl.load(LIMIT + tok, mask=row_ok, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    end = tl.max(limit, 0)
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + offs_n
        kv_ok = cols < end
        k = tl.load(K + cols[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
        v = tl.load(V + cols[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
        keep = cols[None, :] < limit[:, None]
        m_i, l_i, acc = softmax_step(q, k, v, keep, m_i, l_i, acc, PREC)
    out = acc / l_i[:, None]  # idle rows (NaN: they saw no key) are not stored
    tl.store(OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor,
                     sm_scale: float) -> torch.Tensor:
    """Softmax attention of each query over the first ``limit`` keys.

    q: [S, Hq, D]; k, v: [N, Hkv, D], in q's dtype, positions already applied; limit: [S] int, each >= 1 and <= N.
    Returns [S, Hq, D] in q's dtype (accumulated in fp32). ``HEAD_DIM`` a power of two (the reference otherwise)."""
    S, Hq, D = q.shape
    N, Hkv, _ = k.shape
    assert k.dtype == q.dtype == v.dtype and Hq % Hkv == 0 and limit.shape == (S,), (q.shape, k.shape, limit.shape)
    if D & (D - 1) or D < 16:
        return prefix_attention_reference(q, k, v, limit, sm_scale).to(q.dtype)
    G = Hq // Hkv
    out = torch.empty_like(q)
    if S == 0:
        return out
    block_m = max(128, triton.next_power_of_2(G))
    block_n = 64
    limit = limit.to(device=q.device, dtype=torch.int32)
    grid = (triton.cdiv(S, block_m // G), Hkv)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    _prefix_attention_kernel[grid](
        q, k, v, limit, out, sm_scale * LOG2E, S,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        G=G, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=8 if D > 64 else 4, num_stages=2,
    )
    return out
