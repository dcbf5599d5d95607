"""The prefill kernels (kernels/prefill.py, kernels/prefill_wgmma.py) against the PyTorch reference, and the
choices their plan makes.

On CPU the Triton kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), so those shapes
are tiny and fp32; the ``gpu`` tests use bf16/fp16 and real-ish shapes. Every case draws fresh random data,
shuffles the physical block ids, pads the last block of each document, and poisons the output with NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lazyrag.kernels.common import pack_block_meta, unpack_block_meta
from lazyrag.kernels.kvloop import ROTATION_MODES, KernelOptions
from lazyrag.kernels.prefill import plan_prefill
from lazyrag.kernels.reference import lazy_decode_reference
from tests.kernels.helpers import (
    MAX_POS,
    Paged,
    gpu,
    gpu_docs,
    make_prefill,
    make_rope,
    needs_cuda,
    needs_hopper,
    prerotated,
    ref_prefill,
    rel_err,
    rotated_in_place,
    run_decode,
    run_prefill,
    tuned_here,
)


@dataclass(frozen=True)
class PrefillCase:
    name: str
    seed: int
    new_lens: tuple  # new tokens per sequence
    docs: tuple  # per sequence: document lengths in tokens
    hq: int
    hkv: int
    d: int
    bs: int
    splits: int | None = None
    reuse_first_doc: bool = False

    def build(self, dtype=torch.float32, device="cpu"):
        return make_prefill(
            self.seed,
            list(self.new_lens),
            [list(s) for s in self.docs],
            self.hq,
            self.hkv,
            self.d,
            self.bs,
            dtype,
            device,
            reuse_first_doc=self.reuse_first_doc,
        )


def ids(cases):
    return [c.name for c in cases]


# ---------------------------------------------------------------- CPU (interpreter), fp32
PREFILL_CASES = [
    PrefillCase("mha-two-docs-reused", 1, (5,), ((20, 9),), 2, 2, 64, 16, reuse_first_doc=True),
    PrefillCase("gqa3-unequal-batch", 2, (3, 6), ((17,), (16, 40)), 6, 2, 64, 16),
    PrefillCase("gqa4-empty-query-no-ctx", 3, (4, 0, 2), ((33, 5), (8,), ()), 4, 1, 64, 16),
    PrefillCase("gqa8-d128-block32", 4, (2,), ((12, 20, 7),), 8, 1, 128, 32),
    PrefillCase("40-new-unmasked-tiles", 5, (40, 3), ((20,), (9, 30)), 4, 2, 64, 16),  # tiles before the diagonal
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=ids(PREFILL_CASES))
def test_prefill_matches_reference(case):
    p, q, kn, vn, cu = case.build()
    cos, sin = make_rope(case.d, "cpu")
    scale = case.d**-0.5
    out = run_prefill(p, q, kn, vn, cu, cos, sin, scale)
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, scale)) < 1e-4


def test_prefill_tile_spans_several_documents():
    # one-block documents and a 4-page KV tile: every tile straddles segment boundaries,
    # and the same document sits at two offsets
    p, q, kn, vn, cu = make_prefill(
        11, [3], [[5, 16, 3, 30, 2]], 4, 2, 64, 16, torch.float32, "cpu", reuse_first_doc=True
    )
    cos, sin = make_rope(64, "cpu")
    out = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125, config=(16, 64, 1, 1))
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)) < 1e-4


def test_prefill_wrong_rotation_is_detected():
    p, q, kn, vn, cu = make_prefill(12, [4], [[20, 24]], 2, 1, 64, 16, torch.float32, "cpu")
    cos, sin = make_rope(64, "cpu")
    out = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    ids_, deltas, valid = unpack_block_meta(p.meta)
    wrong = pack_block_meta(ids_, (deltas + 1) % MAX_POS, valid)  # off by one position
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)) < 1e-4
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125, meta=wrong)) > 1e-2


def test_prefill_no_rotation_on_prerotated_keys():
    p, q, kn, vn, cu = make_prefill(13, [3, 2], [[18, 7], [25]], 4, 2, 64, 16, torch.float32, "cpu")
    cos, sin = make_rope(64, "cpu")
    pre = prerotated(p, cos, sin)
    out = run_prefill(pre, q, kn, vn, cu, cos, sin, 0.125, apply_rotation=False)
    assert rel_err(out, ref_prefill(pre, q, kn, vn, cu, cos, sin, 0.125)) < 1e-4
    lazy = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    assert rel_err(lazy, out) < 1e-4


SPLIT_CASES = [
    PrefillCase("mha-repeated-doc-3-splits", 31, (5,), ((20, 9, 40),), 2, 2, 64, 16, splits=3, reuse_first_doc=True),
    PrefillCase("gqa3-unequal-empty-2-splits", 32, (3, 6, 0), ((17,), (16, 40, 33), ()), 6, 2, 64, 16, splits=2),
    PrefillCase("mqa-4-splits", 33, (4, 1), ((33, 5), (8, 70)), 4, 1, 64, 16, splits=4),
    PrefillCase("gqa8-d128-7-splits-some-empty", 34, (2,), ((12, 20, 7, 45),), 8, 1, 128, 32, splits=7),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=ids(SPLIT_CASES))
def test_prefill_split_context_matches_reference(case):
    # context split over programs + merge kernel (the path short prefills take on the GPU), every schedule
    p, q, kn, vn, cu = case.build()
    cos, sin = make_rope(case.d, "cpu")
    scale = case.d**-0.5
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, scale)
    pre = prerotated(p, cos, sin)
    for mode in ROTATION_MODES:
        out = run_prefill(p, q, kn, vn, cu, cos, sin, scale, num_splits=case.splits, rotation_mode=mode)
        assert rel_err(out, ref) < 1e-4, mode
        off = run_prefill(
            pre, q, kn, vn, cu, cos, sin, scale, apply_rotation=False, num_splits=case.splits, rotation_mode=mode
        )
        assert rel_err(off, ref) < 1e-4, mode


def test_rotation_off_in_the_lazy_layout():
    # the benchmark's fair baseline: the same shuffled blocks and metas, K re-rotated in place; each schedule's
    # loop with the rotation off (prefill and decode)
    p, q, kn, vn, cu = make_prefill(35, [3, 2], [[18, 7], [25]], 4, 2, 64, 16, torch.float32, "cpu")
    cos, sin = make_rope(64, "cpu")
    pre = rotated_in_place(p, cos, sin)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    qd = torch.randn(2, 4, 64)
    refd = lazy_decode_reference(qd, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    for mode in ROTATION_MODES:
        off = run_prefill(pre, q, kn, vn, cu, cos, sin, 0.125, apply_rotation=False, rotation_mode=mode)
        assert rel_err(off, ref) < 1e-4, mode
        offd = run_decode(pre, qd, cos, sin, 0.125, apply_rotation=False, num_splits=2, rotation_mode=mode)
        assert rel_err(offd, refd) < 1e-4, mode


def test_documents_sharing_a_delta_after_a_partial_block():
    # two neighbouring documents with one delta: the first one's partly filled last block sits inside the
    # run of equal deltas, so it must end its tile (ROT 5 masks a tile's keys as one prefix)
    p, q, kn, vn, cu = make_prefill(27, [5], [[17, 40, 9]], 4, 2, 64, 16, torch.float32, "cpu")
    ids_, deltas, valid = unpack_block_meta(p.meta)
    deltas[0, 2:5] = deltas[0, 0]  # blocks 0-1: 17 tokens (block 1 holds 1), blocks 2-4: 40 tokens
    p.meta.copy_(pack_block_meta(ids_, deltas, valid))
    cos, sin = make_rope(64, "cpu")
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    qd = torch.randn(1, 4, 64)
    refd = lazy_decode_reference(qd, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    for mode in ROTATION_MODES:
        for splits in (1, 2):
            out = run_prefill(
                p, q, kn, vn, cu, cos, sin, 0.125, num_splits=splits, rotation_mode=mode, config=(16, 64, 1, 1)
            )
            assert rel_err(out, ref) < 1e-4, (mode, splits)
            outd = run_decode(p, qd, cos, sin, 0.125, num_splits=splits, config=(64, 1, 1), rotation_mode=mode)
            assert rel_err(outd, refd) < 1e-4, (mode, splits)


def _plan(case: PrefillCase, device="cpu", **options):
    p, q, kn, vn, cu = case.build(torch.float32 if device == "cpu" else torch.bfloat16, device)
    return plan_prefill(
        cu,
        p.meta,
        p.nblocks,
        num_heads=case.hq,
        num_kv_heads=case.hkv,
        head_dim=case.d,
        block_size=case.bs,
        dtype=q.dtype,
        device=q.device,
        options=KernelOptions(**options),
        tile_cache={},
    )


def test_plan_in_the_interpreter():
    # what the engine's CPU test path runs: the Triton kernel, ROT 5, the interpreter's config, no split
    plan = _plan(PREFILL_CASES[1])
    assert (plan.kernel, plan.rot, plan.rotate, plan.splits) == ("triton", 5, True, 1)
    assert plan.config == (16, 16, 1, 1) and plan.tiles is not None
    forced = _plan(PREFILL_CASES[1], prefill_rotation_mode=7, prefill_splits=3, apply_rotation=False)
    assert (forced.rot, forced.splits, forced.rotate) == (7, 3, False)
    with pytest.raises(AssertionError, match="rotation_mode"):
        _plan(PREFILL_CASES[1], prefill_rotation_mode=1)  # a schedule that is no longer shipped


# ---------------------------------------------------------------- GPU, bf16/fp16
GPU_HEADS = [(32, 8, 128), (12, 4, 64), (8, 8, 128), (24, 3, 64)]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv,d", GPU_HEADS, ids=[f"hq{a}-hkv{b}-d{c}" for a, b, c in GPU_HEADS])
@pytest.mark.parametrize(
    "kernel,cfg",
    [pytest.param(None, None, id="default"), pytest.param("triton", None, id="triton")]
    + [
        pytest.param("wgmma", cfg, marks=needs_hopper, id="wgmma-{}x{}-w{}-s{}".format(*cfg))
        for cfg in [(128, 128, 12, 3), (128, 64, 12, 4)]
    ],
)
def test_prefill_gpu(dtype, hq, hkv, d, kernel, cfg):
    # the default kernel (Hopper: the wgmma one), the Triton one, and the wgmma one in other configs, against the
    # reference: documents reused at other offsets, partial blocks, a sequence without context, G not dividing the
    # tile's rows (hq=12, hkv=4: a token's heads then straddle the two consumers), rotation on and off
    gen = torch.Generator().manual_seed(100 + hq + d)
    docs = gpu_docs(gen, 3, 4, 700) + [[]]
    new_lens = [130, 7, 64, 300]
    p, q, kn, vn, cu = make_prefill(hq * 7 + d, new_lens, docs, hq, hkv, d, 16, dtype, "cuda", reuse_first_doc=True)
    cos, sin = make_rope(d, "cuda", base=500000.0)
    scale = d**-0.5
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, scale)
    out = run_prefill(p, q, kn, vn, cu, cos, sin, scale, kernel=kernel, config=cfg)
    assert rel_err(out, ref) < 1e-2
    pre = prerotated(p, cos, sin)
    off = run_prefill(pre, q, kn, vn, cu, cos, sin, scale, apply_rotation=False, kernel=kernel, config=cfg)
    assert rel_err(off, ref_prefill(pre, q, kn, vn, cu, cos, sin, scale)) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "hq,hkv,d", [(32, 8, 128), (24, 3, 64), (8, 8, 128)], ids=["hq32-hkv8-d128", "hq24-hkv3-d64", "hq8-hkv8-d128"]
)
@pytest.mark.parametrize("splits", [None, 1, 7], ids=["auto", "unsplit", "7-splits"])
def test_prefill_gpu_split_context(hq, hkv, d, splits):
    # short prefill (few query tiles): the automatic split over the context, forced splits too; every schedule
    gen = torch.Generator().manual_seed(600 + hq + d)
    docs = gpu_docs(gen, 2, 6, 900)
    p, q, kn, vn, cu = make_prefill(hq + d, [64, 9], docs, hq, hkv, d, 16, torch.bfloat16, "cuda", reuse_first_doc=True)
    cos, sin = make_rope(d, "cuda", base=500000.0)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, d**-0.5)
    assert rel_err(run_prefill(p, q, kn, vn, cu, cos, sin, d**-0.5, num_splits=splits), ref) < 1e-2
    pre = prerotated(p, cos, sin)
    ref0 = ref_prefill(pre, q, kn, vn, cu, cos, sin, d**-0.5)
    off = run_prefill(pre, q, kn, vn, cu, cos, sin, d**-0.5, apply_rotation=False, num_splits=splits)
    assert rel_err(off, ref0) < 1e-2
    for mode in ROTATION_MODES:
        out = run_prefill(p, q, kn, vn, cu, cos, sin, d**-0.5, num_splits=splits, rotation_mode=mode)
        assert rel_err(out, ref) < 1e-2, mode
        off = run_prefill(
            pre, q, kn, vn, cu, cos, sin, d**-0.5, apply_rotation=False, num_splits=splits, rotation_mode=mode
        )
        assert rel_err(off, ref0) < 1e-2, mode


@gpu
@needs_cuda
def test_prefill_gpu_plan_matches_the_tuned_choices():
    # the engine's selections: a short prefill (few programs) takes the short config, ROT 7 and a split; a full
    # one the wgmma kernel on Hopper, else the Triton kernel with ROT 5 and the default config
    from lazyrag.kernels import prefill_wgmma

    t = tuned_here()
    short = _plan(PrefillCase("short", 1, (64,), ((512,) * 5,), 32, 8, 128, 16), device="cuda")
    assert (short.kernel, short.rot, short.config) == (
        "triton",
        t["prefill"]["short_rotation_mode"],
        tuple(t["prefill"]["short_config"]),
    )
    assert short.splits > 1
    full = _plan(PrefillCase("full", 1, (512,) * 8, ((2048,),) * 8, 32, 8, 128, 16), device="cuda")
    if (
        prefill_wgmma.supported(torch.bfloat16, 128, torch.device("cuda"), 16, 64)
        and prefill_wgmma.disabled_because is None
    ):
        assert (full.kernel, full.config) == ("wgmma", tuple(t["prefill_wgmma"]["config"]))
    else:
        assert (full.kernel, full.rot, full.config) == (
            "triton",
            t["prefill"]["rotation_mode"],
            tuple(t["prefill"]["config"]),
        )


@gpu
@needs_hopper
@pytest.mark.parametrize("bs", [16, 32, 64], ids=["block16", "block32", "block64"])
def test_prefill_wgmma_gpu_many_short_documents(bs):
    # many documents shorter than a tile, block sizes up to a 64-key tile: packed tiles (mixed ones hold keys of
    # several documents, rotated in shared memory); then every document at one offset, so that mixed tiles (valid
    # keys not a prefix) have nothing to rotate
    gen = torch.Generator().manual_seed(950 + bs)
    docs = [[int(x) for x in torch.randint(1, 200, (12,), generator=gen)] for _ in range(2)]
    p, q, kn, vn, cu = make_prefill(bs, [512, 333], docs, 32, 8, 128, bs, torch.bfloat16, "cuda")
    cos, sin = make_rope(128, "cuda", base=500000.0)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5)
    ids_, deltas, valid = unpack_block_meta(p.meta)
    one_offset = Paged(
        p.k_cache, p.v_cache, pack_block_meta(ids_, torch.full_like(deltas, 77), valid), p.nblocks, p.docs
    )
    ref_one = ref_prefill(one_offset, q, kn, vn, cu, cos, sin, 128**-0.5)
    for cfg in ((128, 128, 12, 3), (128, 64, 12, 6)):
        out = run_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5, kernel="wgmma", config=cfg)
        assert rel_err(out, ref) < 1e-2, cfg
        out = run_prefill(one_offset, q, kn, vn, cu, cos, sin, 128**-0.5, kernel="wgmma", config=cfg)
        assert rel_err(out, ref_one) < 1e-2, cfg


def test_prefill_wgmma_disable_warns_once(monkeypatch):
    # what run_prefill calls when the Gluon kernel fails to build: one warning that says what happens and what to
    # do, then the kernel is no longer chosen by default
    import warnings

    from lazyrag.kernels import prefill_wgmma

    monkeypatch.setattr(prefill_wgmma, "disabled_because", None)
    with pytest.warns(RuntimeWarning, match="Triton kernel from now on.*kernel='wgmma'"):
        prefill_wgmma.disable("CompilationError: at 1:2")
    assert prefill_wgmma.disabled_because == "CompilationError: at 1:2"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prefill_wgmma.disable("a second failure")  # no second warning


@gpu
@needs_hopper
def test_prefill_wgmma_build_failure_falls_back(monkeypatch):
    # a Triton whose Gluon API moved: the default prefill warns once and runs the Triton kernel from then on (the
    # plan's other layers too); asking for the wgmma kernel by name shows the error
    from lazyrag.kernels import prefill_wgmma

    p, q, kn, vn, cu = make_prefill(77, [512, 300], [[900, 300], [1200]], 32, 8, 128, 16, torch.bfloat16, "cuda")
    cos, sin = make_rope(128, "cuda", base=500000.0)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated Gluon API change")

    monkeypatch.setattr(prefill_wgmma, "lazy_prefill_wgmma", broken)
    monkeypatch.setattr(prefill_wgmma, "disabled_because", None)
    with pytest.warns(RuntimeWarning, match="Triton kernel"):
        out = run_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5)
    assert rel_err(out, ref) < 1e-2
    assert "simulated" in prefill_wgmma.disabled_because
    assert rel_err(run_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5), ref) < 1e-2  # no second warning needed
    with pytest.raises(RuntimeError, match="simulated"):
        run_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5, kernel="wgmma")


PREFILL_CANDIDATES = [tuple(c) for c in tuned_here()["prefill"]["candidates"]]


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", PREFILL_CANDIDATES, ids=["{}x{}-w{}-s{}".format(*c) for c in PREFILL_CANDIDATES])
def test_prefill_gpu_every_config(cfg):
    # the autotuner may pick any of these: each must be right, block size 32 too
    p, q, kn, vn, cu = make_prefill(
        300, [77, 200], [[300, 45, 500], [1000]], 32, 8, 128, 32, torch.bfloat16, "cuda", reuse_first_doc=True
    )
    cos, sin = make_rope(128, "cuda")
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5)
    for splits in (1, 3):
        out = run_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5, config=cfg, num_splits=splits)
        assert rel_err(out, ref) < 1e-2, splits


@gpu
@needs_cuda
def test_prefill_gpu_split_replays_from_a_cuda_graph():
    # the TTFT shape (64 new tokens over 5 documents of 512: split context, then the merge launch), planned and
    # captured as the engine does: a plan made inside the capture, its tile table rebuilt on every replay
    from lazyrag.kernels.prefill import run_prefill as run_plan

    case = PrefillCase("ttft", 470, (64,), ((512,) * 5,), 32, 8, 128, 16)
    p, q, kn, vn, cu = case.build(torch.bfloat16, "cuda")
    cos, sin = make_rope(128, "cuda", base=500000.0)
    ref = ref_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5)
    for _ in range(2):  # the second call runs at the occupancy the first one recorded, as the capture does
        first = run_prefill(p, q, kn, vn, cu, cos, sin, 128**-0.5, max_seqlen_q=64, tile_cache={})
    assert rel_err(first, ref) < 1e-2
    outs = [torch.full_like(first, float("nan")) for _ in range(4)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = plan_prefill(
            cu,
            p.meta,
            p.nblocks,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            block_size=16,
            dtype=q.dtype,
            device=q.device,
            max_seqlen_q=64,
            tile_cache={},
        )
        for o in outs:  # one per layer
            run_plan(plan, q, kn, vn, p.k_cache, p.v_cache, cos, sin, 128**-0.5, out=o)
    assert plan.splits > 1
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, first) for o in outs)


@gpu
@needs_cuda
def test_fp32_gpu():
    p, q, kn, vn, cu = make_prefill(
        500, [40, 9], [[100, 37], [64]], 8, 2, 64, 16, torch.float32, "cuda", reuse_first_doc=True
    )
    cos, sin = make_rope(64, "cuda")
    out = run_prefill(p, q, kn, vn, cu, cos, sin, 0.125)
    assert rel_err(out, ref_prefill(p, q, kn, vn, cu, cos, sin, 0.125)) < 1e-4
    qd = torch.randn(2, 8, 64, device="cuda")
    outd = run_decode(p, qd, cos, sin, 0.125)
    refd = lazy_decode_reference(qd, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, 0.125)
    assert rel_err(outd, refd) < 1e-4
