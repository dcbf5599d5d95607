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
slots and rotations are computed once per request (the running tokens' ones only when they change), the
selection runs on the device from budgets the host knows beforehand, nothing syncs with the host until the selected
tokens are read once at the end (their private blocks are allocated there), the fresh K/V are written to the pool in
one go, and the elementwise steps run as the runner's Triton kernels where it uses them, else eagerly (a compiled
op's guards cost more than its launches at these sizes). benchmarks/recover_ops.py counts the ops and syncs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Sequence, cast

import numpy as np
import torch

from lazyrag.engine.runner import ModelRunner, Placement
from lazyrag.kernels.reference import apply_rotary, gather_rotated_reference, prefix_attention_reference
from lazyrag.kv.block_pool import BlockPool
from lazyrag.kv.cache import Segment, SegmentKind
from lazyrag.model.llama import Block, ElementwiseOps, LlamaModel, rope_at
from lazyrag.strategy_names import BLEND_SELECTIONS

SELECTION_LAYER = 1  # the first layer whose K/V depend on the context
DENSE_OPS = ElementwiseOps()  # eager: token counts differ per request, a compiled op would re-check guards each call
KEEP_CONTEXT_BYTES = 1 << 30  # a request's gathered layers kept for the second pass, up to this size
KERNEL_ON_CPU = False  # the Triton attention on CPU tensors too (its interpreter: tests); CUDA uses it once checked
log = logging.getLogger(__name__)


def _blocks(model: LlamaModel) -> Sequence[Block]:
    """The model's decoder blocks (an ``nn.ModuleList``, whose items torch types as plain modules)."""
    return cast("Sequence[Block]", model.layers)


@dataclass
class Blend:
    context: list[Placement]  # the placements, each blended chunk replaced by its private copy
    selected: torch.Tensor  # [S] indices into the chunk tokens (prompt order) recomputed in every layer (host)
    deviation: torch.Tensor  # [C] each chunk token's K/V deviation at the selection layer (the model's device)
    cost: float  # in tokens through the whole model: all chunk tokens ran layer 0, the selected ones every layer


class PlacedContext:
    """Every token of a request's placed context, in prompt order, and its K/V per layer as the kernels
    read them: ``[N, Hkv, D]``, keys rotated by their placement's delta (kernels/reference.py's
    ``gather_context``, with the slots and rotations worked out once instead of per layer). In the pool's dtype,
    gathered by kernels/recompute.py's ``gather_rotated`` where the recovery's kernels run (``fast``), else fp32."""

    def __init__(self, runner: ModelRunner, placed: list[Placement]):
        self.pool, dev = runner.pool, runner.device
        self.rope_cos, self.rope_sin = runner.rope_cos, runner.rope_sin
        bs = self.pool.shape.block_size
        offsets = [
            np.arange(p.first_block * bs, p.segment.num_tokens) for p in placed
        ]  # each token's index in its segment
        owner = np.concatenate([np.full(len(t), i) for i, t in enumerate(offsets)])
        delta = np.concatenate([np.full(len(t), p.delta) for p, t in zip(placed, offsets)])
        position = np.concatenate([p.segment.start + p.delta + t for p, t in zip(placed, offsets)])
        # in prompt order the positions increase: a token at position p sees the context tokens [0, limit(p))
        assert (np.diff(position) > 0).all(), "a placed context out of position order"
        self.offsets = offsets  # each placement's token offsets (numpy), for the chunk tokens' layout
        self.owner, self.offset = owner, np.concatenate(offsets)  # [N] host (numpy): placement, offset in it
        self.position = torch.from_numpy(position).to(dev)  # [N]
        self.delta = torch.from_numpy(delta).to(dev)  # [N]
        # [N]: each token's slot in a layer's pool viewed as [blocks * bs, Hkv, D] (worked out on the host: one copy)
        slots = np.concatenate(
            [np.asarray(p.segment.blocks, dtype=np.int64)[t // bs] * bs + t % bs for p, t in zip(placed, offsets)]
        )
        self.slots = torch.from_numpy(slots).to(dev)
        attn = _blocks(runner.model)[0].attn
        self.fast = use_kernels(dev, self.pool.k.dtype, attn.hq, attn.hkv, attn.d, runner.model.sm_scale)
        if not self.fast:  # the fp32 path rotates with tables gathered once, not once per layer
            self.cos, self.sin = self.rope_cos[self.delta][:, None], self.rope_sin[self.delta][:, None]
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        L, _, _, hkv, hd = self.pool.k.shape
        elem = self.pool.k.element_size() if self.fast else 4
        self._keep = 2 * L * len(self.slots) * hkv * hd * elem <= KEEP_CONTEXT_BYTES

    def __len__(self) -> int:
        return len(self.slots)

    def limit(self, rows: torch.Tensor) -> torch.Tensor:
        """[S]: how many context tokens each of the context's tokens ``rows`` [S] sees (itself and all before it)."""
        return rows + 1

    def layer(self, i: int, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s context K, V [N, Hkv, D], new tensors the caller owns; ``keep``: held for a later call (if
        they fit), which takes them."""
        if i in self._kept:
            return self._kept.pop(i)
        hkv, hd = self.pool.k.shape[-2:]
        k, v = self.pool.k[i].view(-1, hkv, hd), self.pool.v[i].view(-1, hkv, hd)
        if self.fast:
            kv = gather_rotated(k, v, self.slots, self.delta, self.rope_cos, self.rope_sin)
        else:
            # fp32 (the CPU's path): the rows indexed first, then widened, so the whole layer is never copied
            kv = apply_rotary(k[self.slots].float(), self.cos, self.sin), v[self.slots].float()
        if keep and self._keep:
            self._kept[i] = kv
        return kv


def kv_deviation(k: torch.Tensor, v: torch.Tensor, k_cached: torch.Tensor, v_cached: torch.Tensor) -> torch.Tensor:
    """[T]: squared distance of each token's K and V ([T, Hkv, D]) from the cached ones."""
    return ((k.float() - k_cached) ** 2).sum((1, 2)) + ((v.float() - v_cached) ** 2).sum((1, 2))


def select(
    deviation: torch.Tensor, chunk: torch.Tensor, ratio: float, forced: torch.Tensor, per_chunk: bool = False
) -> torch.Tensor:
    """Sorted indices of the tokens to recompute: the ``forced`` ones and the top ``ratio`` of the
    others by ``deviation`` (all [C]), counted over all chunk tokens or, ``per_chunk``, in each chunk (``chunk``:
    each token's chunk, non-decreasing). Reads ``chunk`` and ``forced`` on the host (the recompute's own
    :class:`Picker` knows them beforehand)."""
    owner, is_forced = chunk.cpu().numpy(), forced.cpu().numpy()
    assert (np.diff(owner) >= 0).all(), "a chunk's tokens are contiguous"
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(owner)) + 1, [len(owner)]))
    return Picker(bounds, is_forced, per_chunk).pick(deviation, forced, ratio)


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
def question_attention(
    runner: ModelRunner, ctx: PlacedContext, question: list[int], start: int, layers: tuple[int, int] | None = None
) -> tuple[torch.Tensor, int]:
    """[N]: the attention each context token gets from the question run over the context as cached, summed over
    heads and question tokens in layers [lo, hi); and the number of layers the question ran through. The
    gathered layers are kept in ``ctx`` for the recompute that follows. Nothing syncs with the host."""
    model, dev, ops = runner.model, runner.device, dense_ops(runner)
    L, n_ctx = len(model.layers), len(ctx)
    lo, hi = layers or (0, L)
    x = model.embed(torch.tensor(question, device=dev))
    cos, sin = rope_at(
        runner.rope_cos, runner.rope_sin, torch.arange(start, start + len(question), device=dev), x.dtype
    )
    T = len(question)
    score = torch.zeros(n_ctx, device=dev)
    hidden = None  # [G*T, T]: the question's own later tokens, for each row (q head within its group, token)
    for layer, block in enumerate(_blocks(model)[:hi]):
        kc, vc = ctx.layer(layer, keep=True)
        q, k, v = block.attn.project(block.attn_input(x, ops), cos, sin, ops, runner.rope_scaling)
        hkv, G, D = k.shape[1], q.shape[1] // k.shape[1], q.shape[2]
        if hidden is None:
            hidden = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1).repeat(G, 1)
        # grouped heads as batched GEMMs over the KV heads: no copy of the context per query head
        qg = torch.empty(hkv, G, T, D, device=dev)  # widened and regrouped in one copy
        qg.copy_(q.view(T, hkv, G, D).permute(1, 2, 0, 3))
        qg = qg.view(hkv, G * T, D)
        keys, vals = _widened(kc, k), _widened(vc, v)  # [Hkv, N+T, D] fp32
        logits = torch.matmul(qg, keys.transpose(1, 2)).mul_(model.sm_scale)  # [Hkv, G*T, N+T]
        logits[:, :, n_ctx:].masked_fill_(hidden, float("-inf"))
        p = logits.softmax(-1)
        if layer >= lo:
            score += p[:, :, :n_ctx].sum((0, 1))
        o = torch.empty(T, hkv, G, D, dtype=x.dtype, device=dev)  # [T, Hq, D]: narrowed and regrouped in one copy
        o.copy_(torch.matmul(p, vals).view(hkv, G, T, D).permute(2, 0, 1, 3))
        x = block.after_attention(x, block.attn.output(o.view(T, hkv * G * D)), ops)
    if model.tp is not None:  # each rank summed its own heads: the score is over all of them
        model.tp.all_reduce(score)
    return score, hi


