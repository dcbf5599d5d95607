"""One-token projections (kernels/gemv.py) against the unfused path, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import gpu, needs_cuda, rel_err, tuned_here

GEMV_CANDIDATES = [tuple(c) for c in tuned_here()["gemv"]["candidates"]]


def _check_gemv(device, dtype, n, k, prologue, bias, config=None):
    """The fused GEMV against the unfused path: the elementwise step in the model dtype, then the product
    in float64. Fresh random inputs; the output poisoned with NaN."""
    import torch.nn.functional as F

    from lazyrag.kernels import gemv as G
    from lazyrag.model.llama import add_rms_norm, rms_norm, silu_mul

    eps = 1e-5
    rnd = lambda *s, scale=1.0: (torch.randn(*s) * scale).to(device=device, dtype=dtype)  # noqa: E731
    x = rnd(1, 2 * k if prologue == G.SILU else k)
    r, nw, w = rnd(1, k), (1 + 0.2 * torch.randn(k)).to(device=device, dtype=dtype), rnd(n, k, scale=k**-0.5)
    b = rnd(n) if bias else None
    h_ref = None
    if prologue == G.PLAIN:
        xin = x
    elif prologue == G.NORM:
        xin = rms_norm(x, nw, eps)
    elif prologue == G.ADD_NORM:
        h_ref, xin = add_rms_norm(x, r, nw, eps)
    else:
        xin = silu_mul(x, k)
    ref = F.linear(xin.double(), w.double(), None if b is None else b.double())
    out = torch.full((1, n), float("nan"), device=device, dtype=dtype)
    got = G.gemv(x, w, b, prologue=prologue, residual=r, norm_weight=nw, eps=eps, config=config, out=out)
    if prologue == G.ADD_NORM:
        h, got = got
        assert torch.equal(h, h_ref)  # the residual stream, rounded as the unfused add rounds it
    assert got is out
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("prologue", [0, 1, 2, 3], ids=["plain", "norm", "add-norm", "silu"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("config", [(8, 128, 4, 1), (8, 32, 4, 3), (8, 32, 4)], ids=["one-shot", "pipelined", "plain"])
def test_gemv_matches_unfused(prologue, bias, config):
    # N=37, K=80 not multiples of the blocks: masked N and K tails (one-shot: K padded to 128; the loop: a partial
    # last tile); the old 3-tuple config is the plain loop
    _check_gemv("cpu", torch.float32, 37, 80, prologue, bias, config=config)


def test_gemv_resolve():
    from lazyrag.kernels.gemv import resolve

    assert resolve((2, 4096, 4), 4096) == (2, 4096, 4, 1)  # one-shot, old 3-tuple
    assert resolve((1, 16384, 8, 1), 4096) == (1, 4096, 8, 1) == resolve((1, 4096, 8, 1), 4096)  # the same launch
    assert resolve((1, 16384, 8, 1), 14336) == (1, 16384, 8, 1)
    assert resolve((4, 1024, 4, 3), 14336) == (4, 1024, 4, 3) and resolve((4, 1024, 4, 3), 1000) == (4, 1024, 4, 1)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "n,k,prologue",
    [(6144, 4096, 1), (6144, 4096, 2), (4096, 4096, 0), (28672, 4096, 2), (4096, 14336, 3)],
    ids=["wqkv-norm", "wqkv-add-norm", "wo", "gate-up-add-norm", "down-silu"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gemv_gpu(n, k, prologue, dtype):
    _check_gemv("cuda", dtype, n, k, prologue, False)


@gpu
@needs_cuda
@pytest.mark.parametrize("config", GEMV_CANDIDATES, ids=["n{}-k{}-w{}-s{}".format(*c) for c in GEMV_CANDIDATES])
def test_gemv_gpu_every_candidate(config):
    for prologue in range(4):
        _check_gemv("cuda", torch.bfloat16, 1000, 1500, prologue, prologue == 0, config=config)


def test_tuned_config_per_shape():
    # the measured shapes (Llama-3.1-8B's projections) and the default for any other
    from lazyrag.kernels import gemv as G

    cpu = torch.device("cpu")
    assert G.config_for(4096, 14336, G.SILU, cpu) == (8, 512, 4, 3)
    assert G.config_for(6144, 4096, G.NORM, cpu) == G.config_for(6144, 4096, G.ADD_NORM, cpu) == (2, 4096, 8, 1)
    assert G.config_for(37, 80, G.PLAIN, cpu) == (8, 512, 4, 1)
