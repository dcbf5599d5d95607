"""One-token projections (GEMV) with the elementwise step before them folded into the load of x.

A decode step at batch 1 multiplies one row by each weight matrix: it is a read of the weights,
nothing else. cuBLAS reads wqkv and wo below the copy bandwidth (its 64x8 tiles; wo and down add a split-K
reduce launch; NOTES §Kernels, round 5), and each projection waits for a separate norm (or silu*up) kernel. Here one
program owns ``BLOCK_N`` output rows, streams their weights once along K, and computes its x on
the fly from what the elementwise kernel would have read. The speed is the bytes in flight: with
BLOCK_K >= K a program issues its whole weight strip in one go (one-shot, no loop), else the K
loop is software-pipelined (``num_stages``: Triton's cp.async pipeliner, which takes plain loads
in a ``tl.range`` loop given num_stages).

* ``rms_norm``: ``x = norm_w * rms_norm(h)``; every program sums h^2 over the row from ONE load
  (h is 8 KB and stays in L1/L2; the weights dominate by ~1000x);
* ``add_rms_norm``: ``h = x + residual`` first (program 0 also writes h: the next residual stream);
* ``silu_mul``: ``x = silu(gate) * up`` from the ``[2K]`` gate|up row.

Numerics follow the unfused path: h and the normed / gated x are rounded to the model dtype before
the product (as the separate kernel's output would be); the dot accumulates in fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .elementwise import inv_rms, residual_add, rms_normed, silu_times
from .tuned import tuned

PLAIN, NORM, ADD_NORM, SILU = 0, 1, 2, 3

# Configs (BLOCK_N, BLOCK_K, num_warps[, num_stages]) per (N, K, prologue), the default and the candidates that
# benchmarks/e2e_sweep.py (archived at 32eec34) timed: tuned_configs.json's "gemv" (NOTES §Kernels, rounds 5-6). BLOCK_K
# >= K is the one-shot path (a program loads its whole [BLOCK_N, K] weight strip at once, no loop); else the K loop runs
# with num_stages (1: plain). A 3-tuple reads as num_stages=1.


@functools.lru_cache(maxsize=None)
def _tuned(device: torch.device) -> tuple[dict, tuple]:
    t = tuned(device)["gemv"]
    return {tuple(int(v) for v in k.split(",")): tuple(c) for k, c in t["shapes"].items()}, tuple(t["config"])


def tuned_shapes(device: torch.device) -> dict:
    """{(N, K, prologue): config} of the projection shapes measured on ``device``'s kind of card."""
    return _tuned(device)[0]


def config_for(n: int, k: int, prologue: int, device: torch.device) -> tuple[int, ...]:
    """The tuned config of this projection shape on ``device`` (the default one where none was measured)."""
    shapes, default = _tuned(device)
    return shapes.get((n, k, prologue), default)


def candidates(device: torch.device) -> list[tuple[int, ...]]:
    return [tuple(c) for c in tuned(device)["gemv"]["candidates"]]


def resolve(config: tuple[int, ...], k: int) -> tuple[int, int, int, int]:
    """The launch a config means at this K: BLOCK_K >= K is one-shot (BLOCK_K = next_power_of_2(K), no stages);
    a 3-tuple is num_stages=1. Two configs with the same result are the same kernel."""
    block_n, block_k, warps, stages = (*config, 1)[:4]
    if block_k >= k:
        return block_n, triton.next_power_of_2(k), warps, 1
    return block_n, block_k, warps, stages


@triton.jit
def _h(X, R, k, k_ok, ADD: tl.constexpr):
    """h[k] in fp32, rounded to the model dtype as the unfused residual add rounds it."""
    h = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
    if ADD:
        h = residual_add(h, tl.load(R + k, mask=k_ok, other=0.0), X.dtype.element_ty)
    return h


@triton.jit
def _h_rstd(X, R, H_OUT, pid, K, eps, ADD: tl.constexpr, K_PAD: tl.constexpr):
    """h over the whole row [K_PAD] and its 1/rms, from ONE load (a loop would be K/BLOCK_K dependent L2 round
    trips before the first weight tile); program 0 writes h, the next residual stream."""
    k = tl.arange(0, K_PAD)
    k_ok = k < K
    h = _h(X, R, k, k_ok, ADD)
    if ADD:
        tl.store(
            H_OUT + k, h.to(X.dtype.element_ty), mask=k_ok & (pid + k * 0 == 0)
        )  # a tensor mask: the interpreter rejects scalar ones
    return h, inv_rms(h, K, eps)


