"""Attention backends: where the model hands a layer's attention to a kernel.

Every backend computes the same function (kernels/reference.py defines it) over the
paged pool; the model neither knows nor cares whether keys are rotated lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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
    # kernels' per-batch plan and derived tables (Triton tile tables), built by the first layer, reused by the rest
    kernel_cache: dict = field(default_factory=dict, repr=False, compare=False)


def _words(n: int, item: int = 8) -> int:
    """int64 words that hold n items of ``item`` bytes, rounded up to 16 bytes (each section aligned)."""
    w = -(-n * item // 8)
    return w + (w & 1)


def _sections(T: int, B: int, W: int) -> tuple[int, ...]:
    """Word offsets of ids, positions, slots, block_meta, num_ctx, cu, and the total size."""
    offs, o = [], 0
    for n, item in ((T, 8), (T, 8), (T, 8), (B * W, 8), (B, 4), (B + 1, 4)):
        offs.append(o)
        o += _words(n, item)
    return (*offs, o)


@dataclass
class HostBatch:
    """One forward pass's inputs, built on the host (numpy) and sent to the device in ONE copy:
    a flat int64 buffer ``[ids T | positions T | slots T | block_meta B*W | num_ctx B (int32) | cu B+1 (int32)]``,
    each section starting on 16 bytes."""

    is_decode: bool
    ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    meta: list[np.ndarray]  # per sequence: its packed block metas
    cu: np.ndarray  # [B+1] int64 (cumulative new tokens)
    max_seqlen_q: int

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def batch(self) -> int:
        return len(self.meta)

    @property
    def width(self) -> int:
        return max(1, max(map(len, self.meta)))

    @staticmethod
    def size(T: int, B: int, W: int) -> int:
        return _sections(T, B, W)[-1]

    def fill(self, buf: np.ndarray, T: int, B: int, W: int, pad_slot: int) -> None:
        """Write the batch into ``buf`` laid out for (T tokens, B sequences, W blocks) >= its own;
        padding tokens get id 0, position 0 and ``pad_slot``; padding sequences no context and, in
        decode, one padding token each (prefill: none)."""
        n, b = self.num_tokens, self.batch
        o_ids, o_pos, o_slot, o_meta, o_nctx, o_cu, _ = _sections(T, B, W)
        buf[o_ids : o_ids + n] = self.ids
        buf[o_ids + n : o_pos] = 0
        buf[o_pos : o_pos + n] = self.positions
        buf[o_pos + n : o_slot] = 0
        buf[o_slot : o_slot + n] = self.slots
        buf[o_slot + n : o_slot + T] = pad_slot
        meta = buf[o_meta : o_meta + B * W].reshape(B, W)
        meta[:] = 0
        for i, m in enumerate(self.meta):
            meta[i, : len(m)] = m
        nctx = buf[o_nctx:o_cu].view(np.int32)[:B]
        nctx[:] = 0
        nctx[:b] = [len(m) for m in self.meta]
        cu = buf[o_cu:].view(np.int32)[: B + 1]
        cu[: b + 1] = self.cu
        if self.is_decode:
            cu[b + 1 :] = np.arange(b + 1, B + 1)  # a padding token each
        else:
            cu[b + 1 :] = self.cu[-1]

    @staticmethod
    def views(dev: torch.Tensor, T: int, B: int, W: int, is_decode: bool, max_seqlen_q: int):
        """(ids, positions, AttentionMetadata) viewing a device buffer laid out by ``fill``."""
        o_ids, o_pos, o_slot, o_meta, o_nctx, o_cu, end = _sections(T, B, W)
        meta = AttentionMetadata(
            is_decode=is_decode,
            cu_seqlens_q=dev[o_cu:end].view(torch.int32)[: B + 1],
            block_meta=dev[o_meta : o_meta + B * W].view(B, W),
            num_ctx_blocks=dev[o_nctx:o_cu].view(torch.int32)[:B],
            slot_mapping=dev[o_slot : o_slot + T],
            max_seqlen_q=max_seqlen_q,
        )
        return dev[o_ids : o_ids + T], dev[o_pos : o_pos + T], meta

    def to_device(self, device: torch.device):
        """(ids, positions, AttentionMetadata) on ``device``, unpadded, in one copy."""
        T, B, W = self.num_tokens, self.batch, self.width
        buf = np.empty(self.size(T, B, W), dtype=np.int64)
        self.fill(buf, T, B, W, 0)
        return self.views(torch.from_numpy(buf).to(device), T, B, W, self.is_decode, self.max_seqlen_q)


class TorchAttention:
    """PyTorch attention for CPU (and CUDA without Triton), built on the kernels' reference: the batch's
    contexts gathered and re-rotated at once (``reference.gather_contexts``), new tokens padded to the
    longest, and one masked ``reference.attend`` per layer."""

    name = "torch"

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, rope_cos, rope_sin, sm_scale):
        width = int(meta.num_ctx_blocks.max()) if meta.num_ctx_blocks.numel() else 0
        kc, vc, ctx_ok = reference.gather_contexts(
            k_cache, v_cache, meta.block_meta[:, :width], meta.num_ctx_blocks, rope_cos, rope_sin
        )  # [B, width * bs, Hkv, D]
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
    """LazyAttention Triton kernels: the query is rotated by -delta once per document.

    Plan / run (as FlashInfer's wrappers): the first layer of a forward plans it (kernel, config, rotation
    schedule, context splits, tile table: what depends on the batch's metadata only) into ``meta.kernel_cache``;
    every layer runs its attention with that plan. ``options`` (kvloop.KernelOptions): overrides of the tuned
    choices, for benchmarks; the engine runs the defaults."""

    name = "triton"

    def __init__(self, options=None):
        from lazyrag.kernels import decode, prefill
        from lazyrag.kernels.kvloop import KernelOptions

        self.options = options if options is not None else KernelOptions()
        self._prefill, self._decode = prefill, decode

    def plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor):
        """The forward's plan, made on its first call. Inside a CUDA-graph capture a plan made outside it is never
        reused: the capture makes its own, whose tile table the graph rebuilds from its static inputs on every
        replay."""
        key = ("plan", q.is_cuda and torch.cuda.is_current_stream_capturing())
        plan = meta.kernel_cache.get(key)
        if plan is None:
            shape = dict(
                num_heads=q.shape[1],
                num_kv_heads=k_cache.shape[2],
                head_dim=q.shape[2],
                block_size=k_cache.shape[1],
                dtype=q.dtype,
                device=q.device,
                options=self.options,
                tile_cache=meta.kernel_cache,
            )
            if meta.is_decode:
                plan = self._decode.plan_decode(meta.block_meta, meta.num_ctx_blocks, batch=q.shape[0], **shape)
            else:
                plan = self._prefill.plan_prefill(
                    meta.cu_seqlens_q, meta.block_meta, meta.num_ctx_blocks, max_seqlen_q=meta.max_seqlen_q, **shape
                )
            meta.kernel_cache[key] = plan
        return plan

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, rope_cos, rope_sin, sm_scale):
        plan = self.plan(meta, q, k_cache)
        if meta.is_decode:
            return self._decode.run_decode(plan, q, k_cache, v_cache, rope_cos, rope_sin, sm_scale)
        return self._prefill.run_prefill(plan, q, k, v, k_cache, v_cache, rope_cos, rope_sin, sm_scale)


def make_attention_backend(name: str, device: torch.device, options=None):
    """ "torch" (the PyTorch reference) or "triton" (EngineConfig picks: Triton on CUDA, torch elsewhere);
    ``options``: the Triton kernels' (kvloop.KernelOptions; benchmarks)."""
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
        return TritonAttention(options)
    raise ValueError(f"Unknown attention backend {name!r}: choose 'torch' or 'triton'.")
