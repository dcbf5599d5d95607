"""The engine's equivalences with each attention backend: the PyTorch reference and the Triton kernels.

Prompts are random token ids (no tokenizer), so this also runs on a GPU machine without the
default model. On CPU the Triton kernels run in the interpreter (small shapes); on CUDA the
same tests run in bf16 and fp32, with CUDA graphs.
"""

import random
from dataclasses import dataclass

import pytest
import torch

from lazyrag.engine import LazyEngine, SamplingParams
from lazyrag.model.llama import GEMV_LAYERS
from lazyrag.prompt import PromptLayout
from tests.conftest import tiny_family_model, tiny_llama_config

CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class BackendCase:
    device: str
    attention: str
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"{self.device}-{self.attention}-{str(self.dtype).removeprefix('torch.')}"


# Triton on CPU means its interpreter, which tests/conftest.py turns on only where there is no GPU.
CASES = [BackendCase("cpu", "torch", torch.float32)] + ([] if CUDA else [BackendCase("cpu", "triton", torch.float32)])
if CUDA:
    CASES += [
        BackendCase("cuda", "triton", torch.float32),
        BackendCase("cuda", "triton", torch.bfloat16),
        BackendCase("cuda", "torch", torch.bfloat16),
    ]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    # head_dim 64: the kernels take 64 or 128; 4 query heads over 2 KV heads (GQA)
    hf = LlamaForCausalLM(tiny_llama_config(vocab_size=512, hidden_size=128, head_dim=64)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.normal_(0, 0.15)
    return hf


def random_layout(seed: int, vocab: int = 512, repeat_chunk: bool = True) -> PromptLayout:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    chunks = [ids(n) for n in (17, 40, 5, 33)]
    rng.shuffle(chunks)
    if repeat_chunk:
        chunks.insert(rng.randrange(len(chunks)), chunks[0])  # one chunk at two positions
    return PromptLayout(prefix_ids=ids(21), chunk_ids=chunks, question_ids=ids(9))


def tolerance(dtype):
    # bf16: our fused qkv / gate-up matmuls round differently from transformers' separate ones
    # (measured 3.4e-2 on the H200 for this random model); fp32 keeps the tight check.
    return 1e-4 if dtype == torch.float32 else 6e-2


def rel_err(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


@pytest.fixture(params=CASES, ids=[c.name for c in CASES], scope="module")
def case(request, hf_model):
    c = request.param
    engine = LazyEngine.from_hf(
        hf_model, None, device=c.device, dtype=c.dtype, attention=c.attention, kv_budget=32 << 20
    )
    return engine, hf_model, c.dtype


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_other_families_match_transformers_on_each_backend(family, c):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms through each backend (Triton: the fused K/V store and
    the attention kernels; the interpreter on CPU): full prefill equals transformers, cached chunks read at new
    positions equal position-aware prefill."""
    if c.attention == "triton" and c.device == "cpu" and family == "qwen2":
        pytest.skip("the interpreter is slow: Qwen2's biases are torch's linears, on the kernels' path only on CUDA")
    hf = tiny_family_model(family, seed=7, vocab_size=512, hidden_size=128, head_dim=64)
    engine = LazyEngine.from_hf(hf, None, device=c.device, dtype=c.dtype, attention=c.attention, kv_budget=32 << 20)
    layout = random_layout(3)
    with torch.no_grad():  # the fp32 truth: transformers' own bf16 is further from it than ours (Qwen2's biases: 8e-2)
        expected = hf.to(c.device, torch.float32)(torch.tensor([layout.full_ids()], device=c.device)).logits[0, -1]
    assert rel_err(engine.layout_logits(layout, "full"), expected) < tolerance(c.dtype)
    assert rel_err(engine.layout_logits(layout, "lazy"), engine.layout_logits(layout, "position_aware")) < tolerance(
        c.dtype
    )


@pytest.mark.parametrize("seed", [0, 1], ids=["seed0", "seed1"])
def test_lazy_equals_position_aware(case, seed):
    engine, _, dtype = case
    layout = random_layout(seed)
    lazy = engine.layout_logits(layout, "lazy")
    aware = engine.layout_logits(layout, "position_aware")
    assert rel_err(lazy, aware) < tolerance(dtype)
    if dtype == torch.float32:
        a = engine.submit(layout, SamplingParams(max_new_tokens=8)).result()
        b = engine.submit(layout, SamplingParams(max_new_tokens=8, strategy="position_aware")).result()
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8


def test_full_matches_transformers_and_one_chunk_lazy_equals_full(case):
    engine, hf, dtype = case
    layout = random_layout(3, repeat_chunk=False)
    with torch.no_grad():
        expected = hf(torch.tensor([layout.full_ids()])).logits[0, -1]
    assert rel_err(engine.layout_logits(layout, "full"), expected) < tolerance(dtype)
    one = PromptLayout(layout.prefix_ids, layout.chunk_ids[:1], layout.question_ids)
    assert rel_err(engine.layout_logits(one, "lazy"), engine.layout_logits(one, "full")) < tolerance(dtype)


def test_reuse_at_new_position_runs_only_the_question(case):
    engine, _, _ = case
    layout = random_layout(4)
    engine.submit(layout, SamplingParams(max_new_tokens=1)).result()
    moved = PromptLayout(layout.prefix_ids, layout.chunk_ids[::-1], layout.question_ids)
    before = engine.runner.tokens_forwarded
    r = engine.submit(moved, SamplingParams(max_new_tokens=1)).result()
    assert r.stats.chunks_missed == 0
    assert engine.runner.tokens_forwarded - before == len(layout.question_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_decode_matches_eager(hf_model):
    layout = random_layout(5)
    params = SamplingParams(max_new_tokens=12)
    graphs = LazyEngine.from_hf(hf_model, None, device="cuda", dtype=torch.float32, kv_budget=32 << 20)
    eager = LazyEngine.from_hf(
        hf_model, None, device="cuda", dtype=torch.float32, kv_budget=32 << 20, cuda_graphs=False
    )
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    a = graphs.submit(layout, params).result()
    b = eager.submit(layout, params).result()
    assert a.token_ids == b.token_ids
    assert graphs.runner.graphs.graphs  # something was captured and replayed


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_async_scheduling_matches_synchronous_steps(hf_model, cuda_graphs):
    """On by default with CUDA: each greedy decode step is launched on the previous step's device tokens (copied
    into the graph's input buffer) before the host reads them. Same tokens as stepping synchronously, batched
    and alone, with a request that stops on an end token one launched step before the others."""
    engine = LazyEngine.from_hf(
        hf_model, None, device="cuda", dtype=torch.float32, kv_budget=32 << 20, cuda_graphs=cuda_graphs
    )
    sched = engine.scheduler
    assert sched.async_scheduling
    layouts = [random_layout(30 + i) for i in range(3)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 5)]

    def run_all(ps):
        reqs = [engine.add_request(lay, p) for lay, p in zip(layouts, ps)]
        while engine.has_unfinished_requests():
            engine.step()
        return [r.result() for r in reqs]

    sched.async_scheduling = False
    sync = run_all(params)
    sched.end_tokens = {sync[1].token_ids[6]}  # the second request stops at its 7th token
    params[1] = SamplingParams(max_new_tokens=14)
    sync_stop = run_all(params)
    assert sync_stop[1].finish_reason == "stop"
    sched.async_scheduling = True
    free = engine.cache.pool.num_free
    assert [r.token_ids for r in run_all(params)] == [r.token_ids for r in sync_stop]
    sched.end_tokens = set()
    assert engine.submit(layouts[0], params[0]).result().token_ids == sync[0].token_ids
    assert not engine.has_unfinished_requests() and engine.cache.pool.num_free == free


def test_compiled_elementwise_ops_match_eager():
    """The fused (torch.compile) versions used on CUDA compute the same as the plain functions."""
    from lazyrag.model.llama import ElementwiseOps

    torch.manual_seed(0)
    eager, fused = ElementwiseOps(), ElementwiseOps.compiled()
    T, H, D, hq, hkv = 7, 64, 16, 4, 2
    x, r, w = torch.randn(T, H), torch.randn(T, H), torch.randn(H)
    qkv, cos, sin = torch.randn(T, (hq + 2 * hkv) * D), torch.randn(T, 1, D // 2), torch.randn(T, 1, D // 2)
    pairs = [
        ((eager.rms_norm(x, w, 1e-5),), (fused.rms_norm(x, w, 1e-5),)),
        (eager.add_rms_norm(x, r, w, 1e-5), fused.add_rms_norm(x, r, w, 1e-5)),
        (eager.rotate_qk(qkv, cos, sin, 1.5, hq, hkv), fused.rotate_qk(qkv, cos, sin, 1.5, hq, hkv)),
        ((eager.silu_mul(qkv, 64),), (fused.silu_mul(qkv, 64),)),
    ]
    for want, got in pairs:
        for a, b in zip(want, got):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_batched_requests_match_one_at_a_time(case):
    """The scheduler's batched prefill and decode (CUDA graphs per batch size on the GPU) change no token."""
    engine, _, dtype = case
    if dtype != torch.float32:
        pytest.skip("bf16 batches round differently from single requests; the fp32 cases check the tokens")
    layouts = [random_layout(10 + i) for i in range(5)]
    strategies = ["lazy", "position_aware", "full", "prefix", "lazy:first=16"]
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=True, strategy=s) for n, s in zip((4, 11, 6, 9, 7), strategies)
    ]
    alone = [engine.submit(lay, p).result().token_ids for lay, p in zip(layouts, params)]
    prefills = engine.scheduler.steps["prefill"]
    reqs = [engine.add_request(lay, p) for lay, p in zip(layouts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.result().token_ids for r in reqs] == alone
    assert engine.scheduler.steps["prefill"] == prefills + 1  # all five prefilled in one batch


def test_blending_every_chunk_token_equals_full_prefill(case):
    """CacheBlend's dense recompute path (engine/blend.py) with each backend: R=1 is a full prefill."""
    engine, _, dtype = case
    layout = random_layout(20, repeat_chunk=False)
    assert rel_err(engine.layout_logits(layout, "lazy:blend=1"), engine.layout_logits(layout, "full")) < tolerance(
        dtype
    )


@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
def test_host_batch_one_buffer_padded(is_decode):
    """A step's inputs travel in one int64 buffer (engine/runner.py HostBatch); laid out for a larger
    captured shape, the padding is inert: scratch slot, no context, one padding token per decode row."""
    import numpy as np

    from lazyrag.model.attention import HostBatch

    metas = [np.array([5, 7, 9], np.int64), np.array([11], np.int64)]
    n = [1, 1] if is_decode else [3, 2]
    T = sum(n)
    cu = np.concatenate(([0], np.cumsum(n)))
    hb = HostBatch(is_decode, np.arange(100, 100 + T), np.arange(T) + 40, np.arange(T) + 200, metas, cu, max(n))
    for shape in ((T, 2, 3), (8, 4, 16) if is_decode else (16, 2, 16)):
        buf = np.full(HostBatch.size(*shape), -1, np.int64)
        hb.fill(buf, *shape, pad_slot=999)
        ids, pos, meta = HostBatch.views(torch.from_numpy(buf), *shape, is_decode, hb.max_seqlen_q)
        Tp, Bp, Wp = shape
        assert ids.tolist() == list(range(100, 100 + T)) + [0] * (Tp - T)
        assert pos.tolist() == list(range(40, 40 + T)) + [0] * (Tp - T)
        assert meta.slot_mapping.tolist() == list(range(200, 200 + T)) + [999] * (Tp - T)
        assert meta.block_meta.shape == (Bp, Wp) and meta.block_meta[0, :3].tolist() == [5, 7, 9]
        assert meta.block_meta[1, 0] == 11 and int(meta.block_meta.sum()) == 5 + 7 + 9 + 11
        assert meta.num_ctx_blocks.dtype == torch.int32 and meta.num_ctx_blocks.tolist() == [3, 1] + [0] * (Bp - 2)
        assert meta.cu_seqlens_q.dtype == torch.int32
        expect = list(cu) + (list(range(len(cu), Bp + 1)) if is_decode else [cu[-1]] * (Bp + 1 - len(cu)))
        assert meta.cu_seqlens_q.tolist() == expect


def test_gemv_projections_match_gemm(hf_model):
    """One-token forwards with all four projections as fused GEMVs (kernels/gemv.py; Triton's interpreter on CPU,
    which is the only way Triton runs there) give the logits and greedy tokens of torch's GEMMs after separate
    norm / silu*up kernels (fp32)."""
    device = "cuda" if CUDA else "cpu"
    engines = [
        LazyEngine.from_hf(
            hf_model,
            None,
            device=device,
            dtype=torch.float32,
            kv_budget=32 << 20,
            attention="torch",
            gemv=g,
            cuda_graphs=False,
        )
        for g in (False, True)
    ]
    engines[1].runner.use_gemv(GEMV_LAYERS)
    assert not engines[0].runner.ops.gemv and engines[1].runner.ops.gemv == GEMV_LAYERS
    layout = random_layout(11)
    # the question is a 1-token forward
    one = PromptLayout(layout.prefix_ids, layout.chunk_ids, layout.question_ids[:1])
    a, b = (e.layout_logits(one, "lazy") for e in engines)
    assert rel_err(b, a) < 1e-5
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert engines[0].submit(layout, params).result().token_ids == engines[1].submit(layout, params).result().token_ids


def test_triton_elementwise_matches_torch(hf_model):
    """The norms and silu*up as Triton kernels (kernels/elementwise.py; the interpreter on CPU) give the
    logits of a whole prompt and the greedy tokens of the torch functions (fp32)."""
    device = "cuda" if CUDA else "cpu"
    engines = [
        LazyEngine.from_hf(
            hf_model,
            None,
            device=device,
            dtype=torch.float32,
            kv_budget=32 << 20,
            attention="torch",
            triton_elementwise=t,
            compile_elementwise=False,
            cuda_graphs=False,
        )
        for t in (False, True)
    ]
    from lazyrag.kernels import elementwise

    assert engines[0].runner.ops.silu_mul is not elementwise.silu_mul
    assert (
        engines[1].runner.ops.silu_mul is elementwise.silu_mul
        and engines[1].runner.ops.add_rms_norm is elementwise.add_rms_norm
    )
    layout = random_layout(12)
    a, b = (e.layout_logits(layout, "full") for e in engines)
    assert rel_err(b, a) < 1e-5
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert engines[0].submit(layout, params).result().token_ids == engines[1].submit(layout, params).result().token_ids


def test_skinny_projections_match_gemm(hf_model, monkeypatch):
    """Multi-token forwards with all four projections through the skinny Triton GEMM (kernels/gemm.py; Triton's
    interpreter on CPU) give the logits and greedy tokens of torch's GEMMs (fp32). The chunks (5-40 tokens) and
    the 9-token question are 2-64 token forwards; the decode steps (one token) stay on torch's GEMM."""
    device = "cuda" if CUDA else "cpu"
    engines = [
        LazyEngine.from_hf(
            hf_model,
            None,
            device=device,
            dtype=torch.float32,
            kv_budget=32 << 20,
            attention="torch",
            gemv=False,
            skinny_gemm=s,
            cuda_graphs=False,
        )
        for s in (False, True)
    ]
    assert not engines[0].runner.ops.skinny and engines[1].runner.ops.skinny == GEMV_LAYERS
    from lazyrag.kernels import gemm

    calls = []
    skinny_linear = gemm.skinny_linear
    monkeypatch.setattr(gemm, "skinny_linear", lambda x, *args: calls.append(x.shape[0]) or skinny_linear(x, *args))
    layout = random_layout(12)
    a, b = (e.layout_logits(layout, "lazy") for e in engines)
    assert rel_err(b, a) < 1e-5
    assert len(calls) >= 4 * 2 and min(calls) >= 2  # the four projections of both layers, multi-token forwards only
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert engines[0].submit(layout, params).result().token_ids == engines[1].submit(layout, params).result().token_ids


def test_triton_backend_plans_once_per_forward(hf_model, monkeypatch):
    """The Triton backend plans a forward on its first layer (meta.kernel_cache) and runs every layer with that
    plan; its options (kvloop.KernelOptions) reach the plan. The interpreter on CPU, the kernels on CUDA."""
    if not CUDA and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs its interpreter")
    from lazyrag.kernels import decode, prefill
    from lazyrag.kernels.kvloop import KernelOptions

    device = "cuda" if CUDA else "cpu"
    engine = LazyEngine.from_hf(
        hf_model, None, device=device, dtype=torch.float32, attention="triton", kv_budget=32 << 20, cuda_graphs=False
    )
    backend = engine.runner.attention
    plans, runs = [], []
    for mod, plan_fn, run_fn in ((prefill, "plan_prefill", "run_prefill"), (decode, "plan_decode", "run_decode")):
        real_plan, real_run = getattr(mod, plan_fn), getattr(mod, run_fn)
        monkeypatch.setattr(mod, plan_fn, lambda *a, _f=real_plan, **k: plans.append(_f(*a, **k)) or plans[-1])
        monkeypatch.setattr(mod, run_fn, lambda plan, *a, _f=real_run, **k: runs.append(plan) or _f(plan, *a, **k))
    layout = random_layout(6)
    base = engine.submit(layout, SamplingParams(max_new_tokens=3, ignore_eos=True)).result().token_ids
    layers = hf_model.config.num_hidden_layers
    assert plans and len(runs) == layers * len(plans)
    assert all(runs[i * layers : (i + 1) * layers] == [p] * layers for i, p in enumerate(plans))  # one plan a forward
    assert all(p.rotate for p in plans)
    if not CUDA:  # the interpreter's schedule (the GPU's depends on the grid: tests/kernels)
        assert all(p.rot == 5 for p in plans)
    backend.options = KernelOptions(prefill_rotation_mode=7, decode_rotation_mode=2, decode_splits=1)
    plans.clear()
    other = PromptLayout(layout.prefix_ids, layout.chunk_ids[::-1], layout.question_ids)
    engine.submit(other, SamplingParams(max_new_tokens=3, ignore_eos=True)).result()
    assert {(type(p).__name__, p.rot) for p in plans} == {("PrefillPlan", 7), ("DecodePlan", 2)}
    assert all(p.splits == 1 for p in plans if type(p).__name__ == "DecodePlan")
    backend.options = KernelOptions()
    assert engine.submit(layout, SamplingParams(max_new_tokens=3, ignore_eos=True)).result().token_ids == base
