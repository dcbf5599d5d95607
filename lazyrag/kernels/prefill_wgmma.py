"""LazyAttention prefill for Hopper (sm_90), written in Gluon: the rotated query tile lives in an explicit
shared-memory buffer that is rewritten once per document while the K/V copies keep running.

Same work and layout as :func:`lazyrag.kernels.prefill.lazy_prefill`'s Triton kernel (unsplit programs of
``BLOCK_M`` packed (token, q head) rows of one KV head; see :mod:`lazyrag.kernels.reference`), which picks this one
on a Hopper GPU when the context is not split. Why a second kernel: in Triton's language a query tile that changes
inside the loop is a loop-carried register value, which Triton copies through shared memory for the MMA on *every*
tile (NOTES §Kernels, round 10); a loop-invariant q instead restarts Triton's software pipeline at each document
(ROT 7). Here every step is explicit:

- Tiles: packed (``kvloop.tile_table(packed=True)``): a KV tile is ``BLOCK_N / block_size`` consecutive blocks
  whatever documents they belong to, so short documents do not each leave a part-empty tile behind (segment-aligned
  tiles, where every document starts a tile, are many more tiles for short documents: NOTES §Kernels, round 12).
- Segments: an outer loop over the tile table's segments (tiles whose first blocks share a delta; then the new
  tokens' tiles, delta 0, causal) and an inner loop over a segment's tiles, the same code with and without rotation.
- q: at a segment's start each consumer reads its rows of the original tile from global memory, rotates them
  (``scale * R(-delta) q``) and stores them to the q buffer: one store, one fence, one barrier a document.
- Mixed tiles (keys of another document than the first block's, or valid keys that are not a prefix): the producer
  rotates the keys of other documents in place in shared memory by the difference of the deltas (R(-a) q . R(b - a)
  k = R(-b) q . k) once they have landed, and each key's validity comes from its block's meta, in a separate build
  of the consumers' tile step (the table ends a segment there).
- Warp specialization (FA3's): a producer warpgroup issues the ``cp.async`` gathers from the paged cache into a ring
  of ``STAGES`` shared-memory slots and hands each tile over through an mbarrier; two consumer warpgroups of 64 rows
  each compute, give a slot back through another mbarrier once they have read it, and take turns to issue their
  MMAs (ping-pong), so that one's softmax, q store and waits run under the other's MMAs. Registers are split
  between them (setmaxnreg; tuned_configs.json ``prefill_wgmma.registers``). The producer hands tile u-1 over after
  it has waited for tile u's slot, so it needs STAGES >= 3.
- S = q K^T and O += P V are warpgroup MMAs (q, K, V from shared memory, P from registers). Tile i-1's P V is
  issued right after tile i's S and runs under tile i's softmax (FA3's intra-warpgroup overlap); both are waited
  for inside the iteration, because an MMA accumulator in flight across the loop's back edge makes ptxas
  serialize the MMAs (its warning C7515, which the Triton kernel's loop gets too).

Config (BLOCK_M, BLOCK_N, num_warps, STAGES): 12 warps (two consumer warpgroups and the producer); the device's
default in tuned_configs.json (NOTES §Kernels, round 13).
"""

from __future__ import annotations

import functools
import warnings

import torch

from .common import (  # the packed block meta's fields (common.py)
    _DELTA_MASK as DELTA_MASK,
    _DELTA_SHIFT as DELTA_SHIFT,
    _PHYS_MASK as PHYS_MASK,
    _VALID_MASK as VALID_MASK,
    _VALID_SHIFT as VALID_SHIFT,
)
from .kvloop import TILE_FIELDS  # int32 per tile-table row: first block, next segment, valid keys, delta

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # Gluon is experimental and renames things between releases (3.6 -> 3.9: thread_barrier -> barrier,
    # async_copy_global_to_shared -> async_load); both spellings compile
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    HAVE_GLUON = True
except (ImportError, AttributeError):  # Triton without Gluon (< 3.5): the Triton kernels serve every GPU
    HAVE_GLUON = False

