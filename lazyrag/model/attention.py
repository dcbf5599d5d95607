"""Attention backends: where the model hands a layer's attention to a kernel.

Every backend computes the same function (kernels/reference.py defines it) over the
paged pool; the model neither knows nor cares whether keys are rotated lazily.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    """PyTorch attention for CPU (and CUDA without Triton), built on the kernels' reference: the batch's
    contexts gathered and re-rotated at once (``reference.gather_contexts``), new tokens padded to the
    longest, and one masked ``reference.attend`` per layer."""

    name = "torch"

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, rope_cos, rope_sin, sm_scale):
        width = int(meta.num_ctx_blocks.max()) if meta.num_ctx_blocks.numel() else 0
        kc, vc, ctx_ok = reference.gather_contexts(k_cache, v_cache, meta.block_meta[:, :width], meta.num_ctx_blocks,
                                                   rope_cos, rope_sin)  # [B, width * bs, Hkv, D]
        if meta.is_decode:  # the new token's K/V is already in the pool: context only
            return reference.attend(q[:, None], kc, vc, ctx_ok[:, None, :], sm_scale)[:, 0].to(q.dtype)
        # new tokens, padded per sequence: [B, n, ...]
        cu = meta.cu_seqlens_q.long()
        lens = cu[1:] - cu[:-1]
        n = int(lens.max())
        pos = torch.arange(n, device=q.device)
        new_ok = pos[None, :] < lens[:, None]  # [B, n]
        idx = (cu[:-1, None] + pos[None, :]).clamp(max=q.shape[0] - 1)
        qp, kp, vp = q[idx], k[idx], v[idx]
        causal = (pos[None, :, None] >= pos[None, None, :]) & new_ok[:, None, :]  # [B, n, n]
        mask = torch.cat((ctx_ok[:, None, :].expand(-1, n, -1), causal), dim=2)
        out = reference.attend(qp, torch.cat((kc, kp.float()), 1), torch.cat((vc, vp.float()), 1), mask, sm_scale)
        return out[new_ok].to(q.dtype)  # packed back to [T, Hq, D]


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