def _widened(context: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``[Hkv, N+T, D]`` fp32: the context's rows ``[N, Hkv, D]`` then the question's own ``[T, Hkv, D]``, each
    widened and moved into place by one copy (not concatenated in their dtype, then widened)."""
    N, T = context.shape[0], own.shape[0]
    out = torch.empty(context.shape[1], N + T, context.shape[2], device=context.device)
    out[:, :N].copy_(context.transpose(0, 1))
    out[:, N:].copy_(own.to(context.dtype).transpose(0, 1))  # as stored: in the context's dtype first
    return out


class ChunkTokens:
    """The chunk tokens of a placed context (those whose ids are given), in prompt order: their layout on the host
    (numpy, known before anything runs) and what the recompute indexes with on the model's device."""

    def __init__(self, ctx: PlacedContext, ids: Sequence[Sequence[int] | None], first: int, device: torch.device):
        owner, offset = ctx.owner, ctx.offset
        blended = np.array([x is not None for x in ids], dtype=bool)
        self.place = np.flatnonzero(blended[owner])  # [C] their rows in the context
        self.owner, self.offset = owner[self.place], offset[self.place]  # [C] host: placement, offset in it
        self.count = len(self.place)
        # chunk tokens are contiguous per placement: each chunk's [start, end) among the C
        chunks = [i for i in range(len(ids)) if ids[i] is not None]
        sizes = np.array([len(ctx.offsets[i]) for i in chunks], dtype=np.int64)
        self.bounds = np.concatenate(([0], np.cumsum(sizes)))
        token_ids = [np.asarray(ids[i], dtype=np.int64)[ctx.offsets[i]] for i in chunks]
        self.forced = self.offset < first  # [C] host: the tokens always recomputed
        self.ids = torch.from_numpy(np.concatenate(token_ids) if token_ids else np.zeros(0, np.int64)).to(device)
        self.place_dev = torch.from_numpy(self.place).to(device)
        self.forced_dev = torch.from_numpy(self.forced).to(device)


class Picker:
    """The top of a score by chunk-token budget, on the score's device without a sync: how many tokens each group
    (all chunk tokens, or each chunk) takes is known on the host from the layout alone."""

    def __init__(self, bounds: np.ndarray, forced: np.ndarray, per_chunk: bool):
        self.bounds = bounds if per_chunk else np.array([0, bounds[-1]])
        self.forced = [int(forced[a:b].sum()) for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    def pick(self, score: torch.Tensor, forced: torch.Tensor, ratio: float) -> torch.Tensor:
        """Sorted indices: the ``forced`` tokens and the top ``ratio`` of the others by ``score`` in each group."""
        score = score.masked_fill(forced, float("inf"))
        picks = []
        for (a, b), f in zip(zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist()), self.forced):
            n = min(b - a, f + round(ratio * (b - a)))
            top = score[a:b].topk(n).indices
            picks.append(top + a if a else top)
        return (picks[0] if len(picks) == 1 else torch.cat(picks)).sort().values


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

    Everything up to the last layer stays on the model's device; the host reads the selected tokens once, at the
    end (their private blocks are allocated there).
    """
    assert selection in SELECTIONS, selection
    ctx = PlacedContext(runner, placed)
    chunks = ChunkTokens(ctx, ids, first, runner.device)
    if not chunks.count:
        return Blend(list(placed), torch.zeros(0, dtype=torch.int64), torch.zeros(0), 0.0)
    L = len(runner.model.layers)
    cost, attn = 0.0, None  # cost in tokens through the whole model
    if selection in ("attn", "attn_dev"):
        assert question, "selection by the question's attention needs the question"
        score, ran = question_attention(runner, ctx, question, question_start, (int(attn_from * L), L))
        attn, cost = score[chunks.place_dev], len(question) * ran / L
    picker = Picker(chunks.bounds, chunks.forced, per_chunk or selection == "chunk")
    run = _Recompute(runner, ctx, chunks, picker, attn)
    cost += run.layers(_stages(selection, ratio, L))
    selected = run.cur.cpu()  # the one sync: the host allocates their blocks
    if not len(selected):
        return Blend(list(placed), torch.zeros(0, dtype=torch.int64), run.deviation, _counted(runner, cost))
    # the tokens are known: their private copies, and their fresh K/V of every layer in one write
    context, slots = _private_copies(
        runner.pool, placed, chunks.owner[selected.numpy()], chunks.offset[selected.numpy()], allocate
    )
    run.write_fresh(slots)
    return Blend(context, selected, run.deviation, _counted(runner, cost))


# (layer, tokens kept there, score from the deviation there ("dev") or None: the attention, before the layer runs)
Stage = tuple[int, float, str | None]


def _stages(selection: str, ratio: float, L: int) -> list[Stage]:
    """Where a selection drops tokens, and how many it keeps there."""
    sel_layer = min(SELECTION_LAYER, L - 1)
    if selection == "attn":
        return [(0, ratio, None)]
    if selection == "gradual" and sel_layer + 1 < L:
        return [(sel_layer, min(1.0, GRADUAL_FACTOR * ratio), "dev"), (sel_layer + 1, ratio, "dev")]
    return [(sel_layer, ratio, "dev")]


class _Recompute:
    """The layer loop of :func:`selective_recompute`: the running chunk tokens (``cur``, indices into the C chunk
    tokens, sorted, on the device) through the layers, dropped at the selection stages. Their rows' positions,
    rotations and limits are worked out only when ``cur`` changes; no step reads a device value on the host."""

    def __init__(
        self, runner: ModelRunner, ctx: PlacedContext, chunks: ChunkTokens, picker: Picker, attn: torch.Tensor | None
    ) -> None:
        self.runner, self.ctx, self.chunks, self.picker, self.attn = runner, ctx, chunks, picker, attn
        self.model, self.ops = runner.model, dense_ops(runner)
        C, dev = chunks.count, runner.device
        self.cur = torch.arange(C, device=dev)
        self.x = self.model.embed(chunks.ids)  # [C, H]
        self.deviation = torch.zeros(C, device=dev)
        # the fresh K/V of layers >= 1 by the ``cur`` they were computed for: (cur, layers, ks, vs), gathered once
        # the final tokens are known
        self.fresh: list[tuple[torch.Tensor, list[int], list[torch.Tensor], list[torch.Tensor]]] = []
        self._running()

    def _running(self) -> None:
        """The running tokens' rows in the context, rotations and how many context tokens each sees."""
        self.sel = self.chunks.place_dev[self.cur]
        self.cos, self.sin = rope_at(
            self.runner.rope_cos, self.runner.rope_sin, self.ctx.position[self.sel], self.x.dtype
        )
        self.limit = self.ctx.limit(self.sel).to(torch.int32)

    def _keep(self, score: torch.Tensor, ratio: float) -> torch.Tensor:
        """Drop to the top ``ratio`` by ``score`` (of the running tokens, [len(cur)]); returns the kept rows."""
        full = torch.full((self.chunks.count,), float("-inf"), device=score.device).index_put_((self.cur,), score)
        picks = self.picker.pick(full, self.chunks.forced_dev, ratio)
        rows = torch.searchsorted(self.cur, picks)
        self.cur, self.x = picks, self.x[rows]
        self._running()
        return rows

    def _select_by_deviation(
        self, first: bool, ratio: float, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A "dev" stage: each running token's K/V deviation here, times the question's attention where it counts;
        returns ``k``, ``v`` and the rows of ``q`` kept."""
        d = kv_deviation(k, v, kc[self.sel], vc[self.sel])
        if self.model.tp is not None:  # over this rank's KV heads: summed, every rank picks the same tokens
            self.model.tp.all_reduce(d)
        if first:
            self.deviation.index_put_((self.cur,), d)
        rows = self._keep(d if self.attn is None else d * self.attn[self.cur], ratio)
        return k[rows], v[rows], rows

    def layers(self, stages: list[Stage]) -> float:
        """Run the layers; returns their cost in tokens through the whole model."""
        blocks, cost = _blocks(self.model), 0.0
        L = len(blocks)
        for layer, block in enumerate(blocks):
            stage = next((s for s in stages if s[0] == layer), None)
            if stage is not None and stage[2] is None:  # chosen before the layer runs: the dropped ones cost nothing
                assert self.attn is not None  # the "attn" selection's stage: the question's attention was computed
                self._keep(self.attn[self.cur], stage[1])
            kc, vc = self.ctx.layer(layer)  # [N, Hkv, D], as cached
            q, k, v = block.attn.project(
                block.attn_input(self.x, self.ops), self.cos, self.sin, self.ops, self.runner.rope_scaling
            )
            if stage is not None and stage[2] == "dev":
                k, v, rows = self._select_by_deviation(layer == stages[0][0], stage[1], k, v, kc, vc)
                q = q[rows]
            cost += len(self.cur) / L  # a layer's projections for the dropped tokens are not counted
            if not len(self.cur):
                break
            if layer >= 1:  # layer 0's K/V depend on token and position only: the cached ones are exact
                self._keep_fresh(layer, k, v)
            if layer == L - 1:
                break  # the last layer's K/V is all the question needs
            o = recompute_attention(q, kc, vc, self.sel, k, v, self.limit, self.model.sm_scale).to(self.x.dtype)
            self.x = block.after_attention(self.x, block.attn.output(o.flatten(1)), self.ops)  # [S, H]
        return cost

    def _keep_fresh(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.fresh or self.fresh[-1][0] is not self.cur:
            self.fresh.append((self.cur, [], [], []))
        _, layers, ks, vs = self.fresh[-1]
        layers.append(layer)
        ks.append(k)
        vs.append(v)

    def write_fresh(self, slots: torch.Tensor) -> None:
        """The final tokens' fresh K/V of every layer into their private copies (``slots``), in one write: keys
        rotated by R(-delta), since the copy is read at the chunk's delta."""
        if not self.fresh:
            return
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for cur, _, k_layers, v_layers in self.fresh:  # stacked once per ``cur``; the final rows where it changed
            k, v = torch.stack(k_layers), torch.stack(v_layers)  # [layers, S', Hkv, D]
            if cur is not self.cur:
                rows = torch.searchsorted(cur, self.cur)
                k, v = k[:, rows], v[:, rows]
            ks.append(k)
            vs.append(v)
        d = self.ctx.delta[self.sel]
        back = self.runner.rope_cos[d][:, None], -self.runner.rope_sin[d][:, None]
        k_all = (ks[0] if len(ks) == 1 else torch.cat(ks)).float()
        v_all = vs[0] if len(vs) == 1 else torch.cat(vs)
        layers = [layer for _, lay, _, _ in self.fresh for layer in lay]
        self.runner.pool.write_layers(layers, slots, apply_rotary(k_all, *back), v_all)


def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """kernels/recompute.py's kernel, imported on first use: Triton is an extra, and a CPU install may lack it."""
    from lazyrag.kernels.recompute import prefix_attention as kernel

    out: torch.Tensor = kernel(q, k, v, limit, sm_scale)
    return out


def recompute_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    sel: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    limit: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """The running tokens' attention ([S, Hq, D]) over the context as cached (``kc``, ``vc``: [N, Hkv, D] fp32) where
    their own rows ``sel`` hold their fresh ``k``, ``v``; each sees the first ``limit`` context tokens. On CUDA in the
    model's dtype through kernels/recompute.py (a dense fp32 mask was most of a recovery's time), else in fp32."""
    if use_kernels(q.device, q.dtype, q.shape[1], kc.shape[1], q.shape[2], sm_scale):
        # the context is the caller's own (PlacedContext.layer): written in place
        keys, vals = kc.to(q.dtype).index_copy_(0, sel, k), vc.to(q.dtype).index_copy_(0, sel, v)
        return prefix_attention(q, keys, vals, limit, sm_scale)
    keys, vals = kc.index_copy(0, sel, k.float()), vc.index_copy(0, sel, v.float())
    out: torch.Tensor = prefix_attention_reference(q.float(), keys, vals, limit, sm_scale)
    return out


def gather_rotated(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/recompute.py's gather, imported on first use (as ``prefix_attention``)."""
    from lazyrag.kernels.recompute import gather_rotated as kernel

    kv: tuple[torch.Tensor, torch.Tensor] = kernel(k, v, slots, delta, cos, sin)
    return kv


def use_kernels(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int, sm_scale: float) -> bool:
    """Whether the recovery gathers and attends with kernels/recompute.py's Triton kernels (CUDA, once checked)."""
    return (device.type == "cuda" or KERNEL_ON_CPU) and _kernel_checked(device, dtype, hq, hkv, d, sm_scale)


@functools.cache
def _kernel_checked(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int, sm_scale: float) -> bool:
    """Whether the Triton kernels, as built for this device, dtype and head layout, match the reference on a small
    random problem: checked once per process and layout, so a build that fails or computes wrong on some device
    costs a warning and the reference's speed, never a wrong answer."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=g).to(device, dtype) for n, h in ((37, hq), (300, hkv), (300, hkv)))
    limit = torch.randint(1, 301, (37,), generator=g).sort().values.to(device)
    slots, delta = (
        torch.randperm(300, generator=g)[:120].to(device),
        torch.randint(0, 50, (120,), generator=g).to(device),
    )
    angles = torch.rand(50, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    try:
        out = prefix_attention(q, k, v, limit, sm_scale).float()
        ref = prefix_attention_reference(q, k, v, limit, sm_scale)
        err = float((out - ref).norm() / ref.norm())
        gathered = torch.cat(gather_rotated(k, v, slots, delta, cos, sin)).float()
        expected = torch.cat(gather_rotated_reference(k, v, slots, delta, cos, sin)).float()
        err = max(err, float((gathered - expected).norm() / expected.norm()))
    except Exception as e:  # e.g. a Triton that cannot compile it here
        if KERNEL_ON_CPU:
            raise
        log.warning(
            "the recovery's attention kernel failed on %s (%s: %s); using the PyTorch reference",
            device,
            type(e).__name__,
            e,
        )
        return False
    ok = err < (1e-4 if dtype == torch.float32 else 2e-2)
    if not ok:
        log.warning(
            "the recovery's attention kernel is off by %.2g on %s (%s); using the PyTorch reference", err, device, dtype
        )
    return ok


def dense_ops(runner: ModelRunner) -> ElementwiseOps:
    """The recovery's elementwise ops: the runner's Triton kernels where it runs them (kernels/elementwise.py: one
    launch each at any token count), else eager ones (a compiled op's guards cost more than its launches here)."""
    if getattr(runner.ops.rms_norm, "__module__", None) == "lazyrag.kernels.elementwise":
        return _triton_dense_ops()
    return DENSE_OPS


@functools.cache
def _triton_dense_ops() -> ElementwiseOps:
    return DENSE_OPS.with_triton_kernels()


def _counted(runner: ModelRunner, cost: float) -> float:
    runner.tokens_forwarded += round(cost)
    return cost


def _private_copies(
    pool: BlockPool,
    placed: list[Placement],
    owner: np.ndarray,
    offset: np.ndarray,
    allocate: Callable[[int], list[int]],
) -> tuple[list[Placement], torch.Tensor]:
    """Copy every block holding a selected token (placement ``owner``, token ``offset`` in its segment: host
    arrays); the placements read the copies instead, at the same delta. Returns them and each token's pool slot."""
    bs = pool.shape.block_size
    context = list(placed)
    slots = np.empty_like(offset)
    src, dst = [], []  # the blocks to copy, copied in one go (one host-to-device transfer, not one per chunk)
    for i in np.unique(owner).tolist():
        p, mine = placed[i], owner == i
        touched = np.unique(offset[mine] // bs).tolist()
        fresh = allocate(len(touched))
        src += [p.segment.blocks[j] for j in touched]
        dst += fresh
        blocks = list(p.segment.blocks)  # untouched blocks are read from the shared chunk itself
        for j, b in zip(touched, fresh):
            blocks[j] = b
        seg = Segment("", blocks, p.segment.num_tokens, p.segment.start, kind=SegmentKind.BLENDED, transient=True)
        context[i] = Placement(seg, p.delta, p.first_block)
        table = np.asarray(blocks, dtype=np.int64)
        slots[mine] = table[offset[mine] // bs] * bs + offset[mine] % bs
    moves = torch.tensor([src, dst], device=pool.device)
    pool.k[:, moves[1]] = pool.k[:, moves[0]]
    pool.v[:, moves[1]] = pool.v[:, moves[0]]
    return context, torch.from_numpy(slots).to(pool.device)
