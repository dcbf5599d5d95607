"""The fused q/k rotation + K/V pool store (kernels/qkv.py) against rotate_qk + BlockPool.write."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import gpu, make_rope, needs_cuda, rel_err


def _check_rotate_qk_store(device, dtype, hq, hkv, d, T, scaling):
    from lazyrag.kernels.qkv import rotate_qk_store
    from lazyrag.model.llama import rope_at, rotate_qk

    torch.manual_seed(T + hq)
    bs = 16
    nb = T // bs + 4
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=device, dtype=dtype)
    cos_t, sin_t = make_rope(d, device)
    positions = torch.randint(0, 4000, (T,), device=device)
    cos, sin = rope_at(cos_t, sin_t, positions, dtype)
    slots = torch.randperm(nb * bs, device=device)[:T]
    k_cache = torch.full((nb, bs, hkv, d), float("nan"), device=device, dtype=dtype)
    v_cache = k_cache.clone()
    q, k, v = rotate_qk_store(qkv, cos, sin, scaling, hq, hkv, k_cache, v_cache, slots)
    rq, rk, rv = rotate_qk(qkv.float(), cos.float(), sin.float(), scaling, hq, hkv)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(q, rq) < tol and rel_err(k, rk) < tol and torch.equal(v, qkv[:, (hq + hkv) * d :].view(T, hkv, d))
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_rotate_qk_store_matches_rotate_and_write(scaling):
    _check_rotate_qk_store("cpu", torch.float32, 4, 2, 16, 5, scaling)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 64, 300])
def test_rotate_qk_store_gpu(dtype, T):
    _check_rotate_qk_store("cuda", dtype, 32, 8, 128, T, 1.0)