WS_WARPS = 12  # a config's warps: two consumer warpgroups and the producer's


@functools.lru_cache(maxsize=None)
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


disabled_because: str | None = None  # set by disable(): the kernel failed to build here, the Triton one serves


def disable(reason: str) -> None:
    """Stop choosing this kernel by default in this process (``lazy_prefill`` calls it when the kernel fails to
    compile, e.g. on a Triton whose Gluon API differs from the 3.6 and 3.9 this file is written for)."""
    global disabled_because
    if disabled_because is None:
        warnings.warn(
            f"lazyrag: the Hopper prefill kernel (kernels/prefill_wgmma.py) failed to build ({reason}); "
            "prefills run on the Triton kernel from now on. Triton 3.6 is the tested version; pass "
            "kernel='wgmma' to lazy_prefill to see the error itself.",
            RuntimeWarning,
            stacklevel=3,
        )
    disabled_because = reason


def supported(dtype: torch.dtype, head_dim: int, device: torch.device, block_size: int, block_n: int) -> bool:
    """Whether this kernel can run a call: Gluon present, a Hopper GPU, 16-bit q, head dim 64 or 128, pages no
    larger than a KV tile of ``block_n`` keys."""
    return (
        HAVE_GLUON
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim in (64, 128)
        and block_size <= block_n
        and _hopper(device.index if device.index is not None else torch.cuda.current_device())
    )


