"""Runs the model over sequences whose context is a list of placed, cached segments."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from lazyrag.kernels.common import DELTA_BITS, PHYS_BITS, pack_block_runs_host
from lazyrag.kernels.reference import apply_rotary
from lazyrag.kv.block_pool import BlockPool, blocks_for
from lazyrag.kv.cache import Segment
from lazyrag.model.attention import AttentionMetadata, HostBatch
from lazyrag.model.llama import GEMV_DEFAULT, GEMV_LAYERS, ElementwiseOps, LlamaModel, Runtime

if TYPE_CHECKING:
    from lazyrag.engine.cuda_graphs import GraphRunner


@dataclass
class Placement:
    """A cached segment read at ``delta`` positions past where its KV was computed."""

    segment: Segment
    delta: int
    first_block: int = 0  # read the segment from this block on (its head was recomputed in context)


@dataclass
class SeqState:
    """One sequence in flight: placed context segments, then its own blocks."""

    context: list[Placement]
    blocks: list[int]  # blocks this sequence writes its new tokens into
    next_pos: int  # position of its next token
    num_written: int = 0  # tokens already in ``blocks``
    generated: list[int] = field(default_factory=list)

    _context_meta: np.ndarray | None = None

    def block_meta(self, block_size: int, own_tokens: int) -> np.ndarray:
        """(block, delta, valid) for every context block, then for the first ``own_tokens`` of its own,
        packed (kernels/common.py's layout) into an int64 array; the context part is packed once (the placed
        context never changes while the sequence runs)."""
        if self._context_meta is None:
            self._context_meta = pack_block_runs_host(
                [
                    (p.segment.blocks[p.first_block :], p.delta, p.segment.num_tokens - p.first_block * block_size)
                    for p in self.context
                ],
                block_size,
            )
        n = blocks_for(own_tokens, block_size)
        if not n:
            return self._context_meta
        own = np.asarray(self.blocks[:n], dtype=np.int64)
        assert own.max() < (1 << 31), "block id out of range"
        valid = np.full(n, block_size, dtype=np.int64)
        valid[-1] = own_tokens - (n - 1) * block_size
        return np.concatenate((self._context_meta, own | (valid << (PHYS_BITS + DELTA_BITS))))


# H200, Llama-3.1-8B shapes at M = 64 (round 6, benchmarks/NOTES.md): cuBLASLt's GEMMs took 4.15 ms for the 32 layers
# and lm_head against cuBLAS's 4.37 (down without a split-K reduce launch); at M = 1 cuBLAS was faster (4.05 vs 4.19 ms)
SHORT_PREFILL_TOKENS = 512


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library (process-wide) set to ``name`` for the block, then restored."""
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        pool: BlockPool,
        attention: Callable[..., torch.Tensor],
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        rope_scaling: float,
    ):
        self.model, self.pool, self.attention = model, pool, attention
        self.rope_cos, self.rope_sin, self.rope_scaling = rope_cos, rope_sin, rope_scaling
        self.device = pool.device
        self.tokens_forwarded = 0  # every token run through the model: how recompute is counted
        self.graphs: GraphRunner | None = None  # a GraphRunner replays captured forwards (CUDA + Triton only)
        self.ops = ElementwiseOps()
        self.short_prefill_blas: str | None = None  # torch's BLAS library for prefills of <= SHORT_PREFILL_TOKENS

    def compile_elementwise(self) -> None:
        """Fuse the model's elementwise steps with torch.compile (CUDA: a kernel each instead of dozens)."""
        self.ops = replace(
            ElementwiseOps.compiled(),
            rotate_qk_store=self.ops.rotate_qk_store,
            gemv=self.ops.gemv,
            skinny=self.ops.skinny,
        )

    def use_triton_elementwise(self) -> None:
        """The norms and silu*up as Triton kernels (kernels/elementwise.py) instead of torch.compile's."""
        self.ops = self.ops.with_triton_kernels()

    def fuse_kv_store(self) -> None:
        """Rotate q/k and store the new K/V into the pool in one Triton kernel (kernels/qkv.py)."""
        self.ops = self.ops.with_fused_kv_store()

    def use_gemv(self, layers: Iterable[str] = GEMV_DEFAULT) -> None:
        """One-token forwards run these projections as Triton GEMVs, norm / silu*up folded in (kernels/gemv.py)."""
        self.ops = replace(self.ops, gemv=frozenset(layers))

    def use_skinny_gemm(self, layers: Iterable[str] = GEMV_LAYERS) -> None:
        """2-64 token forwards (the TTFT prefill) run these projections through Triton's skinny GEMM
        (kernels/gemm.py)."""
        self.ops = replace(self.ops, skinny=frozenset(layers))

    def enable_cuda_graphs(self, scratch_block: int) -> None:
        from lazyrag.engine.cuda_graphs import GraphRunner

        self.graphs = GraphRunner(self._last_logits, scratch_block * self.pool.shape.block_size, self.device)

    def _batch(
        self, seqs: list[SeqState], own_tokens: list[int], ids: list[int], new_counts: list[int], is_decode: bool
    ) -> HostBatch:
        """The forward pass's inputs on the host: token ids, positions, pool slots and block metas."""
        bs = self.pool.shape.block_size
        slots, positions = [], []
        for s, n in zip(seqs, new_counts):
            if n == 1:
                i = s.num_written
                slots.append(s.blocks[i // bs] * bs + i % bs)
                positions.append(s.next_pos)
            else:
                # a list comprehension, converted once below: for a prefill's few dozen slots, cheaper than numpy calls
                slots += [s.blocks[i // bs] * bs + i % bs for i in range(s.num_written, s.num_written + n)]
                positions += range(s.next_pos, s.next_pos + n)
        return HostBatch(
            is_decode,
            np.asarray(ids, dtype=np.int64),
            np.asarray(positions, dtype=np.int64),
            np.asarray(slots, dtype=np.int64),
            [s.block_meta(bs, n) for s, n in zip(seqs, own_tokens)],
            np.array([0, *itertools.accumulate(new_counts)], dtype=np.int64),
            max(new_counts),
        )

    def _runtime(self, meta: AttentionMetadata) -> Runtime:
        return Runtime(
            self.pool,
            meta,
            self.attention,
            self.rope_cos,
            self.rope_sin,
            self.rope_scaling,
            self.model.sm_scale,
            self.ops,
        )

    def _last_logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits ``[B, V]`` of each sequence's last new token (what a CUDA graph captures, too)."""
        hidden = self.model(ids, positions, self._runtime(meta))
        return self.model.logits(hidden.index_select(0, meta.cu_seqlens_q[1:].long() - 1))

    def _forward(self, batch: HostBatch, logits: bool, device_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ``[B, V]`` of each sequence's last new token (or None); K/V of every new token is written.
        ``device_ids``: the batch's token ids already on the device (they replace ``batch.ids``)."""
        self.tokens_forwarded += batch.num_tokens
        if self.short_prefill_blas is not None and not batch.is_decode and batch.num_tokens <= SHORT_PREFILL_TOKENS:
            with blas_library(self.short_prefill_blas):
                return self._run(batch, logits, device_ids)
        return self._run(batch, logits, device_ids)

    def _run(self, batch: HostBatch, logits: bool, device_ids: torch.Tensor | None) -> torch.Tensor | None:
        if logits and self.graphs is not None and self.graphs.supports(batch.num_tokens, batch.batch, batch.is_decode):
            return self.graphs.run(batch, device_ids)
        ids, positions, meta = batch.to_device(self.device)
        if device_ids is not None:
            ids.copy_(device_ids)
        if not logits:
            self.model(ids, positions, self._runtime(meta))
            return None
        return self._last_logits(ids, positions, meta)

    @torch.inference_mode()
    def prefill(self, seqs: list[SeqState], new_ids: list[list[int]], logits: bool = True) -> torch.Tensor | None:
        """Run each sequence's new tokens (all of them, causally) over its context; logits of each last token."""
        counts = [len(x) for x in new_ids]
        assert all(counts), "a sequence in a prefill batch has no new tokens"
        batch = self._batch(
            seqs, [s.num_written for s in seqs], [t for x in new_ids for t in x], counts, is_decode=False
        )
        out = self._forward(batch, logits)
        for s, n in zip(seqs, counts):
            s.num_written += n
            s.next_pos += n
        return out  # [B, V] or None

    @torch.inference_mode()
    def decode(self, seqs: list[SeqState], tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """One token per sequence; its K/V is written first, then attends over every block of the sequence.
        ``tokens``: each sequence's last token, as ints or as a ``[B]`` device tensor (the previous step's
        greedy tokens, not yet read by the host: the scheduler's async scheduling)."""
        device_tokens = tokens if isinstance(tokens, torch.Tensor) else None
        assert len(tokens) == len(seqs)
        batch = self._batch(
            seqs,
            [s.num_written + 1 for s in seqs],
            [0] * len(seqs) if isinstance(tokens, torch.Tensor) else tokens,
            [1] * len(seqs),
            is_decode=True,
        )
        out = self._forward(batch, logits=True, device_ids=device_tokens)
        for s in seqs:
            s.num_written += 1
            s.next_pos += 1
        assert out is not None  # logits=True
        return out  # [B, V]

    @torch.inference_mode()
    def copy_rotated(self, src: Segment, dst_blocks: list[int], delta: int) -> None:
        """Materialise ``src``'s KV re-rotated ``delta`` positions later (position-aware caching)."""
        assert len(dst_blocks) == len(src.blocks)
        s = torch.tensor(src.blocks, device=self.device)
        d = torch.tensor(dst_blocks, device=self.device)
        self.pool.k[:, d] = self._rotated_k(s, delta)
        self.pool.v[:, d] = self.pool.v[:, s]

    @torch.inference_mode()
    def rotate_k(self, blocks: list[int], delta: int) -> None:
        """Re-rotate the K of ``blocks`` in place, ``delta`` positions later (earlier if negative)."""
        b = torch.tensor(blocks, device=self.device)
        self.pool.k[:, b] = self._rotated_k(b, delta)

    def _rotated_k(self, blocks: torch.Tensor, delta: int) -> torch.Tensor:
        k = self.pool.k[:, blocks].float()  # [L, nb, bs, Hkv, D]
        sign = 1 if delta >= 0 else -1  # a rotation by -d: cos(d), -sin(d)
        rotated: torch.Tensor = apply_rotary(k, self.rope_cos[abs(delta)], sign * self.rope_sin[abs(delta)])
        return rotated.to(self.pool.k.dtype)
