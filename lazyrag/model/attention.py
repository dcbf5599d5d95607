"""Attention backends: where the model hands a layer's attention to a kernel.

Every backend computes the same function (kernels/reference.py defines it) over the
paged pool; the model neither knows nor cares whether keys are rotated lazily.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lazyrag.kernels import reference


@dataclass
class AttentionMetadata:
    """What one forward pass needs to know about its batch's KV layout.

    Prefill: the new tokens of B sequences, packed ``[T]``; each attends to its cached
    context blocks (``block_meta[b, :num_ctx_blocks[b]]``) and, causally, to its own new tokens.
    Decode: one new token per sequence; ``block_meta`` already includes the block holding it.
    """

    is_decode: bool
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    block_meta: torch.Tensor  # [B, max_blocks] int64, packed [phys:32 | delta:24 | valid:8]
    num_ctx_blocks: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64: pool slot (block * block_size + offset) for each new token's K/V
    max_seqlen_q: int = 0
    # kernels' per-batch derived tables (Triton tile tables), built by the first layer, reused by the rest
    kernel_cache: dict = field(default_factory=dict, repr=False, compare=False)


class TorchAttention:
    """PyTorch attention for CPU (and CUDA without Triton): the whole batch in one SDPA call.

    Computes what ``kernels/reference.py`` specifies, but batched: every sequence's context
    blocks are gathered and re-rotated at once (padded to the widest block table), its new
    tokens padded to the longest, and one masked ``scaled_dot_product_attention`` runs per
    layer. The per-sequence reference loop cost most of a CPU pre-cache run.
    """

    name = "torch"

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, rope_cos, rope_sin, sm_scale):
        B = meta.num_ctx_blocks.numel()
        block_size = k_cache.shape[1]
        nctx = meta.num_ctx_blocks.long()
        width = int(nctx.max()) if B else 0
        block_ids, deltas, valid = reference.unpack_block_meta(meta.block_meta[:, :width])
        # context keys re-rotated by their block's delta: [B, width * bs, Hkv, D]
        kc = reference.apply_rotary(k_cache[block_ids].float(), rope_cos[deltas][:, :, None, None], rope_sin[deltas][:, :, None, None])
        vc = v_cache[block_ids].float()
        kc, vc = kc.flatten(1, 2), vc.flatten(1, 2)
        slot = torch.arange(block_size, device=q.device)
        ctx_ok = (slot[None, None, :] < valid[:, :, None]) & (torch.arange(width, device=q.device)[None, :, None] < nctx[:, None, None])
        ctx_ok = ctx_ok.flatten(1)  # [B, width * bs]
        if meta.is_decode:  # the new token's K/V is already in the pool: context only
            out = self._attend(q[:, None].float(), kc, vc, ctx_ok[:, None, :], sm_scale)
            return out[:, 0].to(q.dtype)
        # new tokens, padded per sequence: [B, n, ...]
        cu = meta.cu_seqlens_q.long()
        lens = cu[1:] - cu[:-1]
        n = int(lens.max())
        pos = torch.arange(n, device=q.device)
        new_ok = pos[None, :] < lens[:, None]  # [B, n]
        idx = (cu[:-1, None] + pos[None, :]).clamp(max=q.shape[0] - 1)
        qp, kp, vp = (t.float()[idx] for t in (q, k, v))
        causal = (pos[None, :, None] >= pos[None, None, :]) & new_ok[:, None, :]  # [B, n, n]
        mask = torch.cat((ctx_ok[:, None, :].expand(B, n, -1), causal), dim=2)
        out = self._attend(qp, torch.cat((kc, kp), 1), torch.cat((vc, vp), 1), mask, sm_scale)
        return out[new_ok].to(q.dtype)  # packed back to [T, Hq, D]

    @staticmethod
    def _attend(q, k, v, mask, sm_scale):
        # q: [B, n, Hq, D]; k, v: [B, L, Hkv, D]; mask: [B, n, L] (True = attend)
        group = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        mask = mask | ~mask.any(-1, keepdim=True)  # padding rows: attend anywhere rather than produce NaN
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=sm_scale
        )
        return out.transpose(1, 2)  # [B, n, Hq, D]


class TritonAttention:
    """LazyAttention Triton kernels: the query is rotated by -delta once per document."""

    name = "triton"

    def __init__(self):
        from lazyrag.kernels.decode import lazy_decode
        from lazyrag.kernels.prefill import lazy_prefill

        self._prefill, self._decode = lazy_prefill, lazy_decode

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, rope_cos, rope_sin, sm_scale):
        if meta.is_decode:
            return self._decode(q, k_cache, v_cache, meta.block_meta, meta.num_ctx_blocks, rope_cos, rope_sin, sm_scale,
                                tile_cache=meta.kernel_cache)
        return self._prefill(
            q, k, v, meta.cu_seqlens_q, k_cache, v_cache, meta.block_meta, meta.num_ctx_blocks,
            rope_cos, rope_sin, sm_scale, max_seqlen_q=meta.max_seqlen_q, tile_cache=meta.kernel_cache,
        )


def make_attention_backend(name: str | None, device: torch.device):
    """``None`` picks Triton on CUDA and the PyTorch reference elsewhere."""
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        if device.type != "cuda":
            import os

            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "The Triton backend needs a CUDA device; on CPU use attention='torch' "
                    "(or set TRITON_INTERPRET=1 before importing lazyrag, which is slow and meant for tests)."
                )
        return TritonAttention()
    raise ValueError(f"Unknown attention backend {name!r}: choose 'torch' or 'triton'.")
