"""The skinny GEMM (kernels/gemm.py) against F.linear in float64, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import gpu, needs_cuda, rel_err, tuned_here

SKINNY_CANDIDATES = [tuple(c) for c in tuned_here()["gemm"]["candidates"]]


def _check_skinny(device, dtype, m, n, k, bias, config=None):
    """skinny_linear against F.linear in float64 on fresh random inputs; the output poisoned with NaN."""
    import torch.nn.functional as F

    from lazyrag.kernels.gemm import skinny_linear

    rnd = lambda *s, scale=1.0: (torch.randn(*s) * scale).to(device=device, dtype=dtype)  # noqa: E731
    x, w = rnd(m, k), rnd(n, k, scale=k**-0.5)
    b = rnd(n) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    got = skinny_linear(x, w, b, config=config, out=out)
    assert got is out
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (m, n, k, bias, config)


# token tiles 16, 16, 64, 64: masked rows but at 64
@pytest.mark.parametrize("m", [2, 7, 33, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("split", [1, 2, 4], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_skinny_linear_matches_linear(m, split, bias):
    # N = 37 and K = 100 are not multiples of BLOCK_N / BLOCK_K: the masked tails (and, at split 4, a split
    # whose last slice is partial)
    _check_skinny("cpu", torch.float32, m, 37, 100, bias, config=(16, 32, 4, 3, split))


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "config", SKINNY_CANDIDATES, ids=["n{}-k{}-w{}-s{}-split{}".format(*c) for c in SKINNY_CANDIDATES]
)
def test_skinny_gpu_every_candidate(config):
    """Each candidate on Llama-3.1-8B's projections (wqkv, wo, gate_up, down) in bf16, a full and a partial token
    tile."""
    for i, (n, k) in enumerate([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]):
        for m in (64, 7):
            _check_skinny("cuda", torch.bfloat16, m, n, k, bias=i == 0, config=config)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("m", [2, 40], ids=lambda m: f"m{m}")
def test_skinny_gpu_dtypes_and_tails(dtype, m):
    # K = 1000: a partial last BLOCK_K slice; N = 1000: a partial last program
    for config in (None, (64, 128, 4, 4, 2)):
        _check_skinny("cuda", dtype, m, 1000, 1000, True, config=config)
