"""The selective-recompute attention (kernels/recompute.py) against its dense fp32 reference: scattered queries, each
over a prefix of the keys, with grouped KV heads (G = 3 as the embedded model's, and 4 as Llama-3's)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import gpu, needs_cuda, rel_err


def _check(device, dtype, S, N, Hq, Hkv, D, seed):
    from lazyrag.kernels.recompute import prefix_attention
    from lazyrag.kernels.reference import prefix_attention_reference

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(N, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(N, Hkv, D, generator=g).to(device, dtype)
    # as the recompute asks: sorted scattered positions, the last query seeing every key; one query sees one key
    limit = torch.randint(1, N + 1, (S,), generator=g).sort().values
    limit[0], limit[-1] = 1, N
    out = prefix_attention(q, k, v, limit.to(device), D**-0.5)
    ref = prefix_attention_reference(q, k, v, limit.to(device), D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    # unsorted limits are computed as well (nothing in the kernel relies on the order)
    shuffled = torch.randperm(S, generator=g)
    out2 = prefix_attention(q[shuffled], k, v, limit[shuffled].to(device), D**-0.5)
    assert rel_err(out2, ref[shuffled]) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize(
    "S,N,Hq,Hkv,D",
    [(7, 40, 9, 3, 16), (45, 130, 4, 1, 32), (20, 70, 8, 2, 64)],
    ids=["G3-D16", "G4-D32-tiles", "G4-D64"],
)
def test_prefix_attention_matches_reference(S, N, Hq, Hkv, D):
    _check("cpu", torch.float32, S, N, Hq, Hkv, D, seed=S + N)


def test_prefix_attention_falls_back_where_the_large_tile_does_not_fit(monkeypatch):
    """A GPU with less shared memory than the large launch needs gets the small one, remembered for the next call."""
    import triton

    from lazyrag.kernels import recompute

    launch = recompute._launch
    tried = []

    def small_gpu(*args):
        tried.append(args[-3:])
        if args[-3] == 128:
            raise triton.runtime.errors.OutOfResources(200_000, 101_376, "shared memory")
        launch(*args)

    monkeypatch.setattr(recompute, "_launch", small_gpu)
    monkeypatch.setattr(recompute, "_launches", lambda dtype, D: [(128, 8, 3), (64, 4, 2)])
    monkeypatch.setattr(recompute, "_LAUNCH", {})
    _check("cpu", torch.float32, 20, 70, 8, 2, 32, seed=5)
    assert tried == [(128, 8, 3), (64, 4, 2), (64, 4, 2)]  # the second call goes straight to the launch that fitted
    # an explicit launch that does not fit is the caller's error, not silently replaced
    q = torch.randn(4, 8, 32)
    with pytest.raises(triton.runtime.errors.OutOfResources):
        recompute.prefix_attention(q, q[:, :2], q[:, :2], torch.full((4,), 4), 1.0, block_n=128)


def test_prefix_attention_odd_head_dim_uses_the_reference():
    _check("cpu", torch.float32, 5, 9, 2, 1, 24, seed=3)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("S,N,Hq,Hkv,D", [(300, 2600, 32, 8, 128), (2000, 2100, 9, 3, 64)], ids=["8B", "135M"])
def test_prefix_attention_gpu(dtype, S, N, Hq, Hkv, D):
    _check("cuda", dtype, S, N, Hq, Hkv, D, seed=S)


def _check_gather(device, dtype, slots_total, N, Hkv, D, seed):
    from lazyrag.kernels.recompute import gather_rotated
    from lazyrag.kernels.reference import gather_rotated_reference, rope_tables

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots_total, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(slots_total, Hkv, D, generator=g).to(device, dtype)
    cos, sin = (t.to(device) for t in rope_tables(1.0 / 10000 ** (torch.arange(0, D, 2) / D), 4096))
    slots = torch.randperm(slots_total, generator=g)[:N].to(device)
    delta = torch.randint(0, 4096, (N,), generator=g).to(device)
    out_k, out_v = gather_rotated(k, v, slots, delta, cos, sin)
    ref_k, ref_v = gather_rotated_reference(k, v, slots, delta, cos, sin)
    assert out_k.dtype == out_v.dtype == dtype and out_k.shape == (N, Hkv, D)
    assert torch.equal(out_v, ref_v)  # a copy
    assert rel_err(out_k, ref_k) < (1e-6 if dtype == torch.float32 else 1e-2)
    # a rotation by 0 is the key itself
    zero_k, _ = gather_rotated(k, v, slots, torch.zeros_like(delta), cos, sin)
    assert rel_err(zero_k, k[slots]) < 1e-6


@pytest.mark.parametrize(
    "slots_total,N,Hkv,D",
    [(64, 40, 3, 16), (300, 257, 1, 64), (50, 50, 8, 32)],
    ids=["Hkv3-D16", "Hkv1-D64-tail", "Hkv8-D32"],
)
def test_gather_rotated_matches_reference(slots_total, N, Hkv, D):
    _check_gather("cpu", torch.float32, slots_total, N, Hkv, D, seed=N)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("slots_total,N,Hkv,D", [(40000, 20576, 8, 128), (5000, 2600, 3, 64)], ids=["8B", "135M"])
def test_gather_rotated_gpu(dtype, slots_total, N, Hkv, D):
    _check_gather("cuda", dtype, slots_total, N, Hkv, D, seed=N)
