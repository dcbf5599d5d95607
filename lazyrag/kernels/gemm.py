"""Skinny GEMMs: ``F.linear`` for 2-64 token rows (the TTFT prefill's projections), a stream of the weight.

At M = 64 a Llama-3.1-8B projection does 64 FLOP per weight byte, a third of the H200's ridge (~200), so it
is a read of the weight from HBM, which cuBLAS reads below the copy bandwidth (NOTES §Kernels, rounds 5 and 6).
A program owns BLOCK_N weight rows (output columns) and all M token rows, and walks K:

    acc[BLOCK_N, BLOCK_M] += w_tile[BLOCK_N, BLOCK_K] @ x_tile[BLOCK_M, BLOCK_K]^T

The weight tile is the MMA's M side ("swap AB"): Hopper's wgmma takes 64 rows a warpgroup there, which the
weight has and 7 tokens do not; the tokens are its N side (8 to 256 wide), so M pads only to 16 / 32 / 64.
Both tiles feed ``tl.dot``, which is what Triton's software pipeliner overlaps: ``num_stages - 1`` tiles in
flight (cp.async into shared memory). Bytes in flight = resident programs x (stages - 1) x BLOCK_N x BLOCK_K
x 2 B; ~4.3 TB/s needs ~50-65 KB per SM (Little's law, ~1.5-2 µs of loaded latency). x (M x K, 512 KB at
M = 64) comes from L2, read whole by every program: M / BLOCK_N bytes of L2 per weight byte, so BLOCK_N >= 64
keeps that under the HBM stream.

Few programs (N / BLOCK_N < ~2 x 132 SMs: wqkv, wo, down) can split K too (SPLIT_K > 1): each split writes an
fp32 partial into a ``[SPLIT_K, M, N]`` workspace and a small second kernel sums the splits, adds the bias
and casts. Two launches; fp32 atomics would need a zeroed buffer first and, for a bf16 output, a cast after
(three), and would sum in a varying order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tuned import tuned

MAX_M = 64


# Configs (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) per (N, K, BLOCK_M), the default and the candidates
# that benchmarks/e2e_sweep.py ("skinny"; archived at 32eec34) timed: tuned_configs.json's "gemm". The candidates are
# picked for residency at BLOCK_M = 64 (shared memory is stages x (BLOCK_N + 64) x BLOCK_K x 2 B; two programs an SM up
# to ~113 KB) and enough bytes in flight (NOTES §Kernels, round 6). No shape measured yet.
@functools.lru_cache(maxsize=None)
def _tuned(device: torch.device) -> tuple[dict, tuple]:
    t = tuned(device)["gemm"]
    return {tuple(int(v) for v in k.split(",")): tuple(c) for k, c in t["shapes"].items()}, tuple(t["config"])


def config_for(n: int, k: int, bm: int, device: torch.device) -> tuple[int, int, int, int, int]:
    shapes, default = _tuned(device)
    return shapes.get((n, k, bm), default)


def candidates(device: torch.device) -> list[tuple[int, ...]]:
    return [tuple(c) for c in tuned(device)["gemm"]["candidates"]]


def block_m(m: int) -> int:
    """The token tile: M padded to 16, 32 or 64 (the MMA's N side)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


@triton.jit
def _skinny_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ys,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = weight rows
    rm = tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows
    rk = tl.arange(0, BLOCK_K)
    # rows past N or M wrap onto real ones (the loads need no row mask); their results are not stored
    w_ptr = W + (rn % N).to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = X + (rm % M)[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # split pid_k takes every SPLIT_K-th BLOCK_K slice of K; the launch's num_stages pipelines this loop
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        k_ok = (k0 + rk < K)[None, :]
        w = tl.load(w_ptr + k0, mask=k_ok, other=0.0)
        x = tl.load(x_ptr + k0, mask=k_ok, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    if HAS_BIAS:  # SPLIT_K == 1 only: the split sum adds it otherwise
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    # y[m, n] = acc[n, m]: into the output (SPLIT_K == 1) or this split's fp32 partial
    y_ptr = Y + pid_k * stride_ys + rm[None, :] * stride_ym + rn[:, None]  # [BLOCK_N, BLOCK_M]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=(rn < N)[:, None] & (rm < M)[None, :])


@triton.jit
def _sum_splits_kernel(P, B, Y, N, MN, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat index into y [M, N]
    ok = i < MN
    p = tl.load(P + tl.arange(0, SPLIT_K)[:, None] * MN + i[None, :], mask=ok[None, :], other=0.0)  # [SPLIT_K, BLOCK]
    y = tl.sum(p, 0)
    if HAS_BIAS:
        y += tl.load(B + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + i, y.to(Y.dtype.element_ty), mask=ok)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x ``[M, K]``, 1 <= M <= 64, weight ``[N, K]`` (nn.Linear's layout);
    fp32 accumulation. Returns y ``[M, N]`` in x's dtype (into ``out``, contiguous, where given)."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_M and weight.shape[1] == k and x.dtype == weight.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1
    bm = block_m(m)
    block_n, block_k, warps, stages, split = config or config_for(n, k, bm, x.device)
    assert split & (split - 1) == 0, "SPLIT_K: a power of two"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.is_contiguous()
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    _skinny_kernel[(triton.cdiv(n, block_n), split)](
        x,
        weight,
        bias if has_bias else weight,
        part,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        m * n if split > 1 else 0,
        n,
        HAS_BIAS=has_bias and split == 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        num_warps=warps,
        num_stages=stages,
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, bias if has_bias else part, y, n, m * n, HAS_BIAS=has_bias, SPLIT_K=split, BLOCK=block
        )
    return y
