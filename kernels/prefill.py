"""LazyAttention prefill: flash attention over paged, position-free context blocks plus new tokens.

Layout and semantics: see :mod:`lazyrag.kernels.reference` (``lazy_prefill_reference``).

One program handles a tile of ``BLOCK_M`` query rows of one sequence for one KV head: the
rows are (token, q head) pairs of the ``G = Hq // Hkv`` query heads that share that KV
head ("packed GQA"), so every K/V tile is loaded once for the whole group.

Deferred RoPE: a cached block whose segment sits ``delta`` positions later than where it
was encoded needs ``k' = R(delta) k``. Instead of touching K we rotate the *query tile*
once by ``-delta`` (``<q, R(delta) k> = <R(-delta) q, k>``) and keep it while consecutive
blocks share ``delta`` (one document). The rotation always starts from the original q,
so there is never an un-rotate/re-rotate pair. The context is walked segment by segment
(consecutive blocks sharing delta); per segment the rotated q is written to a per-program
scratch tile and reloaded (``_staged_rotated_q``), so inside the segment the tile loop
(``BLOCK_N // block_size`` whole pages per KV tile) takes q from shared memory exactly
like the rotation-free loop. Short prefills (few programs) split the context over
programs and merge partials (``_merge_splits_kernel``). See benchmarks/NOTES.md.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# Field layout of the packed block meta (see reference.pack_block_meta).
PHYS_MASK = tl.constexpr(0x7FFFFFFF)  # ids are < 2**31 (asserted when packing); keeps the literal int32
DELTA_SHIFT = tl.constexpr(32)
DELTA_MASK = tl.constexpr(0xFFFFFF)
VALID_SHIFT = tl.constexpr(56)
VALID_MASK = tl.constexpr(0xFF)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _block_delta(meta_row, idx, hi):
    # scalar delta of block idx (0 when idx is out of range so callers need no branch)
    m = tl.load(meta_row + idx, mask=idx < hi, other=0)
    return (m >> DELTA_SHIFT) & DELTA_MASK


@triton.jit
def _run_end(meta_row, start, hi, SCAN: tl.constexpr):
    """A lower bound on where the segment holding block ``start`` ends: the first block in
    (start, start + SCAN) whose delta differs, else min(start + SCAN, hi).

    One vector load and no loop (a loop inside the main KV loop would stop Triton from
    software-pipelining it). A segment longer than SCAN blocks just re-enters the boundary
    path once per SCAN blocks and finds the same delta.
    """
    d0 = _block_delta(meta_row, start, hi)
    offs = start + 1 + tl.arange(0, SCAN)
    lim = tl.minimum(start + SCAN, hi)
    m = tl.load(meta_row + offs, mask=offs < lim, other=0)
    d = (m >> DELTA_SHIFT) & DELTA_MASK
    return tl.min(tl.where((offs < lim) & (d != d0), offs, lim), axis=0)


@triton.jit
def _segment_end(meta_row, start, hi, SCAN: tl.constexpr):
    """Exact end of the segment holding block ``start``: first block in (start, hi) whose delta
    differs, else hi. SCAN metas per step (one vector load, not a chain of scalar loads)."""
    d0 = _block_delta(meta_row, start, hi)
    end = hi
    c = start + 1
    while c < end:
        offs = c + tl.arange(0, SCAN)
        m = tl.load(meta_row + offs, mask=offs < end, other=0)
        d = (m >> DELTA_SHIFT) & DELTA_MASK
        end = tl.min(tl.where((offs < end) & (d != d0), offs, end), axis=0)
        c += SCAN
    return end


@triton.jit
def _softmax_step(q, k, v, keep, m_i, l_i, acc, PREC: tl.constexpr):
    """One KV tile of online softmax in base 2 (the scale and log2(e) are folded into q)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _context_tiles(q, m_i, l_i, acc, K_CACHE, V_CACHE, meta_row, lo, hi, kvh,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PREC: tl.constexpr):
    """Online-softmax over blocks [lo, hi) with a fixed (already rotated, pre-scaled) q."""
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    page_in_tile = offs_n // BLOCK_SIZE
    slot = offs_n % BLOCK_SIZE
    for t in range(lo, hi, PAGES):
        page = t + page_in_tile
        page_ok = page < hi
        # one int64 per page: physical id, delta and valid length in a single load
        meta = tl.load(meta_row + page, mask=page_ok, other=0)
        phys = (meta & PHYS_MASK).to(tl.int64)
        valid = ((meta >> VALID_SHIFT) & VALID_MASK).to(tl.int32)
        kv_ok = page_ok & (slot < valid)
        k = tl.load(K_CACHE + (phys * stride_kb + slot * stride_ks + kvh * stride_kh)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        v = tl.load(V_CACHE + (phys * stride_vb + slot * stride_vs + kvh * stride_vh)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(q, k, v, kv_ok[None, :], m_i, l_i, acc, PREC)
    return m_i, l_i, acc


@triton.jit
def _staged_rotated_q(q_ptrs, q_mask, SCR, COS, SIN, delta, scale,
                      ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """scale * R(-delta) q for a [ROWS, HEAD_DIM] query tile, returned *through global memory*.

    The rotation is elementwise in fp32 from the original q (never un-rotate/re-rotate):
    HF rotate-half R(-d) [q1, q2] = [q1 c + q2 s, q2 c - q1 s]. The result is written to this
    program's private scratch tile ``SCR`` (L2-resident, ROWS x HEAD_DIM in q's dtype), a
    CTA barrier makes it visible, and it is read back with a plain ``tl.load``: the query
    then reaches the KV loop exactly like the rotation-off kernel's q (load -> shared memory
    -> wgmma operand, hoisted out of the loop). A q produced by a dot or by register math was
    instead kept in the accumulator layout and re-converted on every KV tile (TTGIR:
    ``convert_layout #mma -> dot_op`` inside the loop), which cost 14-18% for one document.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    partner = (offs_d + HALF) % HEAD_DIM  # rotate-half partner feature
    x = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    xp = tl.load(q_ptrs + (partner - offs_d)[None, :], mask=q_mask, other=0.0).to(tl.float32)
    c = tl.load(COS + delta * HALF + offs_d % HALF) * scale
    sn = tl.load(SIN + delta * HALF + offs_d % HALF) * scale
    sn = tl.where(offs_d < HALF, sn, -sn)
    qr = x * c[None, :] + xp * sn[None, :]
    scr = SCR + offs_r[:, None] * HEAD_DIM + offs_d[None, :]
    tl.debug_barrier()  # WAR: every thread has read the previous segment's tile
    tl.store(scr, qr.to(SCR.dtype.element_ty))
    tl.debug_barrier()  # RAW: the whole tile is written before anyone reads it
    return tl.load(scr)


@triton.jit
def _context_attention(q_ptrs, q_mask, scr, COS, SIN, qk_scale, m_i, l_i, acc, K_CACHE, V_CACHE, meta_row, lo, hi, kvh,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PREC: tl.constexpr, APPLY_ROT: tl.constexpr, STAGE_Q: tl.constexpr, SCAN: tl.constexpr):
    """Online softmax of ``ROWS`` query rows over context blocks [lo, hi); shared by prefill and decode.

    Segment by segment (a segment = consecutive blocks sharing delta, i.e. one document): q is
    rotated once per segment by -delta, staged through this program's scratch tile ``scr`` and
    reloaded, so the tile loop sees a plainly loaded, loop-invariant q and compiles exactly
    like the rotation-free loop.
    """
    dtype = q_ptrs.dtype.element_ty
    if APPLY_ROT:
        seg = lo + hi * 0  # a run-time value: loop-carried scalars must not start as constexpr
        while seg < hi:
            q = _staged_rotated_q(q_ptrs, q_mask, scr, COS, SIN, _block_delta(meta_row, seg, hi), qk_scale, ROWS, HEAD_DIM)
            seg_end = _segment_end(meta_row, seg, hi, SCAN)
            m_i, l_i, acc = _context_tiles(q, m_i, l_i, acc, K_CACHE, V_CACHE, meta_row, seg, seg_end, kvh,
                                           stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                           BLOCK_SIZE, BLOCK_N, HEAD_DIM, PREC)
            seg = seg_end
    else:
        if STAGE_Q:  # the rotation-free q through the same scratch path (delta 0: exact scaling)
            q = _staged_rotated_q(q_ptrs, q_mask, scr, COS, SIN, 0, qk_scale, ROWS, HEAD_DIM)
        else:
            q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
        m_i, l_i, acc = _context_tiles(q, m_i, l_i, acc, K_CACHE, V_CACHE, meta_row, lo, hi, kvh,
                                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                       BLOCK_SIZE, BLOCK_N, HEAD_DIM, PREC)
    return m_i, l_i, acc


@triton.jit
def _merge_splits_kernel(
    PART_ACC, PART_ML, OUT, stride_ob, stride_oh, Hq, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Combine split partials [R0, Hq, NUM_SPLITS, (D | 2)] (unnormalised acc, base-2 max m,
    sum l) into OUT[r0, h]. Used by split decode (r0 = sequence) and split prefill (r0 = token)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    part = (b.to(tl.int64) * Hq + h) * NUM_SPLITS + offs_s
    m = tl.load(PART_ML + part * 2, mask=s_ok, other=-1.0e30)
    l = tl.load(PART_ML + part * 2 + 1, mask=s_ok, other=0.0)
    # rescale each split to the common max (base-2 logits, as in the main kernels)
    m_max = tl.max(m, 0)
    w = tl.where(s_ok, tl.math.exp2(m - m_max), 0.0)
    l_sum = tl.sum(l * w, 0)
    acc = tl.load(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


@triton.jit
def _lazy_prefill_kernel(
    Q, K_NEW, V_NEW, CU_SEQLENS, K_CACHE, V_CACHE, META, NUM_CTX, COS, SIN, OUT, SCR, PART_ACC, PART_ML,
    qk_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_mb, stride_ot, stride_oh,
    Hq, NUM_SPLITS,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    APPLY_ROT: tl.constexpr, IEEE: tl.constexpr, SCAN: tl.constexpr, STAGE_Q: tl.constexpr,
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

    # -- this program's share of the cached context: whole KV tiles (all of it unless split)
    meta_row = META + b.to(tl.int64) * stride_mb
    n_ctx = tl.load(NUM_CTX + b).to(tl.int32)
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(n_ctx, NUM_SPLITS), PAGES) * PAGES
        lo = split * per_split
        hi = tl.minimum(lo + per_split, n_ctx)
    else:
        lo = 0
        hi = n_ctx

    # -- stage 1: cached context, one relative rotation of q per document (see _context_attention)
    pid_lin = (b * tl.num_programs(1) + kvh).to(tl.int64) * tl.num_programs(0) + pid0
    scr = SCR + pid_lin * (BLOCK_M * HEAD_DIM)  # this program's scratch tile (staged q)
    m_i, l_i, acc = _context_attention(q_ptrs, q_mask, scr, COS, SIN, qk_scale, m_i, l_i, acc, K_CACHE, V_CACHE,
                                       meta_row, lo, hi, kvh,
                                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                       BLOCK_M, BLOCK_SIZE, BLOCK_N, HEAD_DIM, PREC, APPLY_ROT, STAGE_Q, SCAN)

    # -- stage 2: the sequence's new tokens (true positions, delta 0), causal; the last split
    # (whose context share is the smallest) does it
    if split == NUM_SPLITS - 1:
        q = (tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(dtype)
        hi_new = tl.minimum(t0 + TOK, seq_len)
        offs_n = tl.arange(0, BLOCK_N)
        for j0 in range(0, hi_new, BLOCK_N):
            kn = j0 + offs_n
            kn_ok = kn < seq_len
            kn_off = (seq_start + kn).to(tl.int64)
            k = tl.load(K_NEW + (kn_off * stride_knt + kvh * stride_knh)[:, None] + offs_d[None, :],
                        mask=kn_ok[:, None], other=0.0)
            v = tl.load(V_NEW + (kn_off * stride_vnt + kvh * stride_vnh)[:, None] + offs_d[None, :],
                        mask=kn_ok[:, None], other=0.0)
            m_i, l_i, acc = _softmax_step(q, k, v, kn_ok[None, :] & (kn[None, :] <= tok[:, None]), m_i, l_i, acc, PREC)

    if SPLIT:
        # partials [Tq, Hq, NUM_SPLITS, (D | 2)] in fp32, merged by _merge_splits_kernel
        part = ((seq_start + tok).to(tl.int64) * Hq + head) * NUM_SPLITS + split
        tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(PART_ML + part * 2, m_i, mask=row_ok)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=row_ok)
    else:
        # every real row attends at least to itself, so l_i > 0 there
        out = acc / l_i[:, None]
        o_off = (seq_start + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(OUT + o_off[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=q_mask)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried on the GPU; BLOCK_N is raised to the page size.
_GPU_CONFIGS = [
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 3),  # ~100 KB shared memory on triton 3.6 with the staged q (compiled locally for sm_90)
]
_best_config: dict[tuple, tuple[int, int, int, int]] = {}


def _pick_config(key, launch, configs):
    """Tiny autotuner: time each config once per key with do_bench, keep the fastest."""
    if key in _best_config:
        return _best_config[key]
    if os.environ.get("LAZYRAG_KERNEL_AUTOTUNE", "1") == "0":  # tests: skip the tuning compiles
        return configs[0]
    best, best_ms = None, float("inf")
    for cfg in configs:
        try:
            ms = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
        except Exception:  # e.g. out of shared memory for this tile shape
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError("no kernel config could run")
    _best_config[key] = best
    return best


_sm_count: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def _auto_prefill_splits(n_programs: int, max_ctx_blocks: int, pages: int, device: torch.device) -> int:
    """Split the context (flash-decoding style) only when the (query tile, KV head, sequence)
    programs fill less than half the SMs: ~2 waves then, at least 4 KV tiles per split.
    Measured (H200, round 2): B=1/64 new tokens/8k (16 programs) 0.29 -> 0.18 ms with 17 splits;
    B=8/64 new (128 programs) 3 splits were 5-15% slower than none, hence the half-wave bound."""
    if device.type != "cuda" or _interpreting():
        return 1
    sms = _num_sms(device)
    if 2 * n_programs > sms:
        return 1
    want = triton.cdiv(2 * sms, max(1, n_programs))
    return max(1, min(want, max_ctx_blocks // (4 * pages), 64))


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
    stage_q: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`lazyrag.kernels.reference.lazy_prefill_reference`.

    ``apply_rotation=False`` skips the deferred rotation (every delta treated as 0), for
    measuring its cost against pre-rotated KV. ``config`` = (BLOCK_M, BLOCK_N, num_warps,
    num_stages) overrides the tuned choice; ``out`` may be given (same shape/dtype as q).
    ``num_splits`` splits each sequence's cached context over that many programs (partials
    merged by a second kernel); ``None`` splits only when the grid would not fill the GPU.
    ``stage_q`` (rotation off only) sends the scaled q through the same scratch round trip as the
    rotated q, so the two variants differ only in the rotation arithmetic (for measurements).
    """
    Tq, Hq, D = q.shape
    Hkv = k_new.shape[1]
    assert Hq % Hkv == 0, "Hq must be a multiple of H_kv"
    G = Hq // Hkv
    nb_total, block_size, Hkv_c, Dc = k_cache.shape
    assert Hkv_c == Hkv and Dc == D and D in (64, 128)
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    B = cu_seqlens_q.numel() - 1
    q, k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_new, v_new))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_meta = block_meta.to(torch.int64)
    if block_meta.dim() == 1:
        block_meta = block_meta.view(1, -1)
    rope_cos = rope_cos.float().contiguous()
    rope_sin = rope_sin.float().contiguous()
    cu = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    nctx = num_ctx_blocks.to(device=q.device, dtype=torch.int32)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu[1:] - cu[:-1]).max()) if B > 0 else 0
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if B == 0 or Tq == 0 or max_seqlen_q == 0:
        return out
    qk_scale = float(sm_scale) * 1.4426950408889634  # log2(e): the kernel uses exp2
    rot = bool(apply_rotation)
    stage = bool(stage_q) and not rot

    def launch(cfg, splits):
        bm, bn, warps, stages = cfg
        bm = max(bm, triton.next_power_of_2(G))
        bn = max(bn, block_size)
        n_tiles = triton.cdiv(max_seqlen_q, bm // G)
        grid = (n_tiles * splits, Hkv, B)
        # per-program scratch tile for the staged rotated query (L2-resident, rewritten per segment)
        scr = (torch.empty(grid[0] * grid[1] * grid[2] * bm * D, device=q.device, dtype=q.dtype) if rot or stage
               else out)
        if splits > 1:
            part_acc = torch.empty(Tq, Hq, splits, D, device=q.device, dtype=torch.float32)
            part_ml = torch.empty(Tq, Hq, splits, 2, device=q.device, dtype=torch.float32)
        else:
            part_acc = part_ml = out  # unused
        _lazy_prefill_kernel[grid](
            q, k_new, v_new, cu, k_cache, v_cache, block_meta, nctx, rope_cos, rope_sin, out, scr,
            part_acc, part_ml,
            qk_scale,
            q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_meta.stride(0), out.stride(0), out.stride(1),
            Hq, splits,
            G=G, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn, SPLIT=splits > 1,
            APPLY_ROT=rot, IEEE=q.dtype == torch.float32, SCAN=128, STAGE_Q=stage,
            num_warps=warps, num_stages=stages,
        )
        if splits > 1:
            _merge_splits_kernel[(Tq, Hq)](
                part_acc, part_ml, out, out.stride(0), out.stride(1), Hq, splits,
                HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(splits), num_warps=4 if D >= 128 else 2,
            )

    def n_splits(cfg):
        if num_splits is not None:
            return max(1, int(num_splits))
        bm = max(cfg[0], triton.next_power_of_2(G))
        bn = max(cfg[1], block_size)
        n_prog = triton.cdiv(max_seqlen_q, bm // G) * Hkv * B
        return _auto_prefill_splits(n_prog, block_meta.shape[1], bn // block_size, q.device)

    if config is None:
        if _interpreting() or not q.is_cuda:
            config = (16, 16, 1, 1)
        else:
            key = ("prefill", D, G, block_size, q.dtype, rot, stage, triton.next_power_of_2(max_seqlen_q),
                   num_splits, triton.next_power_of_2(B), triton.next_power_of_2(block_meta.shape[1]))
            config = _pick_config(key, lambda c: launch(c, n_splits(c)), _GPU_CONFIGS)
    launch(config, n_splits(config))
    return out
