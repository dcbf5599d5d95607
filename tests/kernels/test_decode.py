"""The decode kernel (kernels/decode.py) against the PyTorch reference, and its split rule.

On CPU the kernel runs in Triton's interpreter (tiny fp32 shapes); the ``gpu`` tests use bf16/fp16 and real-ish
shapes. Fresh random data, shuffled physical blocks, padded last blocks, NaN-poisoned outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lazyrag.kernels.common import pack_block_meta, unpack_block_meta
from lazyrag.kernels.decode import choose_splits, plan_decode
from lazyrag.kernels.kvloop import ROTATION_MODES, KernelOptions
from lazyrag.kernels.reference import lazy_decode_reference
from tests.kernels.helpers import (
    MAX_POS,
    gpu,
    gpu_docs,
    make_paged,
    make_rope,
    needs_cuda,
    prerotated,
    rel_err,
    run_decode,
    tuned_here,
)


@dataclass(frozen=True)
class DecodeCase:
    name: str
    seed: int
    docs: tuple  # per sequence: document lengths in tokens
    hq: int
    hkv: int
    d: int
    bs: int
    splits: int | None
    reuse_first_doc: bool = False


DECODE_CASES = [
    DecodeCase("mha-one-split-direct-write", 21, ((20, 9),), 2, 2, 64, 16, 1, reuse_first_doc=True),
    DecodeCase("gqa3-unequal-3-splits", 22, ((17, 40), (70,), (5,)), 6, 2, 64, 16, 3),
    DecodeCase("mqa-automatic-splits", 23, ((33, 12, 50),), 4, 1, 64, 16, None),
    DecodeCase("gqa8-d128-block32-2-splits", 24, ((12, 20), (7,)), 8, 1, 128, 32, 2),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_decode_matches_reference(case):
    gen = torch.Generator().manual_seed(case.seed)
    p = make_paged(
        gen,
        [list(s) for s in case.docs],
        case.hkv,
        case.d,
        case.bs,
        torch.float32,
        "cpu",
        reuse_first_doc=case.reuse_first_doc,
    )
    q = torch.randn(len(case.docs), case.hq, case.d, generator=gen)
    cos, sin = make_rope(case.d, "cpu")
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, case.d**-0.5)
    for mode in ROTATION_MODES:
        out = run_decode(p, q, cos, sin, case.d**-0.5, num_splits=case.splits, rotation_mode=mode)
        assert rel_err(out, ref) < 1e-4, mode


def test_decode_tile_spans_several_documents_and_wrong_rotation():
    gen = torch.Generator().manual_seed(25)
    p = make_paged(gen, [[5, 16, 3, 30, 2, 9]], 2, 64, 16, torch.float32, "cpu", reuse_first_doc=True)
    q = torch.randn(1, 4, 64, generator=gen)
    cos, sin = make_rope(64, "cpu")
    out = run_decode(p, q, cos, sin, 0.125, num_splits=2, config=(64, 1, 1))
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    assert rel_err(out, ref) < 1e-4
    for mode in ROTATION_MODES:  # every query-rotation schedule
        out = run_decode(p, q, cos, sin, 0.125, num_splits=3, config=(32, 1, 1), rotation_mode=mode)
        assert rel_err(out, ref) < 1e-4, mode
    ids, deltas, valid = unpack_block_meta(p.meta)
    wrong = pack_block_meta(ids, (deltas + 1) % MAX_POS, valid)
    bad = lazy_decode_reference(q, p.k_cache, p.v_cache, wrong, p.nblocks, cos, sin, 0.125)
    assert rel_err(out, bad) > 1e-2


def test_decode_no_rotation_on_prerotated_keys():
    gen = torch.Generator().manual_seed(26)
    p = make_paged(gen, [[18, 7], [25]], 2, 64, 16, torch.float32, "cpu")
    q = torch.randn(2, 4, 64, generator=gen)
    cos, sin = make_rope(64, "cpu")
    pre = prerotated(p, cos, sin)
    out = run_decode(pre, q, cos, sin, 0.125, apply_rotation=False, num_splits=2)
    ref = lazy_decode_reference(q, pre.k_cache, pre.v_cache, pre.meta, pre.nblocks, cos, sin, 0.125)
    assert rel_err(out, ref) < 1e-4
    assert rel_err(run_decode(p, q, cos, sin, 0.125, num_splits=2), out) < 1e-4


def test_choose_splits_fills_whole_waves():
    # 132 SMs: 4 programs/SM -> B=64 x 8 KV heads (512 programs) is one wave unsplit;
    # 3 programs/SM (396 slots) would run 1.29 waves unsplit, 3 splits fill 3.9 of 4
    assert choose_splits(512, 128, 132 * 4) == 1
    assert choose_splits(512, 128, 132 * 3) == 3
    s = choose_splits(8, 512, 132 * 4)  # batch 1: split until a wave is (nearly) full
    assert 8 * s <= 528 and 8 * s >= 0.9 * 528
    assert choose_splits(8, 8, 528) == 2  # too few tiles: at least 4 per split


def _plan(batch, hq, hkv, device, **options):
    gen = torch.Generator().manual_seed(batch)
    p = make_paged(gen, [[300, 200]] * batch, hkv, 128, 16, torch.bfloat16, device)
    return plan_decode(
        p.meta,
        p.nblocks,
        batch=batch,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device=torch.device(device),
        options=KernelOptions(**options),
        tile_cache={},
    )


def test_plan_in_the_interpreter():
    # the engine's CPU test path: ROT 5, the interpreter's config, up to 4 splits
    plan = _plan(2, 8, 2, "cpu")
    assert (plan.rot, plan.rotate, plan.config, plan.splits) == (5, True, (16, 1, 1, None), 4)
    forced = _plan(2, 8, 2, "cpu", decode_rotation_mode=2, decode_splits=1, decode_config=(32, 4, 3))
    assert (forced.rot, forced.splits, forced.config) == (2, 1, (32, 4, 3, None))


@gpu
@needs_cuda
def test_decode_gpu_plan_matches_the_tuned_choices():
    # one or two sequences (B * Hkv <= small_grid_programs): the small-grid config and ROT 2; else ROT 5 and the
    # default config, split to fill whole waves
    t = tuned_here()["decode"]
    small = _plan(1, 32, 8, "cuda")
    assert (small.rot, small.config) == (t["small_grid_rotation_mode"], tuple(t["small_grid_config"]))
    big = _plan(8, 32, 8, "cuda")
    assert (big.rot, big.config) == (t["rotation_mode"], tuple(t["config"]))


GPU_HEADS = [(32, 8, 128), (12, 4, 64), (8, 8, 128), (24, 3, 64)]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv,d", GPU_HEADS, ids=[f"hq{a}-hkv{b}-d{c}" for a, b, c in GPU_HEADS])
@pytest.mark.parametrize("splits", [None, 1, 5], ids=["auto", "unsplit", "5-splits"])
def test_decode_gpu(dtype, hq, hkv, d, splits):
    gen = torch.Generator().manual_seed(200 + hq + d)
    docs = gpu_docs(gen, 5, 5, 900) + [[3]]
    p = make_paged(gen, docs, hkv, d, 16, dtype, "cuda", reuse_first_doc=True)
    q = torch.randn(len(docs), hq, d, generator=gen).to(dtype).cuda()
    cos, sin = make_rope(d, "cuda", base=500000.0)
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, d**-0.5)
    out = run_decode(p, q, cos, sin, d**-0.5, num_splits=splits)
    assert rel_err(out, ref) < 1e-2
    pre = prerotated(p, cos, sin)
    off = run_decode(pre, q, cos, sin, d**-0.5, num_splits=splits, apply_rotation=False)
    ref0 = lazy_decode_reference(q, pre.k_cache, pre.v_cache, pre.meta, pre.nblocks, cos, sin, d**-0.5)
    assert rel_err(off, ref0) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 2], ids=["B1", "B2"])
def test_decode_gpu_small_grid(batch):
    # the small-grid path (ROT 2, 32-key tiles, many splits) at the e2e decode shape, every schedule
    gen = torch.Generator().manual_seed(450 + batch)
    p = make_paged(gen, gpu_docs(gen, batch, 6, 600), 8, 128, 16, torch.bfloat16, "cuda", reuse_first_doc=True)
    q = torch.randn(batch, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    cos, sin = make_rope(128, "cuda", base=500000.0)
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 128**-0.5)
    assert rel_err(run_decode(p, q, cos, sin, 128**-0.5), ref) < 1e-2
    for mode in ROTATION_MODES:
        assert rel_err(run_decode(p, q, cos, sin, 128**-0.5, rotation_mode=mode, num_splits=16), ref) < 1e-2


DECODE_CANDIDATES = [tuple(c) for c in tuned_here()["decode"]["candidates"]]


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", DECODE_CANDIDATES, ids=["bn{}-w{}-s{}-r{}".format(*c) for c in DECODE_CANDIDATES])
def test_decode_gpu_every_config(cfg):
    gen = torch.Generator().manual_seed(400)
    p = make_paged(
        gen, [[300, 45, 500], [1000], [17, 17, 17]], 8, 128, 32, torch.bfloat16, "cuda", reuse_first_doc=True
    )
    q = torch.randn(3, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    cos, sin = make_rope(128, "cuda")
    ref = lazy_decode_reference(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 128**-0.5)
    for splits in (1, 3):
        out = run_decode(p, q, cos, sin, 128**-0.5, num_splits=splits, config=cfg)
        assert rel_err(out, ref) < 1e-2, splits
