"""The host steps before a request's first forward pass, made cheaper, give what they gave before:
a strategy's remembered content keys equal ``content_key``'s, packed block metas and a batch's slots equal the
per-block definitions."""

import itertools
import random

import numpy as np
import pytest
import torch

from lazyrag.engine.reuse import Strategy
from lazyrag.engine.runner import ModelRunner, Placement, SeqState
from lazyrag.kernels.common import MAX_DELTA, pack_block_meta, pack_block_runs_host
from lazyrag.kv.block_pool import BlockPool, KVShape, blocks_for
from lazyrag.kv.cache import Segment
from lazyrag.kv.identity import content_key


def test_strategy_keys_are_the_definitions_stores_are_indexed_by():
    s = Strategy(cache=None, runner=None, fingerprint="fp")
    rng = random.Random(0)
    prefix, chunk = [rng.randrange(128256) for _ in range(32)], [rng.randrange(128256) for _ in range(512)]
    for _ in range(2):  # the second time from the memo
        assert s.chunk_key(prefix, chunk) == content_key("fp", "chunk", prefix, chunk)
        assert s.prefix_key(prefix) == content_key("fp", "prefix", prefix)


def per_block_meta(context: list[Placement], blocks: list[int], own_tokens: int, bs: int) -> np.ndarray:
    """The definition: (block, delta, valid) per context block from ``first_block`` on, then per own block."""
    rows = [
        (seg.blocks[j], p.delta, min(bs, seg.num_tokens - j * bs))
        for p in context
        for seg in [p.segment]
        for j in range(p.first_block, len(seg.blocks))
    ]
    rows += [(blocks[j], 0, min(bs, own_tokens - j * bs)) for j in range(blocks_for(own_tokens, bs))]
    ids, deltas, valid = (torch.tensor(c, dtype=torch.int64) for c in zip(*rows)) if rows else [torch.zeros(0)] * 3
    return pack_block_meta(ids, deltas, valid).numpy()


@pytest.mark.parametrize("seed", range(20))
def test_block_metas_equal_the_per_block_definition(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16, 255])
    context = []
    for _ in range(rng.randrange(0, 8)):
        tokens = rng.randrange(1, 40 * bs)  # partial last blocks and whole ones
        seg = Segment("", rng.sample(range(1 << 31), blocks_for(tokens, bs)), tokens, rng.randrange(100))
        first = rng.choice([0, 0, rng.randrange(len(seg.blocks))])  # a recomputed head: read from a later block
        context.append(Placement(seg, rng.choice([0, rng.randrange(MAX_DELTA + 1)]), first_block=first))
    own = rng.sample(range(1 << 20), 8)
    seq = SeqState(context=context, blocks=own, next_pos=0)
    for own_tokens in (0, 1, bs, rng.randrange(8 * bs + 1), 0):  # the context part is packed once, then reused
        got = seq.block_meta(bs, own_tokens)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, per_block_meta(context, own, own_tokens, bs))


def test_block_metas_out_of_range_still_fail():
    with pytest.raises(AssertionError, match="block id"):
        pack_block_runs_host([([1 << 31], 0, 4)], 4)
    with pytest.raises(AssertionError, match="block id"):
        pack_block_runs_host([([-1], 0, 4)], 4)
    with pytest.raises(AssertionError, match="delta"):
        pack_block_runs_host([([1], MAX_DELTA + 1, 4)], 4)
    with pytest.raises(AssertionError, match="valid"):
        pack_block_runs_host([([1, 2, 3], 0, 4)], 4)  # a block wholly past its run's tokens


def test_batch_slots_positions_and_offsets_equal_the_per_token_definition():
    rng = random.Random(0)
    bs = 16
    runner = ModelRunner(
        None, BlockPool(KVShape(1, 1, 8, bs, torch.float32), 4, torch.device("meta")), None, None, None, 1.0
    )
    for is_decode in (False, True, False):
        seqs, counts = [], []
        for _ in range(rng.randrange(1, 5)):
            written = rng.randrange(40)
            counts.append(1 if is_decode else rng.randrange(1, 70))
            blocks = rng.sample(range(1 << 20), blocks_for(written + counts[-1], bs))
            seqs.append(SeqState(context=[], blocks=blocks, next_pos=rng.randrange(5000), num_written=written))
        ids = [rng.randrange(128256) for _ in range(sum(counts))]
        batch = runner._batch(seqs, [s.num_written + is_decode for s in seqs], ids, counts, is_decode)
        tokens = [(s, s.num_written + k, s.next_pos + k) for s, n in zip(seqs, counts) for k in range(n)]
        np.testing.assert_array_equal(batch.slots, [s.blocks[i // bs] * bs + i % bs for s, i, _ in tokens])
        np.testing.assert_array_equal(batch.positions, [pos for _, _, pos in tokens])
        np.testing.assert_array_equal(batch.ids, ids)
        np.testing.assert_array_equal(batch.cu, [0, *itertools.accumulate(counts)])
        assert batch.max_seqlen_q == max(counts) and batch.is_decode == is_decode
        assert all(a.dtype == np.int64 for a in (batch.ids, batch.positions, batch.slots, batch.cu))
