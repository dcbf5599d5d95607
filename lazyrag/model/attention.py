"""Attention backends: where the model hands a layer's attention to a kernel.

Every backend computes the same function (kernels/reference.py defines it) over the
paged pool; the model neither knows nor cares whether keys are rotated lazily.
"""
from __future__ import annotations

from dataclasses import dataclass

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


class TorchAttention:
    """The PyTorch reference (materialised re-rotated keys, fp32 math): CPU and CUDA."""

    name = "torch"

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, rope_cos, rope_sin, sm_scale):
        if meta.is_decode:
            return reference.lazy_decode_reference(
                q, k_cache, v_cache, meta.block_meta, meta.num_ctx_blocks, rope_cos, rope_sin, sm_scale
            )
        return reference.lazy_prefill_reference(
            q, k, v, meta.cu_seqlens_q, k_cache, v_cache, meta.block_meta, meta.num_ctx_blocks, rope_cos, rope_sin, sm_scale
        )


class TritonAttention:
    """LazyAttention Triton kernels: the query is rotated by -delta once per document."""

    name = "triton"

    def __init__(self):
        from lazyrag.kernels.decode import lazy_decode
        from lazyrag.kernels.prefill import lazy_prefill

        self._prefill, self._decode = lazy_prefill, lazy_decode

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, rope_cos, rope_sin, sm_scale):
        if meta.is_decode:
            return self._decode(q, k_cache, v_cache, meta.block_meta, meta.num_ctx_blocks, rope_cos, rope_sin, sm_scale)
        return self._prefill(
            q, k, v, meta.cu_seqlens_q, k_cache, v_cache, meta.block_meta, meta.num_ctx_blocks,
            rope_cos, rope_sin, sm_scale, max_seqlen_q=meta.max_seqlen_q,
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
