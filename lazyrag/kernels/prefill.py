"""LazyAttention prefill: flash attention over paged, position-free context blocks plus new tokens.

Layout and semantics: see :mod:`lazyrag.kernels.reference` (``lazy_prefill_reference``).

One program handles a tile of ``BLOCK_M`` query rows of one sequence for one KV head: the
rows are (token, q head) pairs of the ``G = Hq // Hkv`` query heads that share that KV
head ("packed GQA"), so every K/V tile is loaded once for the whole group.

Deferred RoPE: a cached block whose segment sits ``delta`` positions later than where it
was encoded needs ``k' = R(delta) k``. Instead of touching K we rotate the *query tile*
by ``-delta`` (``<q, R(delta) k> = <R(-delta) q, k>``), always from the original q (never
an un-rotate/re-rotate pair). The context is walked as one flat, pipelined loop over
segment-aligned KV tiles (:func:`lazyrag.kernels.kvloop.tile_table`); q is re-rotated only on
a tile whose delta differs from the previous tile's (``ROT=5``), so one document costs one
rotation; the tile indices are read as inline PTX so that the K/V copies run two tiles ahead
(``kvloop.load_index``). New tokens follow: the tiles before the query tile's first token need
no causal mask, only the diagonal ones do. Short prefills (few programs) take smaller tiles,
rotate q once per segment ahead of a loop where it is loop-invariant (``ROT=7``), split the
context tiles over programs (one wave of them) and merge partials. See benchmarks/NOTES.md, §Kernels.

Plan / run: :func:`plan_prefill` makes every choice of a forward pass once (kernel, config, rotation schedule,
splits, tile table: they depend on the batch's metadata only); :func:`run_prefill` launches one layer with it.
:func:`lazy_prefill` is both in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import prefill_wgmma
from .kvloop import (
    ROTATION_MODES,
    KernelOptions,
    blocks_per_sm,
    interpreting,
    known_config,
    kv_tile_loop,
    merge_split_partials,
    num_sms,
    pick_config,
    programs_per_sm,
    record_launch,
    softmax_step,
    split_tile_range,
    tile_table,
    workspace,
)
from .tuned import tuned as tuned_table


@triton.jit
def _lazy_prefill_kernel(
    Q,
    K_NEW,
    V_NEW,
    CU_SEQLENS,
    K_CACHE,
    V_CACHE,
    META,
    NUM_CTX,
    TILES,
    NUM_TILES,
    COS,
    SIN,
    OUT,
    PART_ACC,
    PART_ML,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_mb,
    stride_tb,
    stride_ot,
    stride_oh,
    Hq,
    NUM_SPLITS,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ROT: tl.constexpr,
    ROTATE: tl.constexpr,
    IEEE: tl.constexpr,
    ASM_INDEX: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M // G  # query tokens per tile
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    pid0 = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    if SPLIT:  # axis 0 = query tile * NUM_SPLITS + context split
        tile = pid0 // NUM_SPLITS
        split = pid0 % NUM_SPLITS
    else:
        tile = pid0
        split = 0

    seq_start = tl.load(CU_SEQLENS + b)
    seq_len = tl.load(CU_SEQLENS + b + 1) - seq_start
    t0 = tile * TOK
    if t0 >= seq_len:  # grid is sized for the longest sequence
        return

    # -- query rows: row r is token t0 + r // G of q head kvh * G + r % G
    offs_r = tl.arange(0, BLOCK_M)
    tok = t0 + offs_r // G
    row_ok = (offs_r < TOK * G) & (tok < seq_len)
    head = kvh * G + offs_r % G
    offs_d = tl.arange(0, HEAD_DIM)
    row_off = (seq_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q_ptrs = Q + row_off[:, None] + offs_d[None, :]
    q_mask = row_ok[:, None]
    dtype = Q.dtype.element_ty

    # finite init: a fully masked tile (padding-only page) must not produce inf - inf
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # -- stage 1: cached context, this program's share of the KV tiles (all of them unless split)
    meta_row = META + b.to(tl.int64) * stride_mb
    tiles_row = TILES + b.to(tl.int64) * stride_tb
    n_ctx = tl.load(NUM_CTX + b).to(tl.int32)
    t_lo, t_hi = split_tile_range(NUM_TILES, b, split, NUM_SPLITS)
    m_i, l_i, acc = kv_tile_loop(
        Q + row_off,
        row_ok,
        COS,
        SIN,
        qk_scale,
        m_i,
        l_i,
        acc,
        K_CACHE,
        V_CACHE,
        meta_row,
        tiles_row,
        t_lo,
        t_hi,
        n_ctx,
        kvh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        BLOCK_M,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        PREC,
        ROT,
        ROTATE,
        ASM_INDEX,
    )

    # -- stage 2: the sequence's new tokens (true positions, delta 0), causal; the last split
    # (whose context share is the smallest) does it. Keys before the tile's first token are
    # visible to every row (no mask); only the tiles reaching the diagonal are masked.
    if split == NUM_SPLITS - 1:
        q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
        offs_n = tl.arange(0, BLOCK_N)
        full_end = (t0 // BLOCK_N) * BLOCK_N
        for j0 in range(0, full_end, BLOCK_N):
            kn_off = (seq_start + j0 + offs_n).to(tl.int64)
            k = tl.load(K_NEW + (kn_off * stride_knt + kvh * stride_knh)[:, None] + offs_d[None, :])
            v = tl.load(V_NEW + (kn_off * stride_vnt + kvh * stride_vnh)[:, None] + offs_d[None, :])
            m_i, l_i, acc = softmax_step(q, k, v, True, m_i, l_i, acc, PREC, False)
        hi_new = tl.minimum(t0 + TOK, seq_len)
        for j0 in range(full_end, hi_new, BLOCK_N):
            kn = j0 + offs_n
            kn_ok = kn < seq_len
            kn_off = (seq_start + kn).to(tl.int64)
            k = tl.load(
                K_NEW + (kn_off * stride_knt + kvh * stride_knh)[:, None] + offs_d[None, :],
                mask=kn_ok[:, None],
                other=0.0,
            )
            v = tl.load(
                V_NEW + (kn_off * stride_vnt + kvh * stride_vnh)[:, None] + offs_d[None, :],
                mask=kn_ok[:, None],
                other=0.0,
            )
            m_i, l_i, acc = softmax_step(q, k, v, kn_ok[None, :] & (kn[None, :] <= tok[:, None]), m_i, l_i, acc, PREC)

    o_off = (seq_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    if SPLIT:
        # partials [Tq, Hq, NUM_SPLITS, (D | 2)] in fp32, merged by merge_splits_kernel
        part = ((seq_start + tok).to(tl.int64) * Hq + head) * NUM_SPLITS + split
        tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(PART_ML + part * 2, m_i, mask=row_ok)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=row_ok)
    else:
        # every real row attends at least to itself, so l_i > 0 there
        out = acc / l_i[:, None]
        tl.store(OUT + o_off[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=q_mask)


def _q_tiles(max_seqlen_q: int, block_m: int, G: int) -> int:
    """Query tiles per (sequence, KV head): ``block_m`` rows of packed (token, q head) pairs, at least one token's G."""
    return triton.cdiv(max_seqlen_q, max(block_m, triton.next_power_of_2(G)) // G)


def _auto_prefill_splits(n_programs: int, max_ctx_tiles: int, per_sm: int, device: torch.device) -> int:
    """Split the context (flash-decoding style) only when the (query tile, KV head, sequence) programs fill
    less than half the SMs; then as many splits as fill ONE wave at ``per_sm`` resident programs an SM, with at
    least 2 KV tiles per split (one wave beat two, and splitting a full grid lost: NOTES §Kernels, rounds 2, 8, 9)."""
    if device.type != "cuda" or interpreting():
        return 1
    sms = num_sms(device)
    if 2 * n_programs > sms:
        return 1
    return max(1, min(sms * per_sm // max(1, n_programs), max_ctx_tiles // 2, 64))


@dataclass
class PrefillPlan:
    """One forward pass's prefill choices, shared by all its layers (:func:`plan_prefill`)."""

    kernel: str  # "wgmma" (kernels/prefill_wgmma.py) or "triton" (this module's kernel)
    config: tuple | None  # the kernel's (BLOCK_M, BLOCK_N, warps, stages); None: autotuned at the first run
    rot: int  # kv_tile_loop's rotation schedule (Triton kernel)
    rotate: bool
    splits: int  # context splits (Triton kernel; 1 = no merge)
    tiles: torch.Tensor | None  # the tile table (packed for the wgmma kernel) and its tile counts
    n_tiles: torch.Tensor | None
    grid: tuple
    # the batch, converted once
    cu: torch.Tensor
    nctx: torch.Tensor
    block_meta: torch.Tensor
    max_seqlen_q: int
    G: int
    Hkv: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    on_gpu: bool
    auto_kernel: bool  # kernel chosen here, not asked for: a wgmma build failure falls back to the Triton kernel
    requested_splits: int | None
    tile_cache: dict | None
    tuned: dict
    merge: tuple | None
    key: tuple | None = None  # the autotuner's key (Triton kernel on a GPU)
    variant: tuple | None = None  # the compiled variant (occupancy record)

    @property
    def empty(self) -> bool:
        return self.grid[-1] == 0 or self.max_seqlen_q == 0


def plan_prefill(
    cu_seqlens_q: torch.Tensor,
    block_meta: torch.Tensor,
    num_ctx_blocks: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_seqlen_q: int | None = None,
    options: KernelOptions = KernelOptions(),
    tile_cache: dict | None = None,
) -> PrefillPlan:
    """Every choice of a prefill forward that depends on its batch only, made once for all layers: the kernel
    (on a Hopper GPU the wgmma one, unless the context is split or an option only the Triton kernel has is set),
    its config (tuned_configs.json; ``LAZYRAG_KERNEL_AUTOTUNE=1``: timed at the first run), the rotation schedule
    (short prefills, whose default programs fill at most half the SMs: ``short_config`` and
    ``short_rotation_mode``), the context splits and the tile table (built into ``tile_cache``; inside a CUDA-graph
    capture, on the captured stream)."""
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of H_kv"
    assert head_dim in (64, 128)
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    G = num_heads // num_kv_heads
    on_gpu = device.type == "cuda" and not interpreting()
    B = cu_seqlens_q.numel() - 1
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if B > 0 else 0
    table = tuned_table(device, options.tuned)
    pt = table["prefill"]
    short = on_gpu and 2 * _q_tiles(max_seqlen_q, pt["config"][0], G) * num_kv_heads * B <= num_sms(device)
    kernel = options.prefill_kernel
    auto_kernel = kernel is None
    if auto_kernel:  # the wgmma kernel unless something only the Triton kernel has is asked for
        kernel = (
            pt["kernel"]
            if options.prefill_rotation_mode is None
            and options.prefill_config is None
            and options.prefill_splits in (None, 1)
            and not short
            and on_gpu
            and prefill_wgmma.disabled_because is None
            and prefill_wgmma.supported(dtype, head_dim, device, block_size, table["prefill_wgmma"]["config"][1])
            else "triton"
        )
    assert kernel in ("triton", "wgmma"), "kernel: 'triton' or 'wgmma'"
    rot = options.prefill_rotation_mode
    if rot is None:
        rot = pt["short_rotation_mode"] if short else pt["rotation_mode"]
    assert rot in ROTATION_MODES, f"rotation_mode: one of {ROTATION_MODES} (see kvloop.kv_tile_loop)"
    if block_meta.dtype != torch.int64:
        block_meta = block_meta.to(torch.int64)
    if block_meta.dim() == 1:
        block_meta = block_meta.view(1, -1)
    cu = cu_seqlens_q
    if cu.dtype != torch.int32 or cu.device != device:
        cu = cu.to(device=device, dtype=torch.int32)
    nctx = num_ctx_blocks
    if nctx.dtype != torch.int32 or nctx.device != device:
        nctx = nctx.to(device=device, dtype=torch.int32)
    plan = PrefillPlan(
        kernel,
        None,
        rot,
        options.apply_rotation,
        1,
        None,
        None,
        (0, num_kv_heads, B),
        cu,
        nctx,
        block_meta,
        max_seqlen_q,
        G,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        on_gpu,
        auto_kernel,
        options.prefill_splits,
        tile_cache,
        table,
        options.merge,
    )
    if plan.empty:
        return plan
    if kernel == "wgmma":
        _plan_wgmma(plan, options.prefill_config or tuple(table["prefill_wgmma"]["config"]), device)
    else:
        _plan_triton(plan, options.prefill_config, short, device)
    return plan


def _plan_wgmma(plan: PrefillPlan, cfg: tuple, device: torch.device) -> None:
    bm, bn, warps, stages = cfg
    assert plan.on_gpu and prefill_wgmma.supported(plan.dtype, plan.head_dim, device, plan.block_size, bn), (
        "the wgmma kernel needs a Hopper GPU, Triton with Gluon, 16-bit q, head dim 64 or 128, pages <= BLOCK_N"
    )
    assert plan.requested_splits in (None, 1), "the wgmma kernel does not split the context"
    plan.config = tuple(cfg)
    plan.splits = 1
    plan.tiles, plan.n_tiles = tile_table(
        plan.block_meta, plan.nctx, bn // plan.block_size, plan.block_size, plan.tile_cache, packed=True
    )
    plan.grid = (_q_tiles(plan.max_seqlen_q, bm, plan.G), plan.Hkv, plan.grid[-1])


def _plan_triton(plan: PrefillPlan, config: tuple | None, short: bool, device: torch.device) -> None:
    plan.kernel, plan.config = "triton", None
    if config is None:
        if not plan.on_gpu:
            config = (16, 16, 1, 1)
        else:
            pt = plan.tuned["prefill"]
            plan.key = (
                "prefill",
                plan.head_dim,
                plan.G,
                plan.block_size,
                plan.dtype,
                plan.rot,
                plan.rotate,
                triton.next_power_of_2(plan.max_seqlen_q),
                plan.requested_splits,
                triton.next_power_of_2(plan.grid[-1]),
                triton.next_power_of_2(plan.block_meta.shape[1]),
            )
            config = known_config(plan.key, tuple(pt["short_config"] if short else pt["config"]))
    if config is not None:
        _layout_triton(plan, tuple(config), device)


def _layout_triton(plan: PrefillPlan, cfg: tuple, device: torch.device) -> None:
    """The Triton kernel's tiles, splits and grid under ``cfg``."""
    bm, bn, warps, stages = cfg
    bm = max(bm, triton.next_power_of_2(plan.G))
    bn = max(bn, plan.block_size)
    pages = bn // plan.block_size
    B = plan.grid[-1]
    n_q_tiles = _q_tiles(plan.max_seqlen_q, bm, plan.G)
    plan.variant = ("prefill", bm, bn, warps, stages, plan.rot, plan.rotate, plan.head_dim, plan.G, plan.dtype)
    splits = plan.requested_splits
    if splits is None:
        per_sm = programs_per_sm(plan.variant, blocks_per_sm(255, warps, 0))  # before the first launch: all registers
        splits = _auto_prefill_splits(
            n_q_tiles * plan.Hkv * B, triton.cdiv(plan.block_meta.shape[1], pages), per_sm, device
        )
    plan.config = (bm, bn, warps, stages)
    plan.splits = max(1, int(splits))
    plan.tiles, plan.n_tiles = tile_table(plan.block_meta, plan.nctx, pages, plan.block_size, plan.tile_cache)
    plan.grid = (n_q_tiles * plan.splits, plan.Hkv, B)


def run_prefill(
    plan: PrefillPlan,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's prefill attention under ``plan`` (see :func:`lazy_prefill` for the arguments)."""
    Tq, Hq, D = q.shape
    assert Hq == plan.G * plan.Hkv and D == plan.head_dim and k_new.shape[1] == plan.Hkv
    assert tuple(k_cache.shape[1:]) == (plan.block_size, plan.Hkv, D)
    q, k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_new, v_new))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if rope_cos.dtype != torch.float32 or not rope_cos.is_contiguous():
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if plan.empty or Tq == 0:
        return out
    qk_scale = float(sm_scale) * 1.4426950408889634  # log2(e): the kernel uses exp2
    args = (q, k_new, v_new, k_cache, v_cache, rope_cos, rope_sin, qk_scale, out)
    if plan.kernel == "wgmma":
        assert plan.config is not None, "the wgmma kernel is never autotuned here"
        bm, bn, warps, stages = plan.config
        wg = plan.tuned["prefill_wgmma"]
        try:
            compiled = prefill_wgmma.lazy_prefill_wgmma(
                q,
                k_new,
                v_new,
                plan.cu,
                k_cache,
                v_cache,
                plan.block_meta,
                plan.tiles,
                plan.n_tiles,
                rope_cos,
                rope_sin,
                qk_scale,
                out,
                plan.grid,
                apply_rotation=plan.rotate,
                config=plan.config,
                registers=tuple(wg["registers"]),
                key_chunk=wg["key_chunk"],
            )
        except Exception as e:  # noqa: BLE001  a compile error (Gluon's API moves between Triton releases)
            if not plan.auto_kernel:
                raise
            prefill_wgmma.disable(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
            _plan_triton(plan, None, False, q.device)  # this layer and the plan's others: the Triton kernel
        else:
            record_launch(
                "prefill",
                f"prefill wgmma rotate={plan.rotate} bm={bm} bn={bn} w={warps} s={stages} packed=True",
                compiled,
                warps,
                plan.grid,
                1,
            )
            return out
    if plan.config is None:  # autotuning (LAZYRAG_KERNEL_AUTOTUNE=1): each candidate timed on this layer's tensors

        def trial(cfg):
            _layout_triton(plan, tuple(cfg), q.device)
            _launch_triton(plan, *args)

        best = pick_config(plan.key, trial, [tuple(c) for c in plan.tuned["prefill"]["candidates"]], None)
        _layout_triton(plan, tuple(best), q.device)
    _launch_triton(plan, *args)
    return out


def _launch_triton(plan: PrefillPlan, q, k_new, v_new, k_cache, v_cache, rope_cos, rope_sin, qk_scale, out) -> None:
    Tq, Hq, D = q.shape
    assert plan.config is not None and plan.tiles is not None, "a launch follows _layout_triton"
    bm, bn, warps, stages = plan.config
    splits = plan.splits
    part_acc, part_ml = workspace.split_partials("prefill", Tq, Hq, splits, D, q.device, out)
    compiled = _lazy_prefill_kernel[plan.grid](
        q,
        k_new,
        v_new,
        plan.cu,
        k_cache,
        v_cache,
        plan.block_meta,
        plan.nctx,
        plan.tiles,
        plan.n_tiles,
        rope_cos,
        rope_sin,
        out,
        part_acc,
        part_ml,
        qk_scale,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        plan.block_meta.stride(0),
        plan.tiles.stride(0),
        out.stride(0),
        out.stride(1),
        Hq,
        splits,
        G=plan.G,
        HEAD_DIM=D,
        BLOCK_SIZE=plan.block_size,
        BLOCK_M=bm,
        BLOCK_N=bn,
        SPLIT=splits > 1,
        ROT=plan.rot,
        ROTATE=plan.rotate,
        IEEE=q.dtype == torch.float32,
        ASM_INDEX=plan.on_gpu,
        num_warps=warps,
        num_stages=stages,
    )
    record_launch(
        "prefill",
        f"prefill rot={plan.rot} rotate={plan.rotate} bm={bm} bn={bn} w={warps} s={stages} split={splits > 1}",
        compiled,
        warps,
        plan.grid,
        splits,
        plan.variant,
    )
    if splits > 1:
        merge_split_partials(plan, part_acc, part_ml, out)


def lazy_prefill(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_meta: torch.Tensor,
    num_ctx_blocks: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    sm_scale: float,
    max_seqlen_q: int | None = None,
    apply_rotation: bool = True,
    config: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile_cache: dict | None = None,
    rotation_mode: int | None = None,
    kernel: str | None = None,
    tuned: dict | None = None,
) -> torch.Tensor:
    """Triton version of :func:`lazyrag.kernels.reference.lazy_prefill_reference`: :func:`plan_prefill` and
    :func:`run_prefill` in one call (tests, benchmarks; the engine plans once per forward).

    ``apply_rotation=False`` skips the deferred rotation (every delta treated as 0), for measuring its cost on
    K re-rotated in place. ``config`` (BLOCK_M, BLOCK_N, num_warps, num_stages), ``num_splits``,
    ``rotation_mode`` (2, 5 or 7) and ``kernel`` ("wgmma" / "triton") are :class:`kvloop.KernelOptions`'
    ``prefill_*`` fields, ``tuned`` its ``tuned``; ``out`` may be given (same shape/dtype as q).
    ``tile_cache``: a dict living as long as the block table (one forward), where the tile table is kept."""
    options = KernelOptions(
        prefill_kernel=kernel,
        prefill_config=config,
        prefill_rotation_mode=rotation_mode,
        prefill_splits=num_splits,
        apply_rotation=apply_rotation,
        tuned=tuned,
    )
    plan = plan_prefill(
        cu_seqlens_q,
        block_meta,
        num_ctx_blocks,
        num_heads=q.shape[1],
        num_kv_heads=k_new.shape[1],
        head_dim=q.shape[2],
        block_size=k_cache.shape[1],
        dtype=q.dtype,
        device=q.device,
        max_seqlen_q=max_seqlen_q,
        options=options,
        tile_cache=tile_cache,
    )
    return run_prefill(plan, q, k_new, v_new, k_cache, v_cache, rope_cos, rope_sin, sm_scale, out=out)
