"""CacheBlend-style selective recompute (Yao et al., EuroSys'25): recompute in context the chunk
tokens whose cached KV deviates most from what the full prompt would give; reuse the rest.

A chunk's cached KV was computed without the documents before it. Per request:

1. Every chunk token runs layer 0 in full context (the prefix and all chunks, causally by
   position). Layer 0's K/V depend on the token and its position only, so the cached ones are
   already exact there; the context first shows in layer 1's K/V. A token's deviation is the
   squared distance between its layer-1 K and V computed so and the cached ones read in place
   (cached keys rotated by the placement's delta, as the kernels read them).
2. The tokens of largest deviation (CacheBlend: the top ``ratio`` of all chunk tokens, across
   chunks) go on through layers 1..L-1. Their queries attend to the whole context, where the
   other tokens keep their cached K/V and the selected ones use their fresh K/V of that layer.
3. The fresh K/V (layers 1..L-1) go into a private copy of each block they touch: the cached
   chunk is shared and never written. The copy is read at the chunk's delta like the chunk,
   so its keys are stored un-rotated by that delta (kernels/reference.py's invariant).

The question is then prefilled over the blended context as usual. This is a dense, per-layer
implementation (each layer's placed context gathered into [N, Hkv, D] tensors, a position
mask): prompts are a few thousand tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lazyrag.kernels.common import pack_block_meta
from lazyrag.kernels.reference import apply_rotary, attend, gather_context
from lazyrag.kv.cache import Segment, SegmentKind
from lazyrag.model.llama import rope_at
from lazyrag.engine.runner import ModelRunner, Placement, SeqState

SELECTION_LAYER = 1  # the first layer whose K/V depend on the context


@dataclass
class Blend:
    context: list[Placement]  # the placements, each blended chunk replaced by its private copy
    selected: torch.Tensor  # [S] indices into the chunk tokens (prompt order) recomputed in every layer
    deviation: torch.Tensor  # [C] each chunk token's K/V deviation at the selection layer
    cost: float  # in tokens through the whole model: all chunk tokens ran layer 0, the selected ones every layer


def kv_deviation(k: torch.Tensor, v: torch.Tensor, k_cached: torch.Tensor, v_cached: torch.Tensor) -> torch.Tensor:
    """[T]: squared distance of each token's K and V ([T, Hkv, D]) from the cached ones."""
    return ((k.float() - k_cached) ** 2).sum((1, 2)) + ((v.float() - v_cached) ** 2).sum((1, 2))


def select(deviation: torch.Tensor, chunk: torch.Tensor, ratio: float, forced: torch.Tensor, per_chunk: bool = False) -> torch.Tensor:
    """Sorted indices of the tokens to recompute: the ``forced`` ones and the top ``ratio`` of the
    others by ``deviation`` (all [C]), counted over all chunk tokens or, ``per_chunk``, in each chunk."""
    score = deviation.masked_fill(forced, float("inf"))
    groups = [torch.arange(len(score), device=score.device)]
    if per_chunk:
        groups = [(chunk == c).nonzero()[:, 0] for c in chunk.unique()]
    picks = []
    for idx in groups:
        n = min(len(idx), int(forced[idx].sum()) + round(ratio * len(idx)))
        picks.append(idx[score[idx].topk(n).indices])
    return torch.cat(picks).sort().values


