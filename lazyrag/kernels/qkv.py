"""One kernel between a layer's fused QKV projection and its attention.

It splits the projection ``qkv [T, (Hq + 2 Hkv) * D]`` into heads, rotates q and k at their
tokens' positions (RoPE, plus the rope type's attention scaling), and stores the new tokens'
rotated K and their V straight into the paged pool at their slots. This replaces three launches
a layer (the rotation, and an ``index_copy_`` each for K and V); a decode step of a 32-layer
model launches 64 fewer kernels. Numerics: the arithmetic runs in fp32 on the model-dtype
inputs (cos/sin as the caller cast them) and is rounded once, as ``torch.compile`` fuses
:func:`lazyrag.model.llama.rotate_qk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_qk_store_kernel(
    QKV,
    COS,
    SIN,
    QK_OUT,
    K_CACHE,
    V_CACHE,
    SLOTS,
    scaling,
    stride_x,
    stride_c,
    stride_o,
    stride_kslot,
    stride_vslot,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    SCALE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)  # q heads, then k heads, then v heads
    offs = tl.arange(0, HALF)
    src = QKV + t.to(tl.int64) * stride_x + h * (2 * HALF)
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    c = tl.load(COS + t.to(tl.int64) * stride_c + offs).to(tl.float32)
    s = tl.load(SIN + t.to(tl.int64) * stride_c + offs).to(tl.float32)
    hv = h + tl.zeros([HALF], dtype=tl.int32)  # the head index per lane: masks stay tensors
    is_qk = hv < HQ + HKV
    o1 = tl.where(is_qk, x1 * c - x2 * s, x1)  # v heads pass through
    o2 = tl.where(is_qk, x2 * c + x1 * s, x2)
    if SCALE:
        o1 = tl.where(is_qk, o1 * scaling, o1)
        o2 = tl.where(is_qk, o2 * scaling, o2)
    qk_ok = is_qk
    dst = QK_OUT + t.to(tl.int64) * stride_o + h * (2 * HALF)
    tl.store(dst + offs, o1.to(QK_OUT.dtype.element_ty), mask=qk_ok)
    tl.store(dst + HALF + offs, o2.to(QK_OUT.dtype.element_ty), mask=qk_ok)
    # rounded to the model dtype first, as the unfused path stores k.to(pool dtype)
    r1 = o1.to(QK_OUT.dtype.element_ty)
    r2 = o2.to(QK_OUT.dtype.element_ty)
    slot = tl.load(SLOTS + t).to(tl.int64)
    k_ok = is_qk & (hv >= HQ)
    kh = tl.where(h >= HQ, h - HQ, 0)
    kdst = K_CACHE + slot * stride_kslot + kh * (2 * HALF)
    tl.store(kdst + offs, r1.to(K_CACHE.dtype.element_ty), mask=k_ok)
    tl.store(kdst + HALF + offs, r2.to(K_CACHE.dtype.element_ty), mask=k_ok)
    v_ok = hv >= HQ + HKV
    vh = tl.where(h >= HQ + HKV, h - HQ - HKV, 0)
    vdst = V_CACHE + slot * stride_vslot + vh * (2 * HALF)
    tl.store(vdst + offs, r1.to(V_CACHE.dtype.element_ty), mask=v_ok)
    tl.store(vdst + HALF + offs, r2.to(V_CACHE.dtype.element_ty), mask=v_ok)


def rotate_qk_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scaling: float,
    hq: int,
    hkv: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
):
    """``rotate_qk`` followed by the pool write, in one launch.

    qkv: ``[T, (hq + 2 hkv) * D]``; cos, sin: ``[T, 1, D/2]`` (or ``[T, D/2]``); k_cache, v_cache: one
    layer of the pool ``[num_blocks, block_size, hkv, D]``; slots ``[T]``: block * block_size + offset.
    Returns q ``[T, hq, D]``, k, v ``[T, hkv, D]`` (q and k rotated, as ``rotate_qk`` returns them)."""
    T = qkv.shape[0]
    d = k_cache.shape[-1]
    assert qkv.shape[1] == (hq + 2 * hkv) * d and qkv.stride(1) == 1
    assert k_cache.shape[-2] == hkv and k_cache.is_contiguous() and v_cache.is_contiguous()
    cos2, sin2 = cos.reshape(T, d // 2), sin.reshape(T, d // 2)
    assert cos2.stride(1) == 1 and sin2.stride() == cos2.stride()
    out = torch.empty(T, hq + hkv, d, dtype=qkv.dtype, device=qkv.device)
    if T:
        _rotate_qk_store_kernel[(T, hq + 2 * hkv)](
            qkv,
            cos2,
            sin2,
            out,
            k_cache,
            v_cache,
            slots,
            float(scaling),
            qkv.stride(0),
            cos2.stride(0),
            out.stride(0),
            hkv * d,
            hkv * d,
            HQ=hq,
            HKV=hkv,
            HALF=d // 2,
            SCALE=scaling != 1.0,
            num_warps=1,
        )
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    return out[:, :hq], out[:, hq:], v
