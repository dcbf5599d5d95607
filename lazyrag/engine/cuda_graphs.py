"""CUDA graphs for the forward pass: one capture per (kind, batch, token bucket, table width).

A short prefill or a decode step of an 8B model launches hundreds of small kernels;
replaying a captured graph removes their launch cost. Inputs live in one static buffer that
each replay refills with one copy; shapes are padded up to buckets. Padding tokens write their K/V to a
scratch block that no sequence reads, and padded batch rows have no context, so neither
touches real results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lazyrag.model.attention import AttentionMetadata, HostBatch


def _bucket(n: int, smallest: int) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    host: torch.Tensor  # pinned staging buffer: the step's inputs, laid out by HostBatch.fill
    host_np: np.ndarray  # the same memory, for numpy
    dev: torch.Tensor  # the static device buffer the graph reads (ids, positions, metadata)
    ids: torch.Tensor  # its token-id section
    copied: torch.cuda.Event  # the last copy out of ``host`` is done once this completes
    logits: torch.Tensor
    shape: tuple[int, int, int]  # (tokens, batch, width) it was captured for


_Key = tuple[bool, int, int, int]  # (is_decode, batch, tokens, table width) buckets: one graph each


class GraphRunner:
    """Captures ``last_logits(ids, positions, meta)`` (forward + each sequence's last-token logits)
    lazily per shape bucket and replays it. A replay's inputs (token ids, positions, slots and block
    metadata) go to the device in one copy from a pinned buffer: no kernel refills them."""

    def __init__(
        self,
        last_logits: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        scratch_slot: int,
        device: torch.device,
        max_tokens: int = 512,
    ):
        self.last_logits = last_logits
        self.scratch_slot, self.device, self.max_tokens = scratch_slot, device, max_tokens
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[_Key, _Graph] = {}

    def clear(self) -> None:
        """Drop every captured graph; later captures go to a fresh memory pool (capturing again into a
        pool whose graphs were all freed trips an internal assert of PyTorch's caching allocator)."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def supports(self, num_tokens: int, batch: int, is_decode: bool) -> bool:
        return num_tokens <= self.max_tokens and (is_decode or batch == 1)

    def _capture(self, key: _Key) -> _Graph:
        is_decode, batch, tokens, width = key
        size = HostBatch.size(tokens, batch, width)
        host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        host_np = host.numpy()
        # captured over padding: every token writes the scratch slot and no sequence has context
        if is_decode:
            empty = HostBatch(True, *(np.zeros(0, np.int64),) * 3, [], np.zeros(1, np.int64), 1)
        else:
            empty = HostBatch(
                False,
                np.zeros(tokens, np.int64),
                np.zeros(tokens, np.int64),
                np.full(tokens, self.scratch_slot, np.int64),
                [np.zeros(0, np.int64)],
                np.array([0, tokens], np.int64),
                tokens,
            )
        empty.fill(host_np, tokens, batch, width, self.scratch_slot)
        dev = host.to(self.device)
        ids, positions, meta = HostBatch.views(dev, tokens, batch, width, is_decode, 1 if is_decode else tokens)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles and tunes the kernels outside the capture
            for _ in range(2):
                meta.kernel_cache.clear()
                self.last_logits(ids, positions, meta)
        torch.cuda.current_stream().wait_stream(stream)
        meta.kernel_cache.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.last_logits(ids, positions, meta)
        copied = torch.cuda.Event()
        copied.record()
        return _Graph(graph, host, host_np, dev, ids, copied, logits, (tokens, batch, width))

    @torch.inference_mode()
    def run(self, batch: HostBatch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, V]`` of each sequence's last token; ``batch`` is unpadded. ``device_ids``: the batch's
        token ids on the device, copied over the host's after the one copy (stream-ordered, no sync)."""
        b, n = batch.batch, batch.num_tokens
        width = _bucket(batch.width, 64)
        key = (
            batch.is_decode,
            _bucket(b, 1) if batch.is_decode else 1,
            _bucket(n, 1) if batch.is_decode else _bucket(n, 16),
            width,
        )
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(key)
        g.copied.synchronize()  # the previous replay's copy has left the staging buffer
        batch.fill(g.host_np, *g.shape, self.scratch_slot)
        g.dev.copy_(g.host, non_blocking=True)
        g.copied.record()
        if device_ids is not None:
            g.ids[:n].copy_(device_ids)
        g.graph.replay()
        return g.logits[:b]