if HAVE_GLUON:

    @gluon.constexpr_function
    def _copy_layout(rows, head_dim, num_warps):
        """Blocked layout for [rows, head_dim] 16-bit tiles: 16-byte vectors, a warp's threads along a row first."""
        cols = head_dim // 8
        return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])

    @gluon.jit
    def _issue_kv(
        k_dst,
        v_dst,
        u,
        n_ctx,
        n_all,
        meta,
        new_row0,
        new_len,
        K_CACHE,
        V_CACHE,
        K_NEW,
        V_NEW,
        kvh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_knt,
        stride_knh,
        stride_vnt,
        stride_vnh,
        BLOCK_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        LOAD: gl.constexpr,
    ):
        """Start the copies of tile ``u`` into ``k_dst`` / ``v_dst`` and commit them as one group (an empty group past
        the last tile, so that the group count stays one per tile). Context tiles (``u < n_ctx``): key n is slot
        n % BLOCK_SIZE of block ``meta[n]`` (packed metas, read ahead; 0 past the tile), if that block holds it;
        new-token tiles: rows ``new_row0 + key`` of K_NEW / V_NEW, keys below ``new_len``. Keys outside are
        zero-filled."""
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
        if u < n_ctx:
            phys = (meta & PHYS_MASK).to(gl.int64)
            slot = offs_n % BLOCK_SIZE
            ok = slot < ((meta >> VALID_SHIFT) & VALID_MASK).to(gl.int32)
            k_rows = phys * stride_kb + slot * stride_ks + kvh * stride_kh
            v_rows = phys * stride_vb + slot * stride_vs + kvh * stride_vh
            _async_load(k_dst, K_CACHE + k_rows[:, None] + offs_d[None, :], mask=ok[:, None])
            _async_load(v_dst, V_CACHE + v_rows[:, None] + offs_d[None, :], mask=ok[:, None])
        elif u < n_all:
            key = (u - n_ctx) * BLOCK_N + offs_n
            ok = key < new_len
            rows = (new_row0 + key).to(gl.int64)
            _async_load(
                k_dst, K_NEW + (rows * stride_knt + kvh * stride_knh)[:, None] + offs_d[None, :], mask=ok[:, None]
            )
            _async_load(
                v_dst, V_NEW + (rows * stride_vnt + kvh * stride_vnh)[:, None] + offs_d[None, :], mask=ok[:, None]
            )
        async_copy.commit_group()

    @gluon.jit
    def _tile_metas(meta_row, u, n_ctx, s0, valid, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, LOAD: gl.constexpr):
        """The packed metas of context tile ``u``'s keys (block s0 + n // BLOCK_SIZE), 0 past its keys (``valid``,
        or minus the keys its blocks span: a mixed tile of a packed table)."""
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
        return gl.load(meta_row + s0 + offs_n // BLOCK_SIZE, mask=(offs_n < gl.abs(valid)) & (u < n_ctx), other=0)

    @gluon.jit
    def _store_rotated_q(
        q_smem,
        Q,
        COS,
        SIN,
        delta,
        qk_scale,
        seq_start,
        seq_len,
        t0,
        kvh,
        stride_qt,
        stride_qh,
        ROTATE: gl.constexpr,
        G: gl.constexpr,
        BLOCK_M: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        num_warps: gl.constexpr,
        ROW0: gl.constexpr = 0,
        TILE_M: gl.constexpr = 0,
    ):
        """Write ``scale * R(-delta) q`` (ROTATE; else ``scale * q``) into the q buffer, from the original query tile
        (never an un-rotate/re-rotate pair), visible to the next MMA. Row r is token t0 + r // G of q head
        kvh * G + r % G; rows past the sequence or past the tile's whole tokens are 0. HF rotate-half: R(-d) [x1, x2]
        = [x1 c + x2 s, x2 c - x1 s]; the halves are two [BLOCK_M, HEAD_DIM / 2] loads and stores. ``ROW0`` /
        ``TILE_M``: the buffer holds rows ROW0 .. ROW0 + BLOCK_M of a TILE_M-row tile (one warpgroup's rows)."""
        HALF: gl.constexpr = HEAD_DIM // 2
        TILE_ROWS: gl.constexpr = TILE_M if TILE_M > 0 else BLOCK_M
        QL: gl.constexpr = _copy_layout(BLOCK_M, HALF, num_warps)
        offs_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, QL))
        if ROW0 > 0:
            offs_r += ROW0
        offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, QL))
        tok = t0 + offs_r // G
        ok = ((offs_r < (TILE_ROWS // G) * G) & (tok < seq_len))[:, None]
        rows = Q + ((seq_start + tok).to(gl.int64) * stride_qt + (kvh * G + offs_r % G) * stride_qh)[:, None]
        x1 = gl.load(rows + offs_h[None, :], mask=ok, other=0.0).to(gl.float32)
        x2 = gl.load(rows + HALF + offs_h[None, :], mask=ok, other=0.0).to(gl.float32)
        if ROTATE:
            c = (gl.load(COS + delta * HALF + offs_h) * qk_scale)[None, :]
            sn = (gl.load(SIN + delta * HALF + offs_h) * qk_scale)[None, :]
            q_smem.slice(0, HALF, dim=1).store((x1 * c + x2 * sn).to(q_smem.dtype))
            q_smem.slice(HALF, HALF, dim=1).store((x2 * c - x1 * sn).to(q_smem.dtype))
        else:
            q_smem.slice(0, HALF, dim=1).store((x1 * qk_scale).to(q_smem.dtype))
            q_smem.slice(HALF, HALF, dim=1).store((x2 * qk_scale).to(q_smem.dtype))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _keep(i, n_ctx, valid, offs_n, tok, BLOCK_N: gl.constexpr):
        """Tile i's visible keys: a prefix (``valid``) of a context tile, whose keys count as negative here so that
        the causal test passes; causal for the new tokens (a real row's keys end before hi_new, where the copies
        end)."""
        lim = gl.where(i < n_ctx, valid, BLOCK_N)
        key = (i - n_ctx) * BLOCK_N + offs_n
        return (offs_n < lim)[None, :] & (key[None, :] <= tok[:, None])

    @gluon.jit
    def _mask_mixed_keys(s, meta_row, s0, span, offs_n, BLOCK_SIZE: gl.constexpr):
        """S of a mixed tile with the keys its blocks do not hold (slot >= the block's valid count) masked."""
        meta = gl.load(meta_row + s0 + offs_n // BLOCK_SIZE, mask=offs_n < span, other=0)
        held = offs_n % BLOCK_SIZE < ((meta >> VALID_SHIFT) & VALID_MASK).to(gl.int32)
        return gl.where(held[None, :], s, float("-inf"))

    @gluon.jit
    def _relative_deltas(
        meta_row, s0, span, delta_q, r0, ROWS: gl.constexpr, BLOCK_SIZE: gl.constexpr, RL: gl.constexpr
    ):
        """Keys r0 .. r0 + ROWS of a mixed tile: their block's delta minus the query's (0 past the tile)."""
        offs_r = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, RL))
        inside = offs_r < span
        meta = gl.load(meta_row + s0 + offs_r // BLOCK_SIZE, mask=inside, other=0)
        return gl.where(inside, ((meta >> DELTA_SHIFT) & DELTA_MASK).to(gl.int32) - delta_q, 0)

    @gluon.jit
    def _rotate_rows(rows, rel, COS, SIN, HALF: gl.constexpr, RL: gl.constexpr):
        """rows[r] = R(rel[r]) rows[r] in shared memory (HF rotate-half), rows with rel 0 untouched."""
        offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, RL))
        moved = (rel != 0)[:, None]
        at = gl.abs(rel)[:, None] * HALF + offs_h[None, :]
        c = gl.load(COS + at, mask=moved, other=1.0)
        sn = gl.load(SIN + at, mask=moved, other=0.0)
        sn = gl.where((rel < 0)[:, None], -sn, sn)  # R(-x): cos x, -sin x
        lo = rows.slice(0, HALF, dim=1)
        hi = rows.slice(HALF, HALF, dim=1)
        x1 = lo.load(RL).to(gl.float32)
        x2 = hi.load(RL).to(gl.float32)
        lo.store((x1 * c - x2 * sn).to(rows.dtype))
        hi.store((x2 * c + x1 * sn).to(rows.dtype))

    @gluon.jit
    def _segment(tiles_row, t, n_ctx, n_all):
        """The segment starting at tile t: (its end, its delta, whether its last tile is mixed); past the context,
        the new tokens' tiles (delta 0)."""
        if t < n_ctx:
            t_end = gl.minimum(gl.load(tiles_row + TILE_FIELDS * t + 1), n_ctx)
            delta = gl.load(tiles_row + TILE_FIELDS * t + 3)
            last_mixed = gl.load(tiles_row + TILE_FIELDS * (t_end - 1) + 2) < 0
        else:
            t_end = n_all
            delta = t * 0
            last_mixed = t < 0
        return t_end, delta, last_mixed

    @gluon.jit
    def _store_out(
        OUT, out, offs_r, offs_d, t0, seq_start, seq_len, kvh, stride_ot, stride_oh, G: gl.constexpr, TOK: gl.constexpr
    ):
        """Output rows ``offs_r`` of the tile (row r: token t0 + r // G, q head kvh * G + r % G), those of whole
        tokens inside the sequence."""
        o_tok = t0 + offs_r // G
        o_rows = (seq_start + o_tok).to(gl.int64) * stride_ot + (kvh * G + offs_r % G) * stride_oh
        o_ok = (offs_r < TOK * G) & (o_tok < seq_len)
        gl.store(OUT + o_rows[:, None] + offs_d[None, :], out, mask=o_ok[:, None])

    @gluon.jit
    def _softmax_step(s, m_i, l_i):
        """Online softmax in base 2 (scale and log2(e) are folded into q): (p, the old rows' rescale, m, l)."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    # -- two consumer warpgroups of 64 rows each and a producer warpgroup, synchronised by mbarriers, so that one
    # consumer's softmax, q stores and waits run under the other's MMAs, and the copies and the mixed tiles' key
    # rotation leave the consumers' path. Barriers: full[s] (the producer's arrival: slot s holds its tile),
    # empty[s] (both consumers': slot s is free), turn[w] (the other consumer's: consumer w may issue its MMAs);
    # phases alternate every STAGES tiles (every tile for turn), and a wait for the phase before the first passes
    @gluon.jit
    def _ws_attend_tile(
        i,
        q_rows,
        k_smem,
        v_smem,
        full,
        empty,
        turn,
        s_zero,
        acc,
        m_i,
        l_i,
        p_op,
        valid_cur,
        n_ctx,
        offs_n,
        tok_s,
        tiles_row,
        meta_row,
        MIXED: gl.constexpr,
        WG: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        p_layout: gl.constexpr,
        row_o: gl.constexpr,
    ):
        """One KV tile in consumer WG: S = q K^T of tile i (its keys already rotated by the producer), O += P V of
        tile i-1 under tile i's softmax, then tile i-1's slot handed back to the producer. MIXED: the keys its
        blocks do not hold are masked (``valid_cur`` = minus its span). The two consumers take turns to issue their
        MMAs (FA3's ping-pong), so that one's softmax runs while the other's MMAs do."""
        mbarrier.wait(full.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.wait(turn.index(WG), (i & 1) ^ (1 - WG))  # consumer 0 goes first
        s_t = warpgroup_mma(q_rows, k_smem.index(i % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_t = warpgroup_mma(p_op, v_smem.index(gl.maximum(i - 1, 0) % STAGES), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - WG))
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
        if MIXED:
            s = _mask_mixed_keys(s, meta_row, gl.load(tiles_row + TILE_FIELDS * i), -valid_cur, offs_n, BLOCK_SIZE)
        else:
            s = gl.where(_keep(i, n_ctx, valid_cur, offs_n, tok_s, BLOCK_N), s, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)  # tile i-1's K and V are read
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(p_op.dtype), p_layout)
        return acc, m_i, l_i, p_op

    @gluon.jit
    def _ws_consumer(
        q_smem,
        k_smem,
        v_smem,
        full,
        empty,
        turn,
        Q,
        COS,
        SIN,
        OUT,
        META,
        TILES,
        NUM_TILES,
        qk_scale,
        b,
        kvh,
        seq_start,
        seq_len,
        t0,
        stride_qt,
        stride_qh,
        stride_mb,
        stride_tb,
        stride_ot,
        stride_oh,
        WG: gl.constexpr,
        G: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        TILE_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        ROTATE: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Rows ROW0 .. ROW0 + 64 of the query tile (ROW0 = 64 WG): per segment its q rows rotated into its own
        part of the q buffer, then the segment's tiles as the producer hands them over; writes its rows of the
        output."""
        ROWS: gl.constexpr = 16 * num_warps  # one warpgroup
        ROW0: gl.constexpr = WG * ROWS
        TOK: gl.constexpr = TILE_M // G
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        q_rows = q_smem.slice(ROW0, ROWS, dim=0)
        meta_row = META + b.to(gl.int64) * stride_mb
        tiles_row = TILES + b.to(gl.int64) * stride_tb
        n_ctx = gl.load(NUM_TILES + b)
        hi_new = gl.minimum(t0 + TOK, seq_len)
        n_all = n_ctx + gl.cdiv(hi_new, BLOCK_N)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        tok_s = t0 + (ROW0 + gl.arange(0, ROWS, layout=row_s)) // G
        m_i = gl.full([ROWS], -1.0e30, gl.float32, row_s)
        l_i = gl.zeros([ROWS], gl.float32, row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        p_op = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
        t = n_ctx * 0
        while t < n_all:
            t_end, delta, last_mixed = _segment(tiles_row, t, n_ctx, n_all)
            # this warpgroup's S MMAs of the previous segment are done (waited in its last tile)
            _store_rotated_q(
                q_rows,
                Q,
                COS,
                SIN,
                delta,
                qk_scale,
                seq_start,
                seq_len,
                t0,
                kvh,
                stride_qt,
                stride_qh,
                ROTATE,
                G,
                ROWS,
                HEAD_DIM,
                num_warps,
                ROW0,
                TILE_M,
            )
            for i in range(t, t_end - last_mixed.to(gl.int32)):
                valid_cur = gl.load(tiles_row + TILE_FIELDS * i + 2, mask=i < n_ctx, other=0)
                acc, m_i, l_i, p_op = _ws_attend_tile(
                    i,
                    q_rows,
                    k_smem,
                    v_smem,
                    full,
                    empty,
                    turn,
                    s_zero,
                    acc,
                    m_i,
                    l_i,
                    p_op,
                    valid_cur,
                    n_ctx,
                    offs_n,
                    tok_s,
                    tiles_row,
                    meta_row,
                    False,
                    WG,
                    BLOCK_SIZE,
                    BLOCK_N,
                    STAGES,
                    p_layout,
                    row_o,
                )
            if last_mixed:
                valid_cur = gl.load(tiles_row + TILE_FIELDS * (t_end - 1) + 2)
                acc, m_i, l_i, p_op = _ws_attend_tile(
                    t_end - 1,
                    q_rows,
                    k_smem,
                    v_smem,
                    full,
                    empty,
                    turn,
                    s_zero,
                    acc,
                    m_i,
                    l_i,
                    p_op,
                    valid_cur,
                    n_ctx,
                    offs_n,
                    tok_s,
                    tiles_row,
                    meta_row,
                    True,
                    WG,
                    BLOCK_SIZE,
                    BLOCK_N,
                    STAGES,
                    p_layout,
                    row_o,
                )
            t = t_end
        acc_t = warpgroup_mma(p_op, v_smem.index((n_all - 1) % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
        # stored from the MMA layout: a layout conversion would need shared memory, which the K/V ring fills
        out = (acc / gl.convert_layout(l_i, row_o)[:, None]).to(OUT.dtype.element_ty)
        offs_or = ROW0 + gl.arange(0, ROWS, layout=row_o)
        offs_od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        _store_out(OUT, out, offs_or, offs_od, t0, seq_start, seq_len, kvh, stride_ot, stride_oh, G, TOK)

    @gluon.jit
    def _ws_rotate_keys(
        k_slot,
        meta_row,
        s0,
        span,
        delta_q,
        COS,
        SIN,
        BLOCK_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        CHUNK: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """A mixed tile's keys, in place in their slot, in CHUNK-row steps (the producer has few registers): key n
        (block s0 + n // BLOCK_SIZE, delta d) becomes R(d - delta_q) k, so that the query rotated for ``delta_q``
        sees each key at its document's offset (R(-a) q . R(b - a) k = R(-b) q . k)."""
        HALF: gl.constexpr = HEAD_DIM // 2
        RL: gl.constexpr = _copy_layout(CHUNK, HALF, num_warps)
        for c in gl.static_range(BLOCK_N // CHUNK):
            rel = _relative_deltas(meta_row, s0, span, delta_q, c * CHUNK, CHUNK, BLOCK_SIZE, RL)
            _rotate_rows(k_slot.slice(c * CHUNK, CHUNK, dim=0), rel, COS, SIN, HALF, RL)

    @gluon.jit
    def _ws_producer(
        k_smem,
        v_smem,
        full,
        empty,
        K_CACHE,
        V_CACHE,
        K_NEW,
        V_NEW,
        META,
        TILES,
        NUM_TILES,
        COS,
        SIN,
        b,
        kvh,
        seq_start,
        seq_len,
        t0,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_knt,
        stride_knh,
        stride_vnt,
        stride_vnh,
        stride_mb,
        stride_tb,
        G: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        TILE_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        ROTATE: gl.constexpr,
        KEY_CHUNK: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Tile u's K/V copies into slot u % STAGES once the consumers handed it back; tile u-1 is handed over
        when its copies have landed (a mixed tile's keys of other documents rotated first, in place)."""
        LOAD: gl.constexpr = _copy_layout(BLOCK_N, HEAD_DIM, num_warps)
        meta_row = META + b.to(gl.int64) * stride_mb
        tiles_row = TILES + b.to(gl.int64) * stride_tb
        n_ctx = gl.load(NUM_TILES + b)
        hi_new = gl.minimum(t0 + TILE_M // G, seq_len)
        n_all = n_ctx + gl.cdiv(hi_new, BLOCK_N)
        for u in range(n_all + 1):
            s0 = gl.load(tiles_row + TILE_FIELDS * u, mask=u < n_ctx, other=0)
            valid = gl.load(tiles_row + TILE_FIELDS * u + 2, mask=u < n_ctx, other=0)
            meta = _tile_metas(meta_row, u, n_ctx, s0, valid, BLOCK_SIZE, BLOCK_N, LOAD)
            mbarrier.wait(empty.index(u % STAGES), ((u // STAGES) & 1) ^ 1, pred=u < n_all)
            _issue_kv(
                k_smem.index(u % STAGES),
                v_smem.index(u % STAGES),
                u,
                n_ctx,
                n_all,
                meta,
                seq_start,
                hi_new,
                K_CACHE,
                V_CACHE,
                K_NEW,
                V_NEW,
                kvh,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                stride_knt,
                stride_knh,
                stride_vnt,
                stride_vnh,
                BLOCK_SIZE,
                BLOCK_N,
                HEAD_DIM,
                LOAD,
            )
            if u > 0:
                f = u - 1
                async_copy.wait_group(1)  # tile f's copies (this thread's); tile u's may run on
                valid_f = gl.load(tiles_row + TILE_FIELDS * f + 2, mask=f < n_ctx, other=0)
                if ROTATE:
                    if valid_f < 0:
                        _cta_barrier()  # every producer thread's copies of tile f
                        _ws_rotate_keys(
                            k_smem.index(f % STAGES),
                            meta_row,
                            gl.load(tiles_row + TILE_FIELDS * f),
                            -valid_f,
                            gl.load(tiles_row + TILE_FIELDS * f + 3),
                            COS,
                            SIN,
                            BLOCK_SIZE,
                            BLOCK_N,
                            HEAD_DIM,
                            KEY_CHUNK,
                            num_warps,
                        )
                fence_async_shared()
                mbarrier.arrive(full.index(f % STAGES))
        async_copy.wait_group(0)

    @gluon.jit
    def _lazy_prefill_ws_kernel(
        Q,
        K_NEW,
        V_NEW,
        CU_SEQLENS,
        K_CACHE,
        V_CACHE,
        META,
        TILES,
        NUM_TILES,
        COS,
        SIN,
        OUT,
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
        G: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        ROTATE: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        KEY_CHUNK: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        TOK: gl.constexpr = BLOCK_M // G
        dtype: gl.constexpr = Q.dtype.element_ty
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        tile = gl.program_id(0)
        kvh = gl.program_id(1)
        b = gl.program_id(2)
        seq_start = gl.load(CU_SEQLENS + b)
        seq_len = gl.load(CU_SEQLENS + b + 1) - seq_start
        t0 = tile * TOK
        if t0 < seq_len:
            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_smem_layout)
            k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem_layout)
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem_layout)
            full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(full.index(s), count=1)  # the producer's arrival
                mbarrier.init(empty.index(s), count=2)  # both consumers'
            for w in gl.static_range(2):
                mbarrier.init(turn.index(w), count=1)  # the other consumer's
            gl.warp_specialize(
                [
                    (
                        _ws_consumer,
                        (
                            q_smem,
                            k_smem,
                            v_smem,
                            full,
                            empty,
                            turn,
                            Q,
                            COS,
                            SIN,
                            OUT,
                            META,
                            TILES,
                            NUM_TILES,
                            qk_scale,
                            b,
                            kvh,
                            seq_start,
                            seq_len,
                            t0,
                            stride_qt,
                            stride_qh,
                            stride_mb,
                            stride_tb,
                            stride_ot,
                            stride_oh,
                            0,
                            G,
                            HEAD_DIM,
                            BLOCK_SIZE,
                            BLOCK_M,
                            BLOCK_N,
                            STAGES,
                            ROTATE,
                            num_warps,
                        ),
                    ),
                    (
                        _ws_consumer,
                        (
                            q_smem,
                            k_smem,
                            v_smem,
                            full,
                            empty,
                            turn,
                            Q,
                            COS,
                            SIN,
                            OUT,
                            META,
                            TILES,
                            NUM_TILES,
                            qk_scale,
                            b,
                            kvh,
                            seq_start,
                            seq_len,
                            t0,
                            stride_qt,
                            stride_qh,
                            stride_mb,
                            stride_tb,
                            stride_ot,
                            stride_oh,
                            1,
                            G,
                            HEAD_DIM,
                            BLOCK_SIZE,
                            BLOCK_M,
                            BLOCK_N,
                            STAGES,
                            ROTATE,
                            num_warps,
                        ),
                    ),
                    (
                        _ws_producer,
                        (
                            k_smem,
                            v_smem,
                            full,
                            empty,
                            K_CACHE,
                            V_CACHE,
                            K_NEW,
                            V_NEW,
                            META,
                            TILES,
                            NUM_TILES,
                            COS,
                            SIN,
                            b,
                            kvh,
                            seq_start,
                            seq_len,
                            t0,
                            stride_kb,
                            stride_ks,
                            stride_kh,
                            stride_vb,
                            stride_vs,
                            stride_vh,
                            stride_knt,
                            stride_knh,
                            stride_vnt,
                            stride_vnh,
                            stride_mb,
                            stride_tb,
                            G,
                            HEAD_DIM,
                            BLOCK_SIZE,
                            BLOCK_M,
                            BLOCK_N,
                            STAGES,
                            ROTATE,
                            KEY_CHUNK,
                            4,
                        ),
                    ),
                ],
                [num_warps, 4],
                [CONSUMER_REGS, PRODUCER_REGS],
            )


def lazy_prefill_wgmma(
    q,
    k_new,
    v_new,
    cu,
    k_cache,
    v_cache,
    block_meta,
    tiles,
    n_tiles,
    rope_cos,
    rope_sin,
    qk_scale,
    out,
    grid,
    config,
    registers,
    key_chunk,
    apply_rotation=True,
):
    """Launch the kernel on prepared arguments (``prefill.run_prefill`` checks and converts them; ``tiles``,
    ``n_tiles``: its packed tile table for ``BLOCK_N // block_size`` pages a tile; ``qk_scale`` includes log2(e);
    ``grid``: (query tiles of ``BLOCK_M // G`` tokens, KV heads, sequences); ``config`` (BLOCK_M, BLOCK_N, 12,
    STAGES); ``registers`` (consumer, producer) a thread; ``key_chunk``: the producer's rows a step when it rotates
    a mixed tile's keys). Returns the compiled kernel (for the launch record)."""
    bm, bn, warps, stages = config
    D = q.shape[2]
    G = q.shape[1] // k_new.shape[1]
    assert warps == WS_WARPS, "num_warps: 12 (two consumer warpgroups and the producer)"
    assert bm == 64 * ((warps - 4) // 4) and G <= bm, "BLOCK_M: 64 rows a warpgroup, at least one token"
    # the producer hands tile u-1 over after it has waited for tile u's slot, which the consumers give back
    # after tile u-STAGES+1: with two stages that would wait on itself
    assert stages >= 3, "STAGES: at least 3"
    compiled = _lazy_prefill_ws_kernel[grid](
        q,
        k_new,
        v_new,
        cu,
        k_cache,
        v_cache,
        block_meta,
        tiles,
        n_tiles,
        rope_cos,
        rope_sin,
        out,
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
        block_meta.stride(0),
        tiles.stride(0),
        out.stride(0),
        out.stride(1),
        G=G,
        HEAD_DIM=D,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=bm,
        BLOCK_N=bn,
        STAGES=stages,
        ROTATE=apply_rotation,
        num_warps=4,
        CONSUMER_REGS=registers[0],
        PRODUCER_REGS=registers[1],
        KEY_CHUNK=key_chunk,
    )
    return compiled
