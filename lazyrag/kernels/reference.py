"""PyTorch reference for the LazyAttention kernels, and the layout they share.

Layout (one place for it; the engine and the Triton kernels both follow it):

* The paged KV pool of one layer is ``k_cache, v_cache: [num_blocks, block_size, H_kv, D]``.
* A cached segment (a document chunk, the shared prefix, or a sequence's own tokens)
  owns whole blocks. Its keys are stored rotated at the positions where it was
  *encoded*; when the segment is placed so that its tokens sit ``delta`` positions
  later, every key must be rotated by a further ``R(delta)``.
* A sequence's context is a list of blocks, each described by one int64
  ``[phys_block:32 | delta:24 | valid:8]`` (``kernels/common.py``: :func:`pack_block_meta`): the physical
  block id, the position offset of the segment it belongs to, and how many of its
  ``block_size`` slots hold real tokens (padding is masked).
* RoPE is the Hugging Face "rotate half" form: for ``x = [x1, x2]`` (two halves of
  the head dim) ``R(t) x = [x1 cos - x2 sin, x2 cos + x1 sin]`` with
  ``cos = rope_cos[t]``, ``sin = rope_sin[t]`` of shape ``[D/2]``. Tables are fp32
  ``[max_positions, D/2]`` so that every rope type with static frequencies
  (default, linear, Llama-3, YaRN's frequencies) goes through the same code.

The reference *materialises* the re-rotated keys (``k' = R(delta) k``) and runs plain
attention in fp32. The Triton kernels instead rotate the query tile once per document
by ``-delta``; since ``<R(n) q, R(delta) R(s) k> = <R(-delta) R(n) q, R(s) k>``, the two
agree up to rounding, which is what the tests check.
"""

from __future__ import annotations

import torch

from .common import unpack_block_meta


def rope_tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, D/2]`` in fp32 for pure rotations."""
    t = torch.arange(max_positions, dtype=torch.float64, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.to(torch.float64))
    return freqs.cos().float(), freqs.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., D]`` by angles whose cos/sin ``[..., D/2]`` broadcast against it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def gather_contexts(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_meta: torch.Tensor,
    num_blocks: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Materialise each sequence's context keys (re-rotated by each block's delta) and values.

    block_meta: [B, W] packed; num_blocks: [B]. Returns k, v: [B, W * block_size, H_kv, D] in fp32 and
    ``valid`` [B, W * block_size] (False for padding slots and blocks past a sequence's own).
    """
    B, W = block_meta.shape
    block_ids, deltas, valid = unpack_block_meta(block_meta)
    block_size = k_cache.shape[1]
    k = apply_rotary(k_cache[block_ids].float(), rope_cos[deltas][:, :, None, None], rope_sin[deltas][:, :, None, None])
    v = v_cache[block_ids].float()  # [B, W, bs, Hkv, D]
    slot = torch.arange(block_size, device=k.device)
    ok = (slot[None, None, :] < valid[:, :, None]) & (
        torch.arange(W, device=k.device)[None, :, None] < num_blocks[:, None, None].long()
    )
    # padding slots hold whatever the pool held: zero them, since a masked weight times NaN is still NaN
    k, v = (t.masked_fill(~ok[..., None, None], 0.0) for t in (k, v))
    return k.flatten(1, 2), v.flatten(1, 2), ok.flatten(1)


def gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta_row: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context (``meta_row``: [n_blocks] packed): k, v [n_valid_tokens, H_kv, D] in fp32."""
    n = torch.tensor([meta_row.numel()], device=meta_row.device)
    k, v, ok = gather_contexts(k_cache, v_cache, meta_row[None], n, rope_cos, rope_sin)
    return k[0][ok[0]], v[0][ok[0]]


def gather_rotated_reference(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``slots`` [N] of one layer's pool (``k``, ``v``: [slots, Hkv, D]), keys rotated in fp32 by ``delta`` [N]:
    K, V [N, Hkv, D] in the pool's dtype (kernels/recompute.py's ``gather_rotated``)."""
    kr = apply_rotary(k[slots].float(), cos[delta][:, None], sin[delta][:, None])
    return kr.to(k.dtype), v[slots]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Softmax attention in fp32 with grouped KV heads.

    q: [B, n, Hq, D]; k, v: [B, L, Hkv, D]; mask: [B, n, L] bool (True = attend). A row that may attend
    nowhere (batch padding) attends everywhere rather than produce NaN. Returns [B, n, Hq, D] fp32.
    """
    group = q.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
    mask = mask | ~mask.any(-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=sm_scale
    )
    return out.transpose(1, 2)


def prefix_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """What kernels/recompute.py's ``prefix_attention`` computes, as a dense fp32 mask over ``attend``: each query of
    ``q`` [S, Hq, D] over the first ``limit`` [S] keys of ``k``, ``v`` [N, Hkv, D]; returns [S, Hq, D] fp32."""
    mask = torch.arange(k.shape[0], device=k.device)[None, :] < limit.to(k.device)[:, None]
    return attend(q[None], k[None], v[None], mask[None], sm_scale)[0]


def lazy_prefill_reference(
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
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context plus, causally, its new tokens.

    q: [Tq, Hq, D] and k_new, v_new: [Tq, H_kv, D], all rotated at their true positions;
    cu_seqlens_q: [B+1] int; block_meta: [B, max_blocks] int64 packed; num_ctx_blocks: [B].
    The whole context precedes every new token, so only the new tokens need a causal mask.
    Returns [Tq, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = e - s
        if n == 0:
            continue
        kc, vc = gather_context(k_cache, v_cache, block_meta[b, : int(num_ctx_blocks[b])], rope_cos, rope_sin)
        k = torch.cat((kc, k_new[s:e].float()))
        v = torch.cat((vc, v_new[s:e].float()))
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        mask = torch.cat((torch.ones(n, kc.shape[0], dtype=torch.bool, device=q.device), causal), dim=1)
        out[s:e] = attend(q[None, s:e], k[None], v[None], mask[None], sm_scale)[0].to(q.dtype)
    return out


def lazy_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_meta: torch.Tensor,
    num_blocks: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """One query row per sequence over all of its blocks (the new token's own K/V already written).

    q: [B, Hq, D] rotated at its true position; block_meta: [B, max_blocks]; num_blocks: [B].
    Returns [B, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        k, v = gather_context(k_cache, v_cache, block_meta[b, : int(num_blocks[b])], rope_cos, rope_sin)
        everywhere = torch.ones(1, 1, k.shape[0], dtype=torch.bool, device=q.device)
        out[b] = attend(q[None, b : b + 1], k[None], v[None], everywhere, sm_scale)[0, 0].to(q.dtype)
    return out
