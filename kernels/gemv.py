"""One-token projections (GEMV) with the elementwise step before them folded into the load of x.

A decode step at batch 1 multiplies one row by each weight matrix: it is a read of the weights,
nothing else. cuBLAS reads wqkv and wo at ~3 TB/s (its 64x8 tiles; wo and down add a split-K
reduce launch), and each projection waits for a separate norm (or silu*up) kernel. Here one
program owns ``BLOCK_N`` output rows, streams their weights once along K, and computes its x on
the fly from what the elementwise kernel would have read:

* ``rms_norm``: ``x = norm_w * rms_norm(h)``; every program sums h^2 first (h is 8 KB and stays in
  L1/L2; the weights dominate by ~1000x);
* ``add_rms_norm``: ``h = x + residual`` first (program 0 also writes h: the next residual stream);
* ``silu_mul``: ``x = silu(gate) * up`` from the ``[2K]`` gate|up row.

Numerics follow the unfused path: h and the normed / gated x are rounded to the model dtype before
the product (as the separate kernel's output would be); the dot accumulates in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN, NORM, ADD_NORM, SILU = 0, 1, 2, 3

# (BLOCK_N, BLOCK_K, num_warps) per (N, K, prologue); benchmarks/e2e_sweep.py measures the candidates
# on the device and can write a table to adopt (e2e_gpu.py --gemv-configs).
DEFAULT_CONFIG = (8, 512, 4)
# measured on the H200 for Llama-3.1-8B's shapes (round 5; e2e_sweep_h200_round5.json): the best candidate differs
# by shape (wo at (8, 512, 4) took 15.5 µs, at (2, 1024, 4) 10.7); the first layer's NORM takes its ADD_NORM's
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (6144, 4096, ADD_NORM): (8, 512, 4), (6144, 4096, NORM): (8, 512, 4), (4096, 4096, PLAIN): (2, 1024, 4),
    (28672, 4096, ADD_NORM): (4, 512, 4), (4096, 14336, SILU): (4, 1024, 4),
}
CANDIDATES = [(4, 512, 4), (8, 512, 4), (8, 256, 4), (16, 256, 4), (16, 512, 8), (4, 1024, 4),
              (8, 1024, 8), (2, 1024, 4), (32, 128, 4), (16, 128, 4)]


@triton.jit
def _stream(X, R, k, k_ok, ADD: tl.constexpr):
    """h[k] in fp32, rounded to the model dtype as the unfused residual add rounds it."""
    h = tl.load(X + k, mask=k_ok, other=0.0)
    if ADD:
        h = (h.to(tl.float32) + tl.load(R + k, mask=k_ok, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
    return h.to(tl.float32)


@triton.jit
def _gemv_kernel(
    X, R, NW, W, B, Y, H_OUT, N, K, stride_w, eps,
    NORMED: tl.constexpr, ADD: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    cols = tl.arange(0, BLOCK_K)
    dt = X.dtype.element_ty
    if NORMED:  # rstd of h, before any weight is read
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = _stream(X, R, k0 + cols, k0 + cols < K, ADD)
            sq += h * h
        rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        if GATED:
            g = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
            u = tl.load(X + K + k, mask=k_ok, other=0.0).to(tl.float32)
            xv = (g * tl.sigmoid(g) * u).to(dt).to(tl.float32)
        elif NORMED:
            h = _stream(X, R, k, k_ok, ADD)
            if ADD:  # the residual stream after this add, written once
                tl.store(H_OUT + k, h.to(dt), mask=k_ok & (pid + cols * 0 == 0))  # a tensor mask: the interpreter rejects scalar ones
            nw = tl.load(NW + k, mask=k_ok, other=0.0).to(tl.float32)
            xv = (nw * (h * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        else:
            xv = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, 1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prologue: int = PLAIN,
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         config: tuple[int, int, int] | None = None, out: torch.Tensor | None = None):
    """``F.linear(pre(x), weight, bias)`` for one row, ``pre`` the prologue.

    x: ``[1, K]`` (``[1, 2K]`` gate|up for SILU); weight ``[N, K]``; residual, norm_weight ``[K]``-like.
    Returns y ``[1, N]`` (into ``out`` where given); with ADD_NORM, ``(h, y)``, ``h = x + residual`` ``[1, K]``."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
    assert x.shape[1] == (2 * k if prologue == SILU else k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    h = torch.empty(1, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else y
    block_n, block_k, warps = config or CONFIGS.get((n, k, prologue), DEFAULT_CONFIG)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, y, h, n, k, weight.stride(0), float(eps),
        NORMED=prologue in (NORM, ADD_NORM), ADD=prologue == ADD_NORM, GATED=prologue == SILU, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return (h, y) if prologue == ADD_NORM else y
