"""CUDA graphs for the forward pass: one capture per (kind, batch, token bucket, table width).

A short prefill or a decode step of an 8B model launches over a thousand small kernels;
replaying a captured graph removes their launch cost. Inputs live in static buffers that
each replay refills; shapes are padded up to buckets. Padding tokens write their K/V to a
scratch block that no sequence reads, and padded batch rows have no context, so neither
touches real results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lazyrag.model.attention import AttentionMetadata


def _bucket(n: int, smallest: int) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits: torch.Tensor


class GraphRunner:
    """Captures ``last_logits(ids, positions, meta)`` (forward + each sequence's last-token logits)
    lazily per shape bucket and replays it."""

    def __init__(self, last_logits, scratch_slot: int, device: torch.device, max_tokens: int = 512):
        self.last_logits = last_logits
        self.scratch_slot, self.device, self.max_tokens = scratch_slot, device, max_tokens
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Graph] = {}

    def supports(self, num_tokens: int, batch: int, is_decode: bool) -> bool:
        return num_tokens <= self.max_tokens and (is_decode or batch == 1)

    def _capture(self, key) -> _Graph:
        is_decode, batch, tokens, width = key
        dev = self.device
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
        cu = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.arange(1, batch + 1, dtype=torch.int32) if is_decode else tokens
        meta = AttentionMetadata(
            is_decode=is_decode,
            cu_seqlens_q=cu,
            block_meta=torch.zeros(batch, width, dtype=torch.int64, device=dev),
            num_ctx_blocks=torch.zeros(batch, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((tokens,), self.scratch_slot, dtype=torch.int64, device=dev),
            max_seqlen_q=1 if is_decode else tokens,
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles and tunes the kernels outside the capture
            for _ in range(2):
                self.last_logits(ids, positions, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.last_logits(ids, positions, meta)
        return _Graph(graph, ids, positions, meta, logits)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits ``[B, V]`` of each sequence's last token; ``meta`` and the inputs are unpadded."""
        batch = meta.num_ctx_blocks.numel()
        n = ids.numel()
        width = _bucket(meta.block_meta.shape[1], 64)
        key = (meta.is_decode, _bucket(batch, 1) if meta.is_decode else 1,
               _bucket(n, 1) if meta.is_decode else _bucket(n, 16), width)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(key)
        # refill the static inputs; padding rows/tokens go to the scratch slot with no context
        g.ids.zero_()[:n].copy_(ids)
        g.positions.zero_()[:n].copy_(positions)
        g.meta.slot_mapping.fill_(self.scratch_slot)[:n].copy_(meta.slot_mapping)
        g.meta.block_meta.zero_()[:batch, : meta.block_meta.shape[1]].copy_(meta.block_meta)
        g.meta.num_ctx_blocks.zero_()[:batch].copy_(meta.num_ctx_blocks)
        if meta.is_decode:
            g.meta.cu_seqlens_q.copy_(torch.arange(g.meta.cu_seqlens_q.numel(), dtype=torch.int32, device=self.device))
        else:
            g.meta.cu_seqlens_q[1] = n
        g.graph.replay()
        return g.logits[:batch]
