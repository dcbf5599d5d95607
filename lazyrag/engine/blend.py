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
implementation (each layer's placed context gathered into [N, Hkv, D] tensors; in position order, so
a token sees a prefix of them: kernels/recompute.py, no [S, N] mask). On a GPU a request's blend is bound by host work
(launches and syncs: benchmarks/NOTES.md, "Running the eval on the GPU"), so the context's token
slots and rotations are computed once per request, nothing syncs inside the layer loop, the
fresh K/V are written to the pool in one go at the end, and the elementwise steps run eagerly (a
compiled op's guards cost more than its launches at these sizes).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from lazyrag.kernels.reference import apply_rotary, prefix_attention_reference
from lazyrag.kv.cache import Segment, SegmentKind
from lazyrag.model.llama import ElementwiseOps, rope_at
from lazyrag.strategy_names import BLEND_SELECTIONS
from lazyrag.engine.runner import ModelRunner, Placement

SELECTION_LAYER = 1  # the first layer whose K/V depend on the context
DENSE_OPS = ElementwiseOps()  # eager: token counts differ per request, a compiled op would re-check guards each call
KEEP_CONTEXT_BYTES = 1 << 30  # a request's gathered layers kept for the second pass, up to this size
KERNEL_ON_CPU = False  # the Triton attention on CPU tensors too (its interpreter: tests); CUDA uses it once checked
log = logging.getLogger(__name__)


@dataclass
class Blend:
    context: list[Placement]  # the placements, each blended chunk replaced by its private copy
    selected: torch.Tensor  # [S] indices into the chunk tokens (prompt order) recomputed in every layer
    deviation: torch.Tensor  # [C] each chunk token's K/V deviation at the selection layer
    cost: float  # in tokens through the whole model: all chunk tokens ran layer 0, the selected ones every layer


class PlacedContext:
    """Every token of a request's placed context, in prompt order, and its K/V per layer as the kernels
    read them: ``[N, Hkv, D]`` fp32, keys rotated by their placement's delta (kernels/reference.py's
    ``gather_context``, with the slots and rotations worked out once instead of per layer)."""

    def __init__(self, runner: ModelRunner, placed: list[Placement]):
        self.pool, dev = runner.pool, runner.device
        bs = self.pool.shape.block_size
        offsets = [np.arange(p.first_block * bs, p.segment.num_tokens) for p in placed]  # each token's index in its segment
        owner = np.concatenate([np.full(len(t), i) for i, t in enumerate(offsets)])
        delta = np.concatenate([np.full(len(t), p.delta) for p, t in zip(placed, offsets)])
        position = np.concatenate([p.segment.start + p.delta + t for p, t in zip(placed, offsets)])
        # in prompt order the positions increase: a token at position p sees the context tokens [0, limit(p))
        assert (np.diff(position) > 0).all(), "a placed context out of position order"
        self.owner, self.offset = torch.from_numpy(owner), torch.from_numpy(np.concatenate(offsets))  # [N] host
        self.position = torch.from_numpy(position).to(dev)  # [N]
        self.delta = torch.from_numpy(delta)  # [N] host
        # [N]: each token's slot in a layer's pool viewed as [blocks * bs, Hkv, D]
        self.slots = torch.cat([self.pool.slots(p.segment.blocks, len(t), p.first_block * bs) for p, t in zip(placed, offsets)])
        d = self.delta.to(dev)
        self.cos, self.sin = runner.rope_cos[d][:, None], runner.rope_sin[d][:, None]  # [N, 1, D/2] R(delta)
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        L, _, _, hkv, hd = self.pool.k.shape
        self._keep = 2 * L * len(self.slots) * hkv * hd * 4 <= KEEP_CONTEXT_BYTES

    def __len__(self) -> int:
        return len(self.slots)

    def limit(self, rows: torch.Tensor) -> torch.Tensor:
        """[S]: how many context tokens each of the context's tokens ``rows`` [S] sees (itself and all before it)."""
        return rows + 1

    def layer(self, i: int, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s context K, V [N, Hkv, D] fp32; ``keep``: held for a later call (if they fit), which takes them."""
        if i in self._kept:
            return self._kept.pop(i)
        hkv, hd = self.pool.k.shape[-2:]
        k = self.pool.k[i].view(-1, hkv, hd)[self.slots].float()
        kv = apply_rotary(k, self.cos, self.sin), self.pool.v[i].view(-1, hkv, hd)[self.slots].float()
        if keep and self._keep:
            self._kept[i] = kv
        return kv


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


# How tokens are chosen (``lazy:blend=R:select=...``):
# * "global" / "chunk": the top R by layer-1 K/V deviation, of all chunk tokens or of each chunk (CacheBlend);
# * "attn": the top R by the attention the question pays them over the cached (lazy) context, summed over
#   heads, question tokens and the layers from ``attn_from`` (a fraction of the depth) on; the question is
#   first run over the context (its K/V dropped);
# * "attn_dev": the top R by deviation times that attention (the error a token's stale K/V puts into the
#   question's attention is about the weight it gets times how far its K/V are off);
# * "gradual": CacheBlend's gradual filtering: GRADUAL_FACTOR x R tokens by layer-1 deviation run layer 1,
#   the top R of those by layer-2 deviation go on through the other layers.
# ``per_chunk`` (``:budget=chunk``) takes R of each chunk's tokens instead of R of all of them (the "chunk"
# selection is deviation with per_chunk).
SELECTIONS = BLEND_SELECTIONS  # named once, in lazyrag/strategy_names.py (the CLI checks them without torch)
GRADUAL_FACTOR = 2.0


@torch.inference_mode()
def question_attention(runner: ModelRunner, ctx: PlacedContext, question: list[int], start: int,
                       layers: tuple[int, int] | None = None) -> tuple[torch.Tensor, int]:
    """[N]: the attention each context token gets from the question run over the context as cached, summed over
    heads and question tokens in layers [lo, hi); and the number of layers the question ran through. The
    gathered layers are kept in ``ctx`` for the recompute that follows."""
    model, dev, ops = runner.model, runner.device, DENSE_OPS
    L, n_ctx = len(model.layers), len(ctx)
    lo, hi = layers or (0, L)
    x = model.embed(torch.tensor(question, device=dev))
    cos, sin = rope_at(runner.rope_cos, runner.rope_sin, torch.arange(start, start + len(question), device=dev), x.dtype)
    T = len(question)
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    score = torch.zeros(n_ctx, device=dev)
    for layer, block in enumerate(model.layers[:hi]):
        kc, vc = ctx.layer(layer, keep=True)
        q, k, v = block.attn.project(block.attn_input(x, ops), cos, sin, ops, runner.rope_scaling)
        group = q.shape[1] // k.shape[1]
        keys = torch.cat((kc, k.float())).repeat_interleave(group, dim=1)  # [N+T, Hq, D]
        vals = torch.cat((vc, v.float())).repeat_interleave(group, dim=1)
        logits = torch.einsum("thd,nhd->htn", q.float(), keys) * model.sm_scale
        logits[:, :, n_ctx:] = logits[:, :, n_ctx:].masked_fill(~causal, float("-inf"))
        p = logits.softmax(-1)  # [Hq, T, N+T]
        if layer >= lo:
            score += p[:, :, :n_ctx].sum((0, 1))
        o = torch.einsum("htn,nhd->thd", p, vals).to(x.dtype)
        x = block.after_attention(x, block.attn.output(o.flatten(1)), ops)
    if model.tp is not None:  # each rank summed its own heads: the score is over all of them
        model.tp.all_reduce(score)
    return score, hi


@torch.inference_mode()
def selective_recompute(
    runner: ModelRunner,
    placed: list[Placement],
    ids: list[list[int] | None],
    ratio: float,
    allocate: Callable[[int], list[int]],
    first: int = 0,
    selection: str = "global",
    question: list[int] | None = None,
    question_start: int = 0,
    per_chunk: bool = False,
    attn_from: float = 0.0,
) -> Blend:
    """Blend the placements whose token ``ids`` are given (``None``: read as cached, e.g. the prefix).

    ``first`` tokens of each chunk are always recomputed (EPIC's heads), on top of ``ratio``.
    ``selection``: one of SELECTIONS; "attn" and "attn_dev" need the
    ``question`` (token ids) and where it starts; their attention counts from layer ``attn_from * L`` on.
    ``per_chunk``: ``ratio`` of each chunk's tokens, not of all chunk tokens.
    ``allocate(n)`` gives n fresh blocks for the private copies; the caller owns and frees them.
    """
    assert selection in SELECTIONS, selection
    pool, model, dev, ops = runner.pool, runner.model, runner.device, DENSE_OPS
    layers = model.layers
    L = len(layers)
    ctx = PlacedContext(runner, placed)
    owner, offset, pos = ctx.owner, ctx.offset, ctx.position
    blended = torch.tensor([x is not None for x in ids])[owner]

    chunk_pos = blended.nonzero()[:, 0]  # [C] the chunk tokens' places in the context
    C = len(chunk_pos)
    if not C:
        return Blend(list(placed), torch.zeros(0, dtype=torch.int64), torch.zeros(0), 0.0)
    chunk_ids = torch.tensor([ids[i][j] for i, j in zip(owner[chunk_pos].tolist(), offset[chunk_pos].tolist())], device=dev)
    chunk_of, forced = owner[chunk_pos], offset[chunk_pos] < first
    cost = 0.0  # in tokens through the whole model
    attn = None
    if selection in ("attn", "attn_dev"):
        assert question, "selection by the question's attention needs the question"
        score, ran = question_attention(runner, ctx, question, question_start, (int(attn_from * L), L))
        attn, cost = score[chunk_pos.to(dev)].cpu(), len(question) * ran / L
    sel_layer = min(SELECTION_LAYER, L - 1)
    # (layer, tokens kept there, score from the deviation there or None: the attention, before the layer runs)
    if selection == "attn":
        stages = [(0, ratio, None)]
    elif selection == "gradual" and sel_layer + 1 < L:
        stages = [(sel_layer, min(1.0, GRADUAL_FACTOR * ratio), "dev"), (sel_layer + 1, ratio, "dev")]
    else:
        stages = [(sel_layer, ratio, "dev")]
    cur = torch.arange(C)  # the chunk tokens (indices into the C) still running
    x = model.embed(chunk_ids)  # [C, H]
    deviation = torch.zeros(C)
    fresh = []  # (layer, cur then, k, v): the fresh K/V of layers >= 1, written once the final tokens are known

    def keep(score: torch.Tensor, r: float) -> torch.Tensor:
        """The tokens of ``cur`` to keep: rows of the current tensors (sorted), by ``score`` [C]."""
        full = torch.full((C,), float("-inf"))
        full[cur] = score[cur]
        return torch.searchsorted(cur, select(full, chunk_of, r, forced, per_chunk or selection == "chunk"))

    def running(cur: torch.Tensor):
        """The running tokens' places in the context, rotations and how many context tokens each sees."""
        sel = chunk_pos[cur].to(dev)
        return (sel, *rope_at(runner.rope_cos, runner.rope_sin, pos[sel], x.dtype), ctx.limit(sel))

    sel, cos, sin, limit = running(cur)
    for layer, block in enumerate(layers):
        stage = next((s for s in stages if s[0] == layer), None)
        if stage is not None and stage[2] is None:  # chosen before the layer runs: the dropped tokens cost nothing
            rows_kept = keep(attn, stage[1])
            cur, x = cur[rows_kept], x[rows_kept.to(dev)]
            sel, cos, sin, limit = running(cur)
        kc, vc = ctx.layer(layer)  # [N, Hkv, D] fp32, as cached
        q, k, v = block.attn.project(block.attn_input(x, ops), cos, sin, ops, runner.rope_scaling)
        if stage is not None and stage[2] == "dev":
            d = kv_deviation(k, v, kc[sel], vc[sel])
            if model.tp is not None:  # over this rank's KV heads: summed, every rank picks the same tokens
                model.tp.all_reduce(d)
            d = d.cpu()
            if layer == stages[0][0]:
                deviation[cur] = d
            score = torch.zeros(C)
            score[cur] = d
            if attn is not None:
                score = score * attn
            rows_kept = keep(score, stage[1])
            r = rows_kept.to(dev)
            cur, x, q, k, v = cur[rows_kept], x[r], q[r], k[r], v[r]
            sel, cos, sin, limit = running(cur)
        cost += len(cur) / L  # a layer's projections for the dropped tokens are not counted
        if not len(cur):
            break
        if layer >= 1:  # layer 0's K/V depend on token and position only: the cached ones are exact
            fresh.append((layer, cur, k, v))
        if layer == L - 1:
            break  # the last layer's K/V is all the question needs
        o = recompute_attention(q, kc, vc, sel, k, v, limit, model.sm_scale).to(x.dtype)
        x = block.after_attention(x, block.attn.output(o.flatten(1)), ops)  # [S, H]
    if not len(cur):
        return Blend(list(placed), torch.zeros(0, dtype=torch.int64), deviation, _counted(runner, cost))
    # the tokens are known: their private copies, and their fresh K/V of every layer in one write
    context, slots = _private_copies(pool, placed, owner[chunk_pos[cur]], offset[chunk_pos[cur]], allocate)
    if fresh:
        d = ctx.delta[chunk_pos[cur]].to(dev)
        back = runner.rope_cos[d][:, None], -runner.rope_sin[d][:, None]  # R(-delta): the copy is read at the chunk's delta
        rows = [torch.searchsorted(was, cur).to(dev) for _, was, _, _ in fresh]  # the final tokens' rows of each layer
        k = torch.stack([kk[r] for (_, _, kk, _), r in zip(fresh, rows)]).float()  # [L', S, Hkv, D]
        v = torch.stack([vv[r] for (_, _, _, vv), r in zip(fresh, rows)])
        pool.write_layers([lay for lay, _, _, _ in fresh], slots, apply_rotary(k, *back), v)
    return Blend(context, cur, deviation, _counted(runner, cost))


def prefix_attention(q, k, v, limit, sm_scale):
    """kernels/recompute.py's kernel, imported on first use: Triton is an extra, and a CPU install may lack it."""
    from lazyrag.kernels.recompute import prefix_attention as kernel

    return kernel(q, k, v, limit, sm_scale)


def recompute_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, sel: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, limit: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """The running tokens' attention ([S, Hq, D]) over the context as cached (``kc``, ``vc``: [N, Hkv, D] fp32) where
    their own rows ``sel`` hold their fresh ``k``, ``v``; each sees the first ``limit`` context tokens. On CUDA in the
    model's dtype through kernels/recompute.py (a dense fp32 mask was most of a recovery's time), else in fp32."""
    if (q.is_cuda or KERNEL_ON_CPU) and _kernel_checked(q.device, q.dtype, q.shape[1], kc.shape[1], q.shape[2], sm_scale):
        keys, vals = kc.to(q.dtype).index_copy_(0, sel, k), vc.to(q.dtype).index_copy_(0, sel, v)
        return prefix_attention(q, keys, vals, limit, sm_scale)
    keys, vals = kc.index_copy(0, sel, k.float()), vc.index_copy(0, sel, v.float())
    return prefix_attention_reference(q.float(), keys, vals, limit, sm_scale)


@functools.cache
def _kernel_checked(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int, sm_scale: float) -> bool:
    """Whether the Triton kernel, as built for this device, dtype and head layout, matches the reference on a small
    random problem: checked once per process and layout, so a build that fails or computes wrong on some device
    costs a warning and the reference's speed, never a wrong answer."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=g).to(device, dtype) for n, h in ((37, hq), (300, hkv), (300, hkv)))
    limit = torch.randint(1, 301, (37,), generator=g).sort().values.to(device)
    try:
        out = prefix_attention(q, k, v, limit, sm_scale).float()
        ref = prefix_attention_reference(q, k, v, limit, sm_scale)
        err = float((out - ref).norm() / ref.norm())
    except Exception as e:  # e.g. a Triton that cannot compile it here
        if KERNEL_ON_CPU:
            raise
        log.warning("the recovery's attention kernel failed on %s (%s: %s); using the PyTorch reference", device,
                    type(e).__name__, e)
        return False
    ok = err < (1e-4 if dtype == torch.float32 else 2e-2)
    if not ok:
        log.warning("the recovery's attention kernel is off by %.2g on %s (%s); using the PyTorch reference", err, device, dtype)
    return ok


def _counted(runner: ModelRunner, cost: float) -> float:
    runner.tokens_forwarded += round(cost)
    return cost


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
