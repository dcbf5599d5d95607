"""Shared builders for the kernel tests: paged pools of shuffled blocks with documents at random offsets, their
re-rotated variants, the RoPE tables, and calls of the kernels with a NaN-poisoned output (so that an unwritten
element fails)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lazyrag.kernels.common import pack_block_meta, unpack_block_meta
from lazyrag.kernels.decode import lazy_decode
from lazyrag.kernels.prefill import lazy_prefill
from lazyrag.kernels.reference import apply_rotary, lazy_prefill_reference, rope_tables

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
MAX_POS = 1 << 15


def _hopper() -> bool:
    from lazyrag.kernels import prefill_wgmma

    return CUDA and prefill_wgmma.HAVE_GLUON and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Triton with Gluon")


def tuned_here() -> dict:
    """The tuned table of the device the GPU tests run on (the default entry without one)."""
    from lazyrag.kernels import tuned

    return tuned.tuned(torch.device("cuda")) if CUDA else tuned.for_device_name("default")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (unwritten or bad masking)"
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: torch.Tensor  # [B, max_blocks] int64 packed
    nblocks: torch.Tensor  # [B]
    docs: list  # per sequence: list of (first block index in the row, n blocks, delta)


def make_paged(gen, docs_per_seq, hkv, d, bs, dtype, device, reuse_first_doc=False, max_delta=MAX_POS - 1):
    """Build a shuffled paged pool and per-sequence block tables.

    docs_per_seq: per sequence a list of document lengths in tokens. Each document owns
    whole blocks (last one padded) at random physical ids and gets a random delta. With
    reuse_first_doc, the first document of sequence 0 appears again at the end of that
    sequence: same physical blocks, another delta.
    """
    doc_blocks = [[(n + bs - 1) // bs for n in seq] for seq in docs_per_seq]
    total = sum(sum(x) for x in doc_blocks) + 3  # a few unused blocks in the pool
    perm = torch.randperm(total, generator=gen)
    k_cache = torch.randn(total, bs, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(total, bs, hkv, d, generator=gen).to(dtype).to(device)
    rows, docs, nxt = [], [], 0
    for s, seq in enumerate(docs_per_seq):
        ids, dl, vl, info = [], [], [], []
        for n, nb in zip(seq, doc_blocks[s]):
            phys = perm[nxt : nxt + nb]
            nxt += nb
            delta = int(torch.randint(0, max_delta + 1, (1,), generator=gen))
            info.append((len(ids), nb, delta))
            ids += phys.tolist()
            dl += [delta] * nb
            vl += [bs] * (nb - 1) + [n - (nb - 1) * bs]
        if reuse_first_doc and s == 0 and seq:
            _, nb0, _ = info[0]
            delta = int(torch.randint(0, max_delta + 1, (1,), generator=gen))
            info.append((len(ids), nb0, delta))
            ids += ids[:nb0]
            dl += [delta] * nb0
            vl += vl[:nb0]
        rows.append((ids, dl, vl))
        docs.append(info)
    width = max(1, max(len(r[0]) for r in rows)) + 2  # padded table, junk beyond nblocks
    meta = torch.zeros(len(rows), width, dtype=torch.int64)
    for s, (ids, dl, vl) in enumerate(rows):
        if ids:
            meta[s, : len(ids)] = pack_block_meta(torch.tensor(ids), torch.tensor(dl), torch.tensor(vl))
        meta[s, len(ids) :] = pack_block_meta(torch.tensor([total - 1]), torch.tensor([7]), torch.tensor([bs]))
    nblocks = torch.tensor([len(r[0]) for r in rows], dtype=torch.int32)
    return Paged(k_cache, v_cache, meta.to(device), nblocks.to(device), docs)


def make_rope(d, device, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = rope_tables(inv_freq, MAX_POS)
    return cos.to(device), sin.to(device)


def rotated_in_place(p: Paged, cos, sin):
    """The same pool, metas and layout, with every used block's K re-rotated by its delta (each
    block belongs to one document here, except a reused one, which gets its own copy)."""
    ids, deltas, valid = unpack_block_meta(p.meta)
    k = p.k_cache.clone()
    extra, meta = [], p.meta.clone()
    seen = {}
    for b in range(p.meta.shape[0]):
        for j in range(int(p.nblocks[b])):
            phys, d = int(ids[b, j]), int(deltas[b, j])
            if phys in seen and seen[phys] != d:  # a document reused at another offset: a private block
                extra.append((b, j, phys, d))
                continue
            seen[phys] = d
            k[phys] = apply_rotary(p.k_cache[phys].float(), cos[d], sin[d]).to(k.dtype)
    v = p.v_cache
    if extra:
        k = torch.cat(
            (k, torch.stack([apply_rotary(p.k_cache[ph].float(), cos[d], sin[d]).to(k.dtype) for _, _, ph, d in extra]))
        )
        v = torch.cat((v, torch.stack([p.v_cache[ph] for _, _, ph, _ in extra])))
        for i, (b, j, _, d) in enumerate(extra):
            meta[b, j] = pack_block_meta(
                torch.tensor([p.k_cache.shape[0] + i]), torch.tensor([d]), valid[b, j].view(1)
            )[0]
    return Paged(k, v, meta, p.nblocks, p.docs)


def prerotated(p: Paged, cos, sin):
    """Materialise every (sequence, block) re-rotated by its delta into its own block; deltas 0."""
    ids, deltas, valid = unpack_block_meta(p.meta)
    B, W = p.meta.shape
    k = apply_rotary(
        p.k_cache[ids.reshape(-1)].float(),
        cos[deltas.reshape(-1)][:, None, None, :],
        sin[deltas.reshape(-1)][:, None, None, :],
    ).to(p.k_cache.dtype)
    v = p.v_cache[ids.reshape(-1)]
    new_ids = torch.arange(B * W, device=p.meta.device).reshape(B, W)
    meta0 = pack_block_meta(new_ids, torch.zeros_like(deltas), valid)
    return Paged(k, v.clone(), meta0, p.nblocks, p.docs)


def make_prefill(seed, new_lens, docs_per_seq, hq, hkv, d, bs, dtype, device, reuse_first_doc=False):
    gen = torch.Generator().manual_seed(seed)
    p = make_paged(gen, docs_per_seq, hkv, d, bs, dtype, device, reuse_first_doc)
    tq = sum(new_lens)
    q = torch.randn(tq, hq, d, generator=gen).to(dtype).to(device)
    k_new = torch.randn(tq, hkv, d, generator=gen).to(dtype).to(device)
    v_new = torch.randn(tq, hkv, d, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + list(torch.tensor(new_lens).cumsum(0)), dtype=torch.int32, device=device)
    return p, q, k_new, v_new, cu


def run_prefill(p, q, k_new, v_new, cu, cos, sin, scale, **kw):
    out = torch.full_like(q, float("nan"))
    return lazy_prefill(q, k_new, v_new, cu, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, scale, out=out, **kw)


def ref_prefill(p, q, k_new, v_new, cu, cos, sin, scale, meta=None):
    return lazy_prefill_reference(
        q, k_new, v_new, cu, p.k_cache, p.v_cache, p.meta if meta is None else meta, p.nblocks, cos, sin, scale
    )


def run_decode(p, q, cos, sin, scale, **kw):
    out = torch.full_like(q, float("nan"))
    return lazy_decode(q, p.k_cache, p.v_cache, p.meta, p.nblocks, cos, sin, scale, out=out, **kw)


def gpu_docs(gen, n_seqs, n_docs, max_doc):
    return [[int(x) for x in torch.randint(1, max_doc, (n_docs,), generator=gen)] for _ in range(n_seqs)]
