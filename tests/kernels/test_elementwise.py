"""The elementwise kernels (kernels/elementwise.py) against the model's torch functions: norms, silu*up, greedy
argmax."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import gpu, needs_cuda, rel_err


def _check_elementwise(device, dtype, T, H, inter):
    from lazyrag.kernels import elementwise as E
    from lazyrag.model import llama

    torch.manual_seed(T + H)
    x, r = torch.randn(T, H, device=device, dtype=dtype), torch.randn(T, H, device=device, dtype=dtype)
    w = (1 + 0.3 * torch.randn(H, device=device)).to(dtype)
    gate_up = (2 * torch.randn(T, 2 * inter, device=device)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the model dtype apart at most
    h, y = E.add_rms_norm(x, r, w, 1e-5)
    rh, ry = llama.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, rh) and rel_err(y, ry) < tol
    assert rel_err(E.rms_norm(x, w, 1e-5), llama.rms_norm(x, w, 1e-5)) < tol
    ref = llama.silu_mul(gate_up.float(), inter)
    assert rel_err(E.silu_mul(gate_up, inter), ref) < tol
    # a strided view (a slice of a wider row), as the engine may hand the kernels
    wide = torch.randn(T, 2 * inter + 8, device=device, dtype=dtype)[:, 8:]
    assert rel_err(E.silu_mul(wide, inter), llama.silu_mul(wide.float(), inter)) < tol


@pytest.mark.parametrize(
    "T,H,inter", [(1, 48, 40), (5, 64, 72)], ids=["T1-H48-I40", "T5-H64-I72"]
)  # not powers of two: masked tails
def test_elementwise_kernels_match_torch(T, H, inter):
    _check_elementwise("cpu", torch.float32, T, H, inter)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 64, 300])
def test_elementwise_kernels_gpu(dtype, T):
    _check_elementwise("cuda", dtype, T, 4096, 14336)


def _check_head_rms_norm(device, dtype, T, hq, hkv, D):
    from lazyrag.kernels import elementwise as E
    from lazyrag.model import llama

    torch.manual_seed(T + D)
    qkv = (3 * torch.randn(T, (hq + 2 * hkv) * D, device=device)).to(dtype)
    qw, kw = ((1 + 0.3 * torch.randn(D, device=device)).to(dtype) for _ in range(2))
    q = llama.rms_norm(qkv[:, : hq * D].reshape(T * hq, D), qw, 1e-6).view(T, hq * D)
    k = llama.rms_norm(qkv[:, hq * D : (hq + hkv) * D].reshape(T * hkv, D), kw, 1e-6).view(T, hkv * D)
    v = qkv[:, (hq + hkv) * D :].clone()
    out = E.head_rms_norm(qkv, qw, kw, 1e-6, hq, hkv)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(out[:, : hq * D], q) < tol and rel_err(out[:, hq * D : (hq + hkv) * D], k) < tol
    assert torch.equal(out[:, (hq + hkv) * D :], v)


@pytest.mark.parametrize("T,hq,hkv,D", [(1, 4, 2, 16), (3, 6, 2, 24)], ids=["T1-D16", "T3-D24-masked"])
def test_head_rms_norm_matches_torch(T, hq, hkv, D):
    _check_head_rms_norm("cpu", torch.float32, T, hq, hkv, D)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 300])
def test_head_rms_norm_gpu(dtype, T):
    _check_head_rms_norm("cuda", dtype, T, 32, 8, 128)  # Qwen3-8B's heads


def _check_greedy_tokens(device, B, V):
    from lazyrag.kernels.elementwise import greedy_tokens

    torch.manual_seed(V)
    logits = torch.randn(B, V, device=device)
    logits[0, V // 3] = logits[0, V - 1] = logits[0].max() + 1  # a tie across chunks: the first one wins
    if B > 1:
        logits[1, 5] = logits[1, 6] = logits[1].max() + 1  # a tie inside a chunk
    if B > 2:
        logits[2, V - 2] = logits[2].max() + 1  # the maximum in the last (partial) chunk
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got.tolist() == logits.argmax(-1).tolist()
    assert (
        greedy_tokens(logits[:, : V - 3]).tolist() == logits[:, : V - 3].argmax(-1).tolist()
    )  # a strided view, masked tail


@pytest.mark.parametrize("B,V", [(1, 50), (3, 9000)], ids=["B1-V50", "B3-V9000"])
def test_greedy_tokens_match_torch(B, V):
    _check_greedy_tokens("cpu", B, V)


@gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 8])
def test_greedy_tokens_gpu(B):
    _check_greedy_tokens("cuda", B, 128256)
