"""The paged KV pool: fixed-size blocks of K and V for every layer, with reference counts."""

from __future__ import annotations

import math
import mmap
import threading
from dataclasses import dataclass

import torch


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` (the last one padded)."""
    return -(-num_tokens // block_size)


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (after eviction, if any was possible)."""


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on the CPU an anonymous mapping, whose pages the OS zeroes when first touched: torch.zeros
    writes every byte up front (1.1 s for the default 1 GiB pool on 2 cores, most of it for blocks never used). Not
    numpy's zeros: it asks for huge pages, and a first write then zeroes 2 MB (7 ms a layer for a 37-token prefix)."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(dims)


class BlockPool:
    """K and V tensors ``[layers, num_blocks, block_size, H_kv, D]`` and a ref-counted free list.

    A block belongs to exactly one segment (a chunk, the shared prefix, or a request's own
    tokens); segments never share a block, so padding stays inside its owner.
    """

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device):
        assert num_blocks > 0, "the KV pool needs at least one block"
        self.shape, self.num_blocks, self.device = shape, num_blocks, device
        dims = (shape.num_layers, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # zeros, not empty: padding slots are masked out of attention, but a masked score times a NaN
        # left in recycled memory is still NaN (0 * NaN), so the slots must hold finite values
        self.k = _zeros(dims, shape.dtype, torch.device(device))
        self.v = _zeros(dims, shape.dtype, torch.device(device))
        self._refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.Lock()

    @classmethod
    def with_budget(cls, shape: KVShape, budget_bytes: int, device: torch.device) -> "BlockPool":
        num_blocks = budget_bytes // shape.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"A KV budget of {budget_bytes} bytes holds no block ({shape.bytes_per_block} bytes each); raise "
                "kv_budget."
            )
        return cls(shape, num_blocks, device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
            blocks = [self._free.pop() for _ in range(n)]
            for b in blocks:
                assert self._refcount[b] == 0
                self._refcount[b] = 1
            return blocks

    def incref(self, blocks: list[int]) -> None:
        with self._lock:
            for b in blocks:
                assert self._refcount[b] > 0, f"block {b} is free"
                self._refcount[b] += 1

    def decref(self, blocks: list[int]) -> None:
        with self._lock:
            for b in blocks:
                assert self._refcount[b] > 0, f"block {b} freed twice"
                self._refcount[b] -= 1
                if self._refcount[b] == 0:
                    self._free.append(b)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ``[T, H_kv, D]`` at pool slots ``[T]`` (block * block_size + offset)."""
        flat = (-1, self.shape.num_kv_heads, self.shape.head_dim)
        self.k[layer].view(flat).index_copy_(0, slots, k.to(self.shape.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v.to(self.shape.dtype))

    def write_layers(self, layers: list[int], slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[len(layers), T, H_kv, D]`` of several layers at the same pool slots ``[T]``, one write each."""
        flat = (self.k.shape[0], -1, self.shape.num_kv_heads, self.shape.head_dim)
        at = torch.tensor(layers, device=self.device)[:, None], slots[None, :]  # [L', 1] x [1, T]
        self.k.view(flat)[at] = k.to(self.shape.dtype)
        self.v.view(flat)[at] = v.to(self.shape.dtype)

    def slots(self, blocks: list[int], num_tokens: int, start: int = 0) -> torch.Tensor:
        """Pool slots of tokens ``start .. start+num_tokens`` of a segment laid out over ``blocks``."""
        bs = self.shape.block_size
        idx = torch.arange(start, start + num_tokens)
        table = torch.tensor(blocks, dtype=torch.int64)
        return (table[idx // bs] * bs + idx % bs).to(self.device)
