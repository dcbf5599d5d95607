"""Attention for selective recompute (engine/blend.py): scattered query tokens over a dense context, each query
seeing a prefix of the keys.

The recomputed tokens are a sorted subset of the request's placed context, and the context is in position order,
so "attend to every context token at or before my position" is "attend to keys ``[0, limit)``" with one ``limit``
per query. A dense mask would cost ``S x N`` memory and, in fp32 SDPA, most of a recovery's time at 20k tokens
(benchmarks/NOTES.md, "Recovery below a third of full prefill"); here a program walks the key tiles up to its rows'
largest limit with a flash-attention loop and masks only by ``limit``.

Before each layer's pass the context is gathered from the paged pool: :func:`gather_rotated` reads each token's
slot, rotates its key by its placement's delta in fp32 and writes K and V in the pool's dtype, one launch for both
(gathering in fp32, rotating and casting back was a sixth of a 20k-token recovery).

One program handles ``BLOCK_M`` rows = (query token, q head) pairs of the ``G`` query heads that share one KV head
("packed GQA", as kernels/prefill.py), so each K/V tile is loaded once for the group. The context is already rotated
to its final positions (the recompute rotates the cached keys by their placement's delta once per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kvloop import softmax_step
from .reference import gather_rotated_reference, prefix_attention_reference

LOG2E = 1.4426950408889634


@triton.jit
def _prefix_attention_kernel(
    Q,
    K,
    V,
    LIMIT,
    OUT,
    qk_scale,
    S,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M // G  # query tokens per program (G need not divide BLOCK_M: the tail rows idle)
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    tok = tl.program_id(0) * TOK + rows // G
    head = kvh * G + rows % G
    row_ok = (rows < TOK * G) & (tok < S)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
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
    tl.store(
        OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None],
    )


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    limit: torch.Tensor,
    sm_scale: float,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over the first ``limit`` keys.

    q: [S, Hq, D]; k, v: [N, Hkv, D], in q's dtype, positions already applied, any strides but the head dim's
    (dense); limit: [S] int (int32: used as it is), each >= 1 and <= N.
    Returns [S, Hq, D] in q's dtype (accumulated in fp32). ``HEAD_DIM`` a power of two (the reference otherwise).
    ``block_n``, ``num_warps``, ``num_stages``: the launch (benchmarks/recover_gpu.py --sweep compares them); None
    takes the first of :func:`_launches` that fits this GPU."""
    S, Hq, D = q.shape
    N, Hkv, _ = k.shape
    assert k.dtype == q.dtype == v.dtype and Hq % Hkv == 0 and limit.shape == (S,), (q.shape, k.shape, limit.shape)
    if D & (D - 1) or D < 16:
        return prefix_attention_reference(q, k, v, limit, sm_scale).to(q.dtype)
    G = Hq // Hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if S == 0:
        return out
    block_m = max(128, triton.next_power_of_2(G))
    limit = limit.to(device=q.device, dtype=torch.int32)  # a no-op for the recompute's int32 limits
    grid = (triton.cdiv(S, block_m // G), Hkv)
    # the kernel takes any token and head strides: only a head dim that is not dense is copied (the recompute's q is
    # a slice of the fused projection, used in place)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    explicit = block_n is not None or num_warps is not None or num_stages is not None
    key = (q.device, q.dtype, D, G)
    if explicit:
        small = _launches(q.dtype, D)[-1]
        candidates = [(block_n or small[0], num_warps or small[1], num_stages or small[2])]
    else:
        candidates = [_LAUNCH[key]] if key in _LAUNCH else _launches(q.dtype, D)
    for i, launch in enumerate(candidates):
        try:
            _launch(q, k, v, limit, out, sm_scale, grid, G, block_m, *launch)
        except triton.runtime.errors.OutOfResources:
            if i == len(candidates) - 1:
                raise
            continue
        if not explicit:
            _LAUNCH[key] = launch
        return out
    raise AssertionError("unreachable")


# (device, dtype, head dim, group) -> the launch that fitted there
_LAUNCH: dict[tuple, tuple[int, int, int]] = {}


def _launches(dtype: torch.dtype, D: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, num_warps, num_stages) to try, best first. 16-bit at D = 128 on an H100: (128, 8, 3) takes 1.46 ms
    where (64, 8, 2) takes 1.76 at 20k tokens (benchmarks/NOTES.md, "One H100 session"); its K/V tiles need ~160 KB
    of shared memory (4 stages no longer fit an H100), so smaller GPUs fall back to the last, which fits everywhere."""
    warps = 8 if D > 64 else 4
    small = (64, warps, 2)
    if dtype == torch.float32 or D <= 64:
        return [small]
    return [(128, 8, 3), small]


def _launch(q, k, v, limit, out, sm_scale, grid, G, block_m, block_n, num_warps, num_stages) -> None:
    S, D = q.shape[0], q.shape[2]
    _prefix_attention_kernel[grid](
        q,
        k,
        v,
        limit,
        out,
        sm_scale * LOG2E,
        S,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        G=G,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@triton.jit
def _gather_rotated_kernel(
    K,
    V,
    SLOTS,
    DELTA,
    COS,
    SIN,
    KO,
    VO,
    N,
    stride_slot,
    stride_cos,
    HKV: tl.constexpr,
    HKV_P2: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    slot = tl.load(SLOTS + t, mask=t_ok, other=0).to(tl.int64)
    delta = tl.load(DELTA + t, mask=t_ok, other=0).to(tl.int64)
    h = tl.arange(0, HKV_P2)
    d = tl.arange(0, HALF)
    ok = t_ok[:, None, None] & (h < HKV)[None, :, None]
    src = slot[:, None, None] * stride_slot + h[None, :, None] * (2 * HALF) + d[None, None, :]
    dst = t.to(tl.int64)[:, None, None] * (HKV * 2 * HALF) + h[None, :, None] * (2 * HALF) + d[None, None, :]
    rope = delta[:, None] * stride_cos + d[None, :]
    c = tl.load(COS + rope, mask=t_ok[:, None], other=0.0)[:, None, :]
    s = tl.load(SIN + rope, mask=t_ok[:, None], other=0.0)[:, None, :]
    x1 = tl.load(K + src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(K + src + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = KO.dtype.element_ty
    tl.store(KO + dst, (x1 * c - x2 * s).to(dt), mask=ok)
    tl.store(KO + dst + HALF, (x2 * c + x1 * s).to(dt), mask=ok)
    tl.store(VO + dst, tl.load(V + src, mask=ok, other=0.0), mask=ok)
    tl.store(VO + dst + HALF, tl.load(V + src + HALF, mask=ok, other=0.0), mask=ok)


def gather_rotated(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``slots`` [N] of one layer's pool (``k``, ``v``: [slots, Hkv, D]), keys rotated by ``delta`` [N] (>= 0)
    with the tables ``cos``, ``sin`` [positions, D/2] (fp32): K, V [N, Hkv, D] in the pool's dtype."""
    S, Hkv, D = k.shape
    assert v.shape == k.shape and k.stride()[1:] == (D, 1) and v.stride() == k.stride(), (
        k.shape,
        k.stride(),
        v.stride(),
    )
    assert slots.shape == delta.shape and cos.shape == sin.shape and cos.shape[1] * 2 == D and cos.stride(1) == 1
    N = slots.shape[0]
    ko, vo = (
        torch.empty(N, Hkv, D, dtype=k.dtype, device=k.device),
        torch.empty(N, Hkv, D, dtype=v.dtype, device=v.device),
    )
    if N == 0:
        return ko, vo
    if D & (D - 1) or D < 16:
        return gather_rotated_reference(k, v, slots, delta, cos, sin)
    block_t = max(1, 4096 // (triton.next_power_of_2(Hkv) * D))  # ~4k elements per load
    _gather_rotated_kernel[(triton.cdiv(N, block_t),)](
        k,
        v,
        slots,
        delta,
        cos,
        sin,
        ko,
        vo,
        N,
        k.stride(0),
        cos.stride(0),
        HKV=Hkv,
        HKV_P2=triton.next_power_of_2(Hkv),
        HALF=D // 2,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return ko, vo