@triton.jit
def _x(X, R, NW, k, k_ok, K, rstd, NORMED: tl.constexpr, ADD: tl.constexpr, GATED: tl.constexpr):
    """x[k] in fp32, rounded to the model dtype as the unfused kernel's output is."""
    if GATED:  # silu(gate) * up from the [2K] gate|up row
        g = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.load(X + K + k, mask=k_ok, other=0.0).to(tl.float32)
        xv = silu_times(g, u, X.dtype.element_ty)
    elif NORMED:
        xv = rms_normed(_h(X, R, k, k_ok, ADD), tl.load(NW + k, mask=k_ok, other=0.0), rstd, X.dtype.element_ty)
    else:
        xv = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
    return xv


@triton.jit
def _gemv_kernel(
    X,
    R,
    NW,
    W,
    B,
    Y,
    H_OUT,
    N,
    K,
    stride_w,
    eps,
    NORMED: tl.constexpr,
    ADD: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PAD: tl.constexpr,
    ONE_SHOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    cols = tl.arange(0, BLOCK_K)
    # ONE_SHOT: BLOCK_K = K_PAD >= K, the whole [BLOCK_N, K] strip issued before anything waits on memory. ptxas
    # still decides the SASS order: where it can reach a lower register tier it sinks loads below the first
    # products (rounds of loads; benchmarks/gemv_ptx.py, archived at 32eec34, shows the order), so the candidates are
    # those it keeps upfront. A CTA barrier does not pin them: ptxas hoists the math above it.
    if ONE_SHOT:
        k_ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if NORMED:  # h of the norm is this program's x row: loaded once, with norm_w, before the rstd's
            nw = tl.load(NW + cols, mask=k_ok, other=0.0)  # reduction (its CTA barrier keeps every load above it)
            h, rstd = _h_rstd(X, R, H_OUT, pid, K, eps, ADD, K_PAD)
            xv = rms_normed(h, nw, rstd, X.dtype.element_ty)
        else:
            xv = _x(X, R, NW, cols, k_ok, K, 0.0, NORMED, ADD, GATED)  # [BLOCK_K]
        y = tl.sum(w.to(tl.float32) * xv[None, :], 1)  # [BLOCK_N]
    else:
        rstd = 0.0
        if NORMED:
            _, rstd = _h_rstd(X, R, H_OUT, pid, K, eps, ADD, K_PAD)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        # NUM_STAGES > 1: Triton's pipeliner keeps NUM_STAGES - 1 tiles' loads in flight (cp.async into shared
        # memory, no registers held); with K / BLOCK_K < NUM_STAGES the whole strip is issued before the loop.
        # NORMED: the rstd's round trip comes first (the pipeliner puts its prologue just before the loop).
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k = k0 + cols
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            acc += w.to(tl.float32) * _x(X, R, NW, k, k_ok, K, rstd, NORMED, ADD, GATED)[None, :]
        y = tl.sum(acc, 1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: int = PLAIN,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    config: tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
):
    """``F.linear(pre(x), weight, bias)`` for one row, ``pre`` the prologue.

    x: ``[1, K]`` (``[1, 2K]`` gate|up for SILU); weight ``[N, K]``; residual, norm_weight ``[K]``-like.
    ``config``: (BLOCK_N, BLOCK_K, num_warps[, num_stages]); BLOCK_K >= K is the one-shot path.
    Returns y ``[1, N]`` (into ``out`` where given); with ADD_NORM, ``(h, y)``, ``h = x + residual`` ``[1, K]``."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
    assert x.shape[1] == (2 * k if prologue == SILU else k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    h = torch.empty(1, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else y
    block_n, block_k, warps, stages = resolve(config or config_for(n, k, prologue, x.device), k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        y,
        h,
        n,
        k,
        weight.stride(0),
        float(eps),
        NORMED=prologue in (NORM, ADD_NORM),
        ADD=prologue == ADD_NORM,
        GATED=prologue == SILU,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_PAD=triton.next_power_of_2(k),
        ONE_SHOT=block_k >= k,
        NUM_STAGES=stages,
        num_warps=warps,
    )
    return (h, y) if prologue == ADD_NORM else y
