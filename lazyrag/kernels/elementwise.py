"""The layer's elementwise steps as plain Triton kernels: ``silu(gate) * up`` and the (residual add +)
RMS norm, for forwards of any token count.

Why not ``torch.compile``: with ``dynamic=True`` (the token count varies) Inductor's silu*up ran far below
the bandwidth (NOTES §Kernels, round 5 profile). Here the row length is a compile-time constant, so every load
is a full 16-byte vector and a program covers a fixed slice.

Numerics as the fused GEMV prologues of ``kernels/gemv.py`` and as Inductor fuses
:mod:`lazyrag.model.llama`'s functions: fp32 arithmetic on the model-dtype inputs; ``h = x + residual``
is rounded to the model dtype (it is the next residual stream), so is the normalised row before the
norm weight multiplies it (transformers' Llama order); ``silu(gate) * up`` is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The rounding of each step, in one place: these kernels and kernels/gemv.py's prologues (which fold the same steps
# into a projection) compute in fp32 and round where the unfused torch functions' outputs would be rounded.


@triton.jit
def residual_add(x, r, dt: tl.constexpr):
    """``x + r`` in fp32, rounded to the model dtype ``dt`` (it is the next residual stream); returned in fp32."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def inv_rms(h, n, eps):
    """1 / rms of the fp32 row ``h`` (its ``n`` real values; masked lanes hold 0)."""
    return tl.rsqrt(tl.sum(h * h, 0) / n + eps)


@triton.jit
def rms_normed(h, w, rstd, dt: tl.constexpr):
    """``w * (h * rstd)`` as transformers' Llama rounds it (the normalised row, then the product); fp32."""
    return (w.to(tl.float32) * (h * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def silu_times(g, u, dt: tl.constexpr):
    """``silu(g) * u`` of fp32 ``g``, ``u``, rounded once to ``dt``; fp32."""
    return (g * tl.sigmoid(g) * u).to(dt).to(tl.float32)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, INTER, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    row = GU + t.to(tl.int64) * stride_gu
    g = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(row + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    tl.store(OUT + t.to(tl.int64) * stride_o + cols, silu_times(g, u, dt).to(dt), mask=ok)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 inter]`` -> ``[T, inter]``."""
    T = gate_up.shape[0]
    assert gate_up.shape[1] == 2 * inter and gate_up.stride(1) == 1
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    # >= ~64 programs even for one token (a few wide programs were slower at T = 1: NOTES §Kernels, round 5)
    block = max(256, min(2048, triton.next_power_of_2(triton.cdiv(T * inter, 64))))
    block = min(block, triton.next_power_of_2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _rms_norm_kernel(
    X, R, W, H_OUT, Y, stride_x, stride_r, stride_h, stride_y, H, eps, ADD: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    dt = X.dtype.element_ty
    h = tl.load(X + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:  # the residual stream after this add: rounded, stored, and what is normalised
        h = residual_add(h, tl.load(R + t * stride_r + cols, mask=ok, other=0.0), dt)
        tl.store(H_OUT + t * stride_h + cols, h.to(dt), mask=ok)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Y + t * stride_y + cols, rms_normed(h, w, inv_rms(h, H, eps), dt).to(dt), mask=ok)


def _norm(x, residual, weight, eps):
    T, H = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    if T:
        block = triton.next_power_of_2(H)
        r = residual if residual is not None else x
        _rms_norm_kernel[(T,)](
            x,
            r,
            weight,
            h,
            y,
            x.stride(0),
            r.stride(0),
            h.stride(0),
            y.stride(0),
            H,
            float(eps),
            ADD=residual is not None,
            BLOCK=block,
            num_warps=max(1, min(8, block // 512)),
        )
    return h, y


@triton.jit
def _head_rms_norm_kernel(QKV, QW, KW, stride_t, HQ, D, eps, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    row = QKV + t * stride_t + head * D
    h = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.where(head < HQ, tl.load(QW + cols, mask=ok, other=0.0), tl.load(KW + cols, mask=ok, other=0.0))
    dt = QKV.dtype.element_ty
    tl.store(row + cols, rms_normed(h, w, inv_rms(h, D, eps), dt).to(dt), mask=ok)


def head_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, hq: int, hkv: int):
    """Qwen3's per-head norms of the fused projection ``qkv [T, (hq + 2 hkv) D]``: each q head by ``q_weight [D]``,
    each k head by ``k_weight [D]``, v untouched; in place (one launch where the torch path takes five), returns
    ``qkv``."""
    T, D = qkv.shape[0], q_weight.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (hq + 2 * hkv) * D, (qkv.shape, hq, hkv, D)
    if T:
        block = triton.next_power_of_2(D)
        _head_rms_norm_kernel[(T, hq + hkv)](
            qkv, q_weight, k_weight, qkv.stride(0), hq, D, float(eps), BLOCK=block, num_warps=max(1, block // 256)
        )
    return qkv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, H]`` -> ``weight * rms_norm(x)``."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(h, weight * rms_norm(h))`` with ``h = x + residual``, all ``[T, H]``."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _argmax_chunks_kernel(X, OUT, stride_x, V, P, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + b.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    # one fp32 pair per chunk: (max, index); indices < 2^24 are exact in fp32
    tl.store(OUT + (b * P + c) * 2, best)
    tl.store(OUT + (b * P + c) * 2 + 1, (c * BLOCK + at).to(tl.float32))


@triton.jit
def _argmax_finish_kernel(PAIRS, OUT, P, BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    c = tl.arange(0, BLOCK_P)
    best = tl.load(PAIRS + (b * P + c) * 2, mask=c < P, other=float("-inf"))
    # chunks are in column order, so the leftmost best chunk holds the row's first maximum
    _, j = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(OUT + b, tl.load(PAIRS + (b * P + j) * 2 + 1).to(tl.int64))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` -> each row's argmax (the first of equal maxima) ``[B]`` int64, on the device, no sync.

    torch's ``argmax(-1)`` reduces a row in one thread block (slow for Llama-3's 128,256 logits: NOTES
    §Kernels, round 5 profile). Here programs reduce 4,096-logit chunks in parallel and
    one small program per row picks the best chunk. The tokens stay on the device, so a decode step can
    be fed the previous step's tokens before the host has read them (the scheduler's async scheduling)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    assert V < (1 << 24) and logits.stride(1) == 1
    block = min(4096, triton.next_power_of_2(V))
    P = triton.cdiv(V, block)
    pairs = torch.empty(B, P, 2, dtype=torch.float32, device=logits.device)
    _argmax_chunks_kernel[(B, P)](logits, pairs, logits.stride(0), V, P, BLOCK=block, num_warps=4)
    _argmax_finish_kernel[(B,)](pairs, out, P, BLOCK_P=max(2, triton.next_power_of_2(P)), num_warps=1)
    return out
