"""The packed block-meta layout, host side and Triton side, in one place.

One int64 per context block: ``[phys_block:32 | delta:24 | valid:8]`` (low to high bits): the
physical block id, the position offset of the segment (document) the block belongs to, and
how many of its ``block_size`` slots hold real tokens. Host code packs and unpacks it with
:func:`pack_block_meta` / :func:`unpack_block_meta` (the engine's per-step numpy metadata:
:func:`pack_block_runs_host`); kernels read the fields with
:func:`meta_phys`, :func:`meta_delta` and :func:`meta_valid`. Triton is optional here (the
CPU reference backend needs the host half only).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the host helpers below still work
    triton = None

PHYS_BITS, DELTA_BITS, VALID_BITS = 32, 24, 8
MAX_DELTA = (1 << DELTA_BITS) - 1
MAX_BLOCK_SIZE = (1 << VALID_BITS) - 1


def pack_block_meta(block_ids: torch.Tensor, deltas: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Pack per-block (physical id, position offset, valid length) into one int64 each."""
    block_ids, deltas, valid = (t.to(torch.int64) for t in (block_ids, deltas, valid))
    if block_ids.numel():
        assert 0 <= int(block_ids.min()) and int(block_ids.max()) < (1 << 31), "block id out of range"
        assert 0 <= int(deltas.min()) and int(deltas.max()) <= MAX_DELTA, "delta out of range"
        assert 0 <= int(valid.min()) and int(valid.max()) <= MAX_BLOCK_SIZE, "valid length out of range"
    return block_ids | (deltas << PHYS_BITS) | (valid << (PHYS_BITS + DELTA_BITS))


def unpack_block_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(physical block ids, deltas, valid lengths) of packed metas."""
    block_ids = meta & ((1 << PHYS_BITS) - 1)
    deltas = (meta >> PHYS_BITS) & MAX_DELTA
    valid = (meta >> (PHYS_BITS + DELTA_BITS)) & MAX_BLOCK_SIZE
    return block_ids, deltas, valid


if triton is not None:
    # ids are < 2**31 (asserted when packing): keeps the mask an int32 literal
    _PHYS_MASK = tl.constexpr(0x7FFFFFFF)
    _DELTA_SHIFT = tl.constexpr(PHYS_BITS)
    _DELTA_MASK = tl.constexpr(MAX_DELTA)
    _VALID_SHIFT = tl.constexpr(PHYS_BITS + DELTA_BITS)
    _VALID_MASK = tl.constexpr(MAX_BLOCK_SIZE)

    @triton.jit
    def meta_phys(meta):
        return (meta & _PHYS_MASK).to(tl.int64)

    @triton.jit
    def meta_delta(meta):
        return ((meta >> _DELTA_SHIFT) & _DELTA_MASK).to(tl.int32)

    @triton.jit
    def meta_valid(meta):
        return ((meta >> _VALID_SHIFT) & _VALID_MASK).to(tl.int32)


def pack_block_runs_host(runs, block_size: int):
    """:func:`pack_block_meta` of runs of blocks, as a numpy int64 array (the engine builds each step's
    metadata on the host and sends it to the device in one copy). Each run is (block ids, delta,
    tokens): its blocks hold ``tokens`` tokens from the first block on, ``block_size`` a block, so only
    the last may be partial. A few numpy calls for all the runs: numpy calls per run cost ~50 µs for
    a RAG prompt's ~170 context blocks (6 runs), on the way to its first token."""
    import numpy as np

    valid_shift = PHYS_BITS + DELTA_BITS
    ids, high, repeats = [], [], []  # blocks' delta and valid length, shifted into place: high[i] for repeats[i] blocks
    for blocks, delta, tokens in runs:
        assert 0 <= delta <= MAX_DELTA, "delta out of range"
        full = max(0, min(len(blocks), tokens // block_size))  # blocks that hold block_size tokens
        assert not full or block_size <= MAX_BLOCK_SIZE, "valid length out of range"
        ids += blocks
        high.append((delta << PHYS_BITS) | (block_size << valid_shift))
        repeats.append(full)
        for j in range(full, len(blocks)):  # the partial last block, if any (one past the tokens gets 0, more fail)
            valid = tokens - j * block_size
            assert 0 <= valid <= MAX_BLOCK_SIZE, "valid length out of range"
            high.append((delta << PHYS_BITS) | (valid << valid_shift))
            repeats.append(1)
    packed = np.array(ids, dtype=np.int64)
    # every id in [0, 2**31) iff their bitwise or is: one reduction, not a min and a max
    assert 0 <= np.bitwise_or.reduce(packed) < (1 << 31), "block id out of range"
    packed |= np.repeat(np.array(high, dtype=np.uint64), repeats).view(np.int64)  # a valid length >= 128 sets bit 63
    return packed