@torch.inference_mode()
def selective_recompute(
    runner: ModelRunner,
    placed: list[Placement],
    ids: list[list[int] | None],
    ratio: float,
    allocate: Callable[[int], list[int]],
    first: int = 0,
    per_chunk: bool = False,
) -> Blend:
    """Blend the placements whose token ``ids`` are given (``None``: read as cached, e.g. the prefix).

    ``first`` tokens of each chunk are always recomputed (EPIC's heads), on top of ``ratio``.
    ``allocate(n)`` gives n fresh blocks for the private copies; the caller owns and frees them.
    """
    pool, model, dev = runner.pool, runner.model, runner.device
    bs, layers = pool.shape.block_size, model.layers
    # every context token in prompt order: its position, delta, placement and index in the segment
    tok = [torch.arange(p.first_block * bs, p.segment.num_tokens) for p in placed]
    pos = torch.cat([p.segment.start + p.delta + t for p, t in zip(placed, tok)]).to(dev)  # [N]
    delta = torch.cat([torch.full_like(t, p.delta) for p, t in zip(placed, tok)])
    owner = torch.cat([torch.full_like(t, i) for i, t in enumerate(tok)])
    offset = torch.cat(tok)
    blended = torch.tensor([x is not None for x in ids])[owner]
    rows = torch.tensor(SeqState(context=placed, blocks=[], next_pos=0).block_rows(bs, 0), dtype=torch.int64)
    meta = pack_block_meta(rows[:, 0], rows[:, 1], rows[:, 2]).to(dev)

    chunk_pos = blended.nonzero()[:, 0]  # [C] the chunk tokens' places in the context
    if not len(chunk_pos):
        return Blend(list(placed), torch.zeros(0, dtype=torch.int64), torch.zeros(0), 0.0)
    chunk_ids = torch.tensor([ids[i][j] for i, j in zip(owner[chunk_pos].tolist(), offset[chunk_pos].tolist())], device=dev)
    sel = chunk_pos.to(dev)  # context places of the tokens being recomputed: all of them up to the selection layer
    x = model.embed(chunk_ids)  # [C, H]
    deviation, selected = torch.zeros(len(chunk_pos)), torch.arange(len(chunk_pos))
    context, slots = list(placed), None
    select_at = min(SELECTION_LAYER, len(layers) - 1)
    for layer, block in enumerate(layers):
        kc, vc = gather_context(pool.k[layer], pool.v[layer], meta, runner.rope_cos, runner.rope_sin)  # [N, Hkv, D] fp32, as cached
        cos, sin = rope_at(runner.rope_cos, runner.rope_sin, pos[sel], x.dtype)
        q, k, v = block.attn.project(block.attn_input(x, runner.ops), cos, sin, runner.ops, runner.rope_scaling)
        if layer == select_at:
            deviation = kv_deviation(k, v, kc[sel], vc[sel])
            forced = offset[chunk_pos] < first
            selected = select(deviation.cpu(), owner[chunk_pos], ratio, forced, per_chunk)
            if not len(selected):
                break
            keep = selected.to(dev)
            sel, x, q, k, v = sel[keep], x[keep], q[keep], k[keep], v[keep]
            context, slots = _private_copies(pool, placed, owner[chunk_pos[selected]], offset[chunk_pos[selected]], allocate)
            d = delta[chunk_pos[selected]].to(dev)
            back = runner.rope_cos[d][:, None], -runner.rope_sin[d][:, None]  # R(-delta): the copy is read at the chunk's delta
        if layer >= select_at:  # below it the cached K/V are exact
            pool.write(layer, slots, apply_rotary(k.float(), *back), v)
        if layer == len(layers) - 1:
            break  # the last layer's K/V is all the question needs
        kc[sel], vc[sel] = k.float(), v.float()
        mask = pos[None, :] <= pos[sel][:, None]  # [S, N] causal by position
        o = attend(q[None], kc[None], vc[None], mask[None], model.sm_scale)[0].to(x.dtype)
        x = block.after_attention(x, block.attn.wo(o.flatten(1)), runner.ops)  # [S, H]
    # every chunk token ran the layers below the selection layer, the selected ones the rest
    cost = (len(chunk_pos) * select_at + len(selected) * (len(layers) - select_at)) / len(layers)
    runner.tokens_forwarded += round(cost)
    return Blend(context, selected, deviation.cpu(), cost)


def _private_copies(pool, placed: list[Placement], owner: torch.Tensor, offset: torch.Tensor, allocate):
    """Copy every block holding a selected token (placement ``owner``, token ``offset`` in its segment);
    the placements read the copies instead, at the same delta. Returns them and each token's pool slot."""
    bs = pool.shape.block_size
    context = list(placed)
    slots = torch.empty_like(offset)
    for i in owner.unique().tolist():
        p, mine = placed[i], owner == i
        touched = (offset[mine] // bs).unique().tolist()
        fresh = allocate(len(touched))
        src, dst = torch.tensor([p.segment.blocks[j] for j in touched], device=pool.device), torch.tensor(fresh, device=pool.device)
        pool.k[:, dst] = pool.k[:, src]
        pool.v[:, dst] = pool.v[:, src]
        blocks = list(p.segment.blocks)  # untouched blocks are read from the shared chunk itself
        for j, b in zip(touched, fresh):
            blocks[j] = b
        seg = Segment("", blocks, p.segment.num_tokens, p.segment.start, kind=SegmentKind.BLENDED, transient=True)
        context[i] = Placement(seg, p.delta, p.first_block)
        table = torch.tensor(blocks)
        slots[mine] = table[offset[mine] // bs] * bs + offset[mine] % bs
    return context, slots.to(pool.device)
