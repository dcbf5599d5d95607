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
context tiles over programs (one wave of them) and merge partials. See benchmarks/NOTES.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import prefill_wgmma
from .kvloop import (
    OFF_TWIN, TABLE_MODES, blocks_per_sm, interpreting, kv_tile_loop, last_split_merges, merge_splits, num_sms,
    pick_config, programs_per_sm, record_launch, softmax_step, split_counters, split_tile_range, tile_table, workspace,
)


@triton.jit
def _lazy_prefill_kernel(
    Q, K_NEW, V_NEW, CU_SEQLENS, K_CACHE, V_CACHE, META, NUM_CTX, TILES, NUM_TILES, COS, SIN, OUT, PART_ACC, PART_ML,
    COUNTERS, qk_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_mb, stride_tb, stride_ot, stride_oh,
    Hq, NUM_SPLITS,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    ROT: tl.constexpr, IEEE: tl.constexpr, MERGE: tl.constexpr, ASM_INDEX: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M // G  # query tokens per tile
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE  # whole pages per KV tile
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
    t_lo, t_hi = split_tile_range(NUM_TILES, b, n_ctx, split, NUM_SPLITS, PAGES, ROT)
    m_i, l_i, acc = kv_tile_loop(Q + row_off, row_ok, COS, SIN, qk_scale, m_i, l_i, acc, K_CACHE, V_CACHE, meta_row,
                                 tiles_row, t_lo, t_hi, n_ctx, kvh,
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                 BLOCK_M, BLOCK_SIZE, BLOCK_N, HEAD_DIM, PREC, ROT, ASM_INDEX)

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
            k = tl.load(K_NEW + (kn_off * stride_knt + kvh * stride_knh)[:, None] + offs_d[None, :],
                        mask=kn_ok[:, None], other=0.0)
            v = tl.load(V_NEW + (kn_off * stride_vnt + kvh * stride_vnh)[:, None] + offs_d[None, :],
                        mask=kn_ok[:, None], other=0.0)
            m_i, l_i, acc = softmax_step(q, k, v, kn_ok[None, :] & (kn[None, :] <= tok[:, None]), m_i, l_i, acc, PREC)

    o_off = (seq_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    if SPLIT:
        # partials [Tq, Hq, NUM_SPLITS, (D | 2)] in fp32, merged by merge_splits_kernel, or (MERGE) by the
        # last split program of this (sequence, query tile, KV head) to finish
        part = ((seq_start + tok).to(tl.int64) * Hq + head) * NUM_SPLITS + split
        tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(PART_ML + part * 2, m_i, mask=row_ok)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=row_ok)
        if MERGE:
            group = (b * (tl.num_programs(0) // NUM_SPLITS) + tile) * tl.num_programs(1) + kvh
            last_split_merges(COUNTERS + group, PART_ACC, PART_ML, part - split, row_ok,
                              OUT + o_off[:, None] + offs_d[None, :], NUM_SPLITS, HEAD_DIM, BLOCK_M)
    else:
        # every real row attends at least to itself, so l_i > 0 there
        out = acc / l_i[:, None]
        tl.store(OUT + o_off[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=q_mask)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner; BLOCK_N is raised to the page size.
CONFIGS = [
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (64, 128, 4, 3),
    (64, 64, 4, 3),
]
# defaults from the H200 sweeps (benchmarks/NOTES.md, "Kernels, round 9"): the flat loop with its indices read
# as PTX (ROT 5: K/V copies two tiles ahead), 128x128 tiles, 3 stages. B=8, 512 new tokens: 1.77 vs 1.90-1.92 ms
# (8k, 1 doc) and 0.73 vs 0.75 ms (2k, 10 docs) against round 8's ROT 2 with 2 stages (calls 2-4).
DEFAULT_CONFIG = (128, 128, 8, 3)
DEFAULT_ROTATION_MODE = 5
# short prefills (the default config's programs fill under half the SMs, so the context is split): 64x64 tiles,
# 4 warps (two programs an SM) and ROT 7 (q rotated once per segment, loop-invariant). B=1, 64 new tokens,
# 10 docs, 8 splits: 27.3 / 44.8 µs at 2k / 8k against 30.3 / 58.4 with round 8's defaults.
SHORT_CONFIG = (64, 64, 4, 3)
SHORT_ROTATION_MODE = 7
# split partials merged by the last split program (kvloop.last_split_merges) instead of a second launch
DEFAULT_FUSED_MERGE = False
# unsplit prefills on Hopper: "wgmma" runs kernels/prefill_wgmma.py (Gluon), "triton" the kernel above. H200, B=8,
# 512 new tokens (benchmarks/NOTES.md, "Kernels, round 13", its sweep): 1378 / 1476 / 531 µs at 8k with 1 / 10
# documents and 2k with 10 against ROT 5's 1732 / 1886 / 722 in the same sweep
DEFAULT_KERNEL = "wgmma"


def _q_tiles(max_seqlen_q: int, block_m: int, G: int) -> int:
    """Query tiles per (sequence, KV head): ``block_m`` rows of packed (token, q head) pairs, at least one token's G."""
    return triton.cdiv(max_seqlen_q, max(block_m, triton.next_power_of_2(G)) // G)


def _auto_prefill_splits(n_programs: int, max_ctx_tiles: int, per_sm: int, device: torch.device) -> int:
    """Split the context (flash-decoding style) only when the (query tile, KV head, sequence) programs fill
    less than half the SMs; then as many splits as fill ONE wave at ``per_sm`` resident programs an SM, with at
    least 2 KV tiles per split. H200, round 8 (benchmarks/NOTES.md; B=1, 64 new tokens, 16 programs of 128x128,
    one an SM): 8 splits (one wave) 33.8 / 60.9 µs at 2k / 8k context against 44.2 / 70.6 with round 2's rule
    (two waves, >= 4 tiles a split); round 9: SHORT_CONFIG (32 programs, two an SM) 8 splits against 16: 27.3 vs
    32.5 µs (2k) and 44.8 vs 52.4 (8k). B=8 / 64 new (128 programs): splitting was 5-15% slower (round 2)."""
    if device.type != "cuda" or interpreting():
        return 1
    sms = num_sms(device)
    if 2 * n_programs > sms:
        return 1
    return max(1, min(sms * per_sm // max(1, n_programs), max_ctx_tiles // 2, 64))


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
    fused_merge: bool | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Triton version of :func:`lazyrag.kernels.reference.lazy_prefill_reference`.

    ``apply_rotation=False`` skips the deferred rotation (every delta treated as 0), for
    measuring its cost on pre-rotated KV in the same layout. ``config`` = (BLOCK_M, BLOCK_N,
    num_warps, num_stages) overrides the default (or tuned) choice; ``out`` may be given (same
    shape/dtype as q). ``num_splits`` splits each sequence's cached context over that many
    programs (partials merged by a second kernel); ``None`` splits only when the grid would not
    fill the GPU. ``tile_cache``: see :func:`lazyrag.kernels.decode.lazy_decode`.
    ``rotation_mode``: how the query is rotated (``kvloop.kv_tile_loop``'s ROT): 5 in a flat loop when the
    delta changes (indices read as PTX), 7 once per segment ahead of ROT 5's tile loop, 2 / 3 their round-8
    forms, 1 on every tile; ``None``: ``DEFAULT_ROTATION_MODE`` (short prefills, whose context is split:
    ``SHORT_ROTATION_MODE`` with ``SHORT_CONFIG``). ``fused_merge``: the last split program of each query tile merges
    the partials (no merge launch); ``None``: ``DEFAULT_FUSED_MERGE``. ``kernel``: ``"wgmma"`` runs an unsplit
    prefill on a Hopper GPU with :mod:`lazyrag.kernels.prefill_wgmma` (``config`` is then its (BLOCK_M, BLOCK_N,
    num_warps, stages), 12 warps its warp-specialized build; ``rotation_mode`` does not apply); ``"triton"`` this
    module's kernel; ``None``: ``DEFAULT_KERNEL`` where the wgmma kernel supports the call, the context is not split and neither
    ``rotation_mode`` nor ``config`` (the Triton kernel's) is given, else ``"triton"``.
    """
    Tq, Hq, D = q.shape
    Hkv = k_new.shape[1]
    assert Hq % Hkv == 0, "Hq must be a multiple of H_kv"
    G = Hq // Hkv
    nb_total, block_size, Hkv_c, Dc = k_cache.shape
    assert Hkv_c == Hkv and Dc == D and D in (64, 128)
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    on_gpu = q.is_cuda and not interpreting()
    B = cu_seqlens_q.numel() - 1
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if B > 0 else 0
    short = on_gpu and 2 * _q_tiles(max_seqlen_q, DEFAULT_CONFIG[0], G) * Hkv * B <= num_sms(q.device)
    auto_kernel = kernel is None
    if auto_kernel:  # the wgmma kernel unless something only the Triton kernel has is asked for
        kernel = (DEFAULT_KERNEL if rotation_mode is None and config is None and num_splits in (None, 1) and not short
                  and on_gpu and prefill_wgmma.disabled_because is None and prefill_wgmma.supported(q, block_size)
                  else "triton")
    if rotation_mode is None:
        rotation_mode = SHORT_ROTATION_MODE if short else DEFAULT_ROTATION_MODE
    assert rotation_mode in OFF_TWIN, f"rotation_mode: one of {tuple(OFF_TWIN)} (see kvloop.kv_tile_loop)"
    fused_merge = DEFAULT_FUSED_MERGE if fused_merge is None else fused_merge
    q, k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_new, v_new))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if block_meta.dtype != torch.int64:
        block_meta = block_meta.to(torch.int64)
    if block_meta.dim() == 1:
        block_meta = block_meta.view(1, -1)
    if rope_cos.dtype != torch.float32 or not rope_cos.is_contiguous():
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    cu = cu_seqlens_q
    if cu.dtype != torch.int32 or cu.device != q.device:
        cu = cu.to(device=q.device, dtype=torch.int32)
    nctx = num_ctx_blocks
    if nctx.dtype != torch.int32 or nctx.device != q.device:
        nctx = nctx.to(device=q.device, dtype=torch.int32)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0 or Tq == 0 or max_seqlen_q == 0:
        return out
    qk_scale = float(sm_scale) * 1.4426950408889634  # log2(e): the kernel uses exp2
    # rotation off runs the same loop structure minus the rotation (kvloop.OFF_TWIN)
    rot = rotation_mode if apply_rotation else OFF_TWIN[rotation_mode]
    W = block_meta.shape[1]
    assert kernel in ("triton", "wgmma"), "kernel: 'triton' or 'wgmma'"
    if kernel == "wgmma":
        cfg = config or prefill_wgmma.DEFAULT_CONFIG
        bm, bn, warps, stages = cfg
        assert on_gpu and prefill_wgmma.supported(q, block_size, bn), \
            "the wgmma kernel needs a Hopper GPU, Triton with Gluon, 16-bit q, head dim 64 or 128, pages <= BLOCK_N"
        assert num_splits in (None, 1), "the wgmma kernel does not split the context"
        tiles, n_tiles = tile_table(block_meta, nctx, bn // block_size, block_size, tile_cache,
                                    packed=prefill_wgmma.PACKED_TILES)
        grid = (_q_tiles(max_seqlen_q, bm, G), Hkv, B)
        try:
            compiled = prefill_wgmma.lazy_prefill_wgmma(q, k_new, v_new, cu, k_cache, v_cache, block_meta, tiles,
                                                        n_tiles, rope_cos, rope_sin, qk_scale, out, grid,
                                                        apply_rotation=apply_rotation, config=cfg)
        except Exception as e:  # noqa: BLE001  a compile error (Gluon's API moves between Triton releases)
            if not auto_kernel:
                raise
            prefill_wgmma.disable(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        else:
            record_launch("prefill", f"prefill wgmma rotate={apply_rotation} bm={bm} bn={bn} w={warps} s={stages} "
                          f"packed={prefill_wgmma.PACKED_TILES}",
                          compiled, warps, grid, 1)
            return out

    def launch(cfg, splits):
        bm, bn, warps, stages = cfg
        bm = max(bm, triton.next_power_of_2(G))
        bn = max(bn, block_size)
        pages = bn // block_size
        n_q_tiles = _q_tiles(max_seqlen_q, bm, G)
        variant = ("prefill", bm, bn, warps, stages, rot, D, G, q.dtype)
        if splits is None:
            per_sm = programs_per_sm(variant, blocks_per_sm(255, warps, 0))  # before the first launch: all registers
            splits = _auto_prefill_splits(n_q_tiles * Hkv * B, triton.cdiv(W, pages), per_sm, q.device)
        splits = max(1, int(splits))
        tiles, n_tiles = (tile_table(block_meta, nctx, pages, block_size, tile_cache) if rot in TABLE_MODES
                          else (block_meta, nctx))
        grid = (n_q_tiles * splits, Hkv, B)
        if splits > 1:
            part_acc = workspace.get("prefill_acc", (Tq, Hq, splits, D), torch.float32, q.device)
            part_ml = workspace.get("prefill_ml", (Tq, Hq, splits, 2), torch.float32, q.device)
        else:
            part_acc = part_ml = out  # unused
        merge_here = fused_merge and splits > 1
        counters = split_counters(q.device, n_q_tiles * Hkv * B) if merge_here else nctx  # unused without the merge
        compiled = _lazy_prefill_kernel[grid](
            q, k_new, v_new, cu, k_cache, v_cache, block_meta, nctx, tiles, n_tiles, rope_cos, rope_sin, out,
            part_acc, part_ml,
            counters, qk_scale,
            q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_meta.stride(0), tiles.stride(0), out.stride(0), out.stride(1),
            Hq, splits,
            G=G, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn, SPLIT=splits > 1,
            ROT=rot, IEEE=q.dtype == torch.float32, MERGE=merge_here, ASM_INDEX=on_gpu,
            num_warps=warps, num_stages=stages,
        )
        record_launch("prefill", f"prefill rot={rot} bm={bm} bn={bn} w={warps} s={stages} split={splits > 1} "
                      f"merge={merge_here}", compiled, warps, grid, splits, variant)
        if splits > 1 and not merge_here:
            merge_splits(part_acc, part_ml, out, splits)

    if config is None:
        if not on_gpu:
            config = (16, 16, 1, 1)
        else:
            key = ("prefill", D, G, block_size, q.dtype, rot, triton.next_power_of_2(max_seqlen_q),
                   num_splits, fused_merge, triton.next_power_of_2(B), triton.next_power_of_2(W))
            default = SHORT_CONFIG if short else DEFAULT_CONFIG
            config = pick_config(key, lambda c: launch(c, num_splits), CONFIGS, default)
    launch(config, num_splits)
    return out
