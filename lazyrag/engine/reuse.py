"""The four ways to get a RAG prompt's KV, side by side on one cache and one model.

* ``full``: prefill the whole prompt; nothing reused (the quality reference).
* ``prefix``: reuse the longest cached run of whole blocks that is an exact token prefix
  (vLLM APC / SGLang radix style); everything after the first difference is recomputed.
* ``position_aware``: KV cached per (chunk, position), as Block-Attention runs on vLLM's
  cache: a chunk at a position it was not cached at is encoded again (after the shared
  prefix, then rotated into place, so its values equal ``lazy``'s); only the placed copy is
  kept. ``position_aware:rerotate`` also keeps the position-free chunk, so a new position
  costs a re-rotated copy rather than an encode (a stronger baseline than the paper's).
* ``lazy``: each chunk is encoded once and read at any position; the attention kernel
  applies the offset (LazyAttention).

A strategy turns a prompt layout into a plan: the placed segments the new tokens attend
to, and the new tokens themselves. Misses are encoded (or copied) while planning, except
while the scheduler plans a step (``EncodeBatch``): then a plain ``lazy`` plan only looks up,
allocates and records its misses (the cache changes exactly as if they were encoded one
request at a time), and the step's misses are computed together in one batched forward
before the step's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lazyrag.engine.request import Plan
from lazyrag.engine.runner import ModelRunner, Placement, SeqState
from lazyrag.kv.block_pool import blocks_for
from lazyrag.kv.cache import CacheManager, Segment, SegmentKind
from lazyrag.kv.identity import chunk_key, content_key, prefix_key
from lazyrag.prompt import PromptLayout
from lazyrag.strategy_names import BLEND_BUDGETS, BLEND_SELECTIONS, STRATEGY_NAMES, check_strategy, lazy_options

ENCODE_BATCH_TOKENS = 8192


@dataclass
class EncodeJob:
    key: str
    ids: list[int]
    start: int
    context: list[Placement]
    kind: SegmentKind = SegmentKind.CHUNK
    # positions its K is rotated back by once encoded (the encoding passage's length): the segment then starts
    # where a chunk encoded right after the prefix would, so requests read it as if the passage were not there
    rebase: int = 0


@dataclass(eq=False)
class _Pending:
    job: EncodeJob
    seq: SeqState
    segment: Segment


class EncodeBatch:
    """The misses of the requests a step plans, computed together before the step's prefill (SGLang's and
    vLLM's shape: looking up only looks up, the work goes into the step's forward).

    While ``open``, a deferring plan's encode allocates the blocks, puts the segment in the cache and pins it
    as it would after computing it, so evictions, admissions and hits are those of the one-at-a-time path;
    the KV itself is computed at ``flush``. The batch holds one more pin on every pending segment, so none
    is evicted (or demoted to a tier) before its KV exists. Any plan that reads KV while planning
    (copies, recomputation) flushes first (``Strategy.plan``). A job that fails alone (once the batched
    forward failed) leaves its segment out of the cache and its key in ``failed``: the plans that pinned it
    must fail."""

    def __init__(self, cache: CacheManager, runner: ModelRunner):
        self.cache, self.runner = cache, runner
        self.open = False
        self.pending: list[_Pending] = []
        self.failed: set[int] = set()  # id() of segments whose KV could not be computed
        self.tokens_flushed = 0  # tokens the flushes ran through the model (counted for their own requests)

    def begin(self) -> None:
        assert not self.open and not self.pending, "an encode batch is already open"
        self.open, self.failed = True, set()

    def end(self) -> None:
        """Compute what is pending and close the batch (``failed`` stays readable until the next ``begin``)."""
        try:
            self.flush()
        finally:
            self.open = False

    def defer(self, job: EncodeJob, seq: SeqState, seg: Segment) -> None:
        self.cache.pin(seg)
        self.pending.append(_Pending(job, seq, seg))

    def flush(self) -> None:
        """Compute every pending job: prefixes first (chunks are encoded after them), in batches of
        ENCODE_BATCH_TOKENS; a failing batch is run again one job at a time."""
        pending, self.pending = self.pending, []
        try:
            for wave in (
                [p for p in pending if p.job.kind != SegmentKind.CHUNK],
                [p for p in pending if p.job.kind == SegmentKind.CHUNK],
            ):
                batch: list[_Pending] = []
                for p in wave:
                    if batch and sum(len(q.job.ids) for q in batch) + len(p.job.ids) > ENCODE_BATCH_TOKENS:
                        self._run(batch)
                        batch = []
                    batch.append(p)
                if batch:
                    self._run(batch)
        finally:
            for p in pending:
                self.cache.unpin(p.segment)

    def _run(self, batch: list[_Pending]) -> None:
        batch = [p for p in batch if not self._depends_on_failed(p)]
        try:
            _compute(self.runner, [(p.job, p.seq) for p in batch])
            self.tokens_flushed += sum(len(p.job.ids) for p in batch)
            return
        except Exception:
            if len(batch) == 1:
                self._fail(batch[0])
                return
        for p in batch:
            p.seq.num_written, p.seq.next_pos = 0, p.job.start
            self._run([p])

    def check(self, plan: Plan) -> None:
        """Raise if the KV of a segment ``plan`` pinned could not be computed (its request must fail)."""
        if any(id(seg) in self.failed for seg in plan.pinned):
            raise RuntimeError("encoding one of the request's chunks failed")

    def _depends_on_failed(self, p: _Pending) -> bool:
        if any(id(c.segment) in self.failed for c in p.job.context):
            self._fail(p)
            return True
        return False

    def _fail(self, p: _Pending) -> None:
        self.failed.add(id(p.segment))
        self.cache.discard(p.segment)


def _compute(runner: ModelRunner, work: list[tuple[EncodeJob, SeqState]]) -> None:
    """Run the jobs' tokens into their blocks (one forward), then rotate each one's K back over its rebase."""
    runner.prefill([s for _, s in work], [j.ids for j, _ in work], logits=False)
    for rebase in {j.rebase for j, _ in work} - {0}:
        runner.rotate_k([b for j, s in work if j.rebase == rebase for b in s.blocks], -rebase)


class Strategy:
    name = "base"
    defers = False  # its plans read no KV while planning: their misses may be computed in the step's batch

    def __init__(
        self,
        cache: CacheManager,
        runner: ModelRunner,
        fingerprint: str,
        batch: EncodeBatch | None = None,
        passage_ids: Sequence[int] = (),
    ):
        self.cache, self.runner, self.fingerprint = cache, runner, fingerprint
        self.passage_ids = list(passage_ids)  # the encoding passage chunks are encoded after (prompt.py)
        self.batch = batch if batch is not None else EncodeBatch(cache, runner)  # shared by a planner's strategies

    def plan(self, layout: PromptLayout) -> Plan:
        """The request's plan; if making it fails, what it pinned or allocated so far is given back."""
        if self.batch.open and not self.defers:
            self.flush()  # it may read KV that earlier plans of the step left to compute
        plan = Plan(context=[], new_ids=[], new_start=0)
        try:
            self._plan(layout, plan)
        except BaseException:
            self.release(plan)
            raise
        return plan

    def flush(self, plan: Plan | None = None) -> None:
        """Compute the step's pending encodes now; raise if one that ``plan`` pinned failed."""
        self.batch.flush()
        if plan is not None:
            self.batch.check(plan)

    def release(self, plan: Plan) -> None:
        """Unpin the plan's segments and free its own blocks (when its request ends)."""
        for seg in plan.pinned:
            self.cache.unpin(seg)
        plan.pinned.clear()
        if plan.owned_blocks:
            self.cache.pool.decref(plan.owned_blocks)
            plan.owned_blocks.clear()

    def _plan(self, layout: PromptLayout, plan: Plan) -> None:
        raise NotImplementedError

    def lookup_keys(self, layout: PromptLayout) -> list[str]:
        """The cache keys a plan of ``layout`` asks for, computing nothing: what a prefetch can bring up from the
        host or disk tier before the request is planned. The prefix and the position-free chunks."""
        return [self.prefix_key(layout.prefix_ids)] + [
            self.chunk_key(layout.encoding_prefix, c) for c in layout.chunk_ids
        ]

    def finish(self, plan: Plan, seq: SeqState) -> None:
        """Called once the prompt is prefilled, before the request's own blocks are released."""

    # -- shared by the chunk-caching strategies --------------------------------------

    def prefix_key(self, prefix_ids: list[int]) -> str:
        return prefix_key(self.fingerprint, prefix_ids)

    def chunk_key(self, prefix_ids: list[int], chunk_ids: list[int]) -> str:
        return chunk_key(self.fingerprint, prefix_ids, chunk_ids, self.passage_ids)

    def encoding_context(
        self, enc_ids: list[int], plan: Plan, prefix: Segment | None = None, defer: bool = False
    ) -> Segment:
        """What a missing chunk is encoded after: the encoding prefix and, if the engine has one, the encoding
        passage (one segment, cached like a prefix); pinned. ``prefix``: the encoding prefix's segment, if held."""
        if prefix is not None and not self.passage_ids:
            return prefix
        return self.prefix_segment(list(enc_ids) + self.passage_ids, plan, own=False, defer=defer)

    def chunk_job(self, key: str, ids: list[int], context: Segment) -> EncodeJob:
        """Encode a chunk right after ``context`` (``encoding_context``), rebased over the passage."""
        return EncodeJob(key, ids, context.num_tokens, [Placement(context, 0)], rebase=len(self.passage_ids))

    def encode(
        self, jobs: list[EncodeJob], plan: Plan | None = None, keep: bool = True, defer: bool = False
    ) -> list[Segment]:
        """Compute each job's KV into fresh blocks, in batches, and cache (pinned) the segments.

        With ``plan``, each segment is recorded in ``plan.pinned`` as soon as it exists, so a
        failure part-way (e.g. the pool is full) still lets the plan give everything back.
        ``keep=False``: the segments are not cached (transient, freed when unpinned).
        ``defer``: while the step's encode batch is open, the KV is computed at its flush
        (its tokens counted in ``plan.tokens_encoded_ahead``).
        """
        defer = defer and self.batch.open
        segments: list[Segment] = []
        group: list[EncodeJob] = []  # one forward's jobs, at most ENCODE_BATCH_TOKENS together
        for job in jobs:
            assert job.ids, "cannot encode an empty segment"
            if group and sum(len(j.ids) for j in group) + len(job.ids) > ENCODE_BATCH_TOKENS:
                self._encode_group(group, segments, plan, keep, defer)
                group.clear()
            group.append(job)
        if group:
            self._encode_group(group, segments, plan, keep, defer)
        return segments

    def _encode_group(
        self, group: list[EncodeJob], segments: list[Segment], plan: Plan | None, keep: bool, defer: bool
    ) -> None:
        """One forward's worth of ``encode``'s jobs (deferred: their blocks only), their segments appended to
        ``segments``."""
        seqs = self._encode_into_blocks(group, defer)
        for job, seq in zip(group, seqs):
            segments.append(self._encoded_segment(job, seq, plan, keep, defer))

    def _encode_into_blocks(self, group: list[EncodeJob], defer: bool) -> list[SeqState]:
        """Fresh blocks for each job and, unless deferred to the step's encode batch, its KV computed into them; on a
        failure the blocks go back (no segment holds them yet)."""
        bs = self.cache.pool.shape.block_size
        seqs: list[SeqState] = []
        try:
            for j in group:
                seqs.append(
                    SeqState(
                        context=j.context, blocks=self.cache.allocate(blocks_for(len(j.ids), bs)), next_pos=j.start
                    )
                )
            if not defer:
                _compute(self.runner, list(zip(group, seqs)))
        except BaseException:
            for s in seqs:
                self.cache.pool.decref(s.blocks)
            raise
        return seqs

    def _encoded_segment(self, job: EncodeJob, seq: SeqState, plan: Plan | None, keep: bool, defer: bool) -> Segment:
        """The segment over a job's blocks, pinned: cached (``keep``) or transient, in ``plan.pinned`` at once so that a
        later failure still gives it back, and, deferred, handed to the step's encode batch to compute."""
        seg = Segment(job.key, seq.blocks, len(job.ids), job.start - job.rebase, kind=job.kind)
        if keep:
            seg = self.cache.put(seg)
        else:
            seg.pins, seg.transient = 1, True
        if plan is not None:
            plan.pinned.append(seg)
        if defer:
            self.batch.defer(job, seq, seg)
            if plan is not None:
                plan.tokens_encoded_ahead += len(job.ids)
        return seg

    def prefix_segment(self, ids: list[int], plan: Plan, own: bool = True, defer: bool = False) -> Segment:
        """A context-free segment at position 0 (a prompt's prefix): looked up, else computed; pinned.
        ``own``: it is the request's prefix (not only the one its chunks were encoded after), so a hit
        counts in ``plan.prefix_tokens_reused``."""
        key = self.prefix_key(ids)
        seg = self.cache.get(key)
        if seg is None:
            return self.encode([EncodeJob(key, ids, 0, [], kind=SegmentKind.PREFIX)], plan, defer=defer)[0]
        plan.pinned.append(seg)
        if own:
            plan.prefix_tokens_reused = len(ids)
        return seg

    def base_segments(
        self,
        layout: PromptLayout,
        plan: Plan,
        keep: bool = True,
        only: set[str] | None = None,
        keys: list[str] | None = None,
        defer: bool = False,
    ) -> tuple[Segment, dict[str, Segment]]:
        """The request's prefix and each distinct chunk encoded after the encoding prefix. All pinned.

        Chunks are encoded after the *encoding* prefix (usually the same as the request's
        prefix; a LlamaIndex prompt has its own), so their KV and key never depend on the request.
        ``only``: just these chunk keys. ``keep=False``: the chunks are encoded for this request
        alone, neither looked up nor cached. ``keys``: the chunks' keys, if the caller has them.
        ``defer``: misses are computed in the step's encode batch (``EncodeBatch``), if one is open.
        """
        enc_ids = layout.encoding_prefix
        prefix = self.prefix_segment(layout.prefix_ids, plan, defer=defer)
        keys = keys if keys is not None else [self.chunk_key(enc_ids, c) for c in layout.chunk_ids]
        found: dict[str, Segment] = {}
        jobs: list[EncodeJob] = []
        context = None
        for key, ids in zip(keys, layout.chunk_ids):
            if key in found or any(j.key == key for j in jobs) or (only is not None and key not in only):
                continue
            seg = self.cache.get(key) if keep else None
            if seg is None:
                if context is None:  # what a miss is encoded after: a request whose chunks all hit never needs it
                    context = self.encoding_context(
                        enc_ids, plan, prefix if enc_ids == layout.prefix_ids else None, defer
                    )
                jobs.append(self.chunk_job(key, ids, context))
            else:
                found[key] = seg
                plan.pinned.append(seg)
        for seg in self.encode(jobs, plan, keep, defer):
            found[seg.key] = seg
        missed = {j.key for j in jobs}
        plan.chunks_missed = sum(key in missed for key in keys)
        plan.chunks_hit = len(keys) - plan.chunks_missed
        return prefix, {k: found[k] for k in keys if k in found}


class FullPrefill(Strategy):
    name = "full"

    def _plan(self, layout: PromptLayout, plan: Plan) -> None:
        plan.new_ids, plan.chunks_missed = layout.full_ids(), len(layout.chunk_ids)

    def lookup_keys(self, layout: PromptLayout) -> list[str]:
        return []


class LazyStitching(Strategy):
    """Cached chunks read in place, with two optional ways to win back quality in context:

    * ``recompute_first``: each chunk's first tokens are computed again in context (EPIC's
      LegoLink), which restores the attention they would have paid to the documents before it;
    * ``blend``: that fraction of chunk tokens, those whose cached KV deviates most in context,
      is computed again (CacheBlend, engine/blend.py); ``blend_select`` says how the tokens are chosen
      (engine/blend.py SELECTIONS: by deviation over all chunks or per chunk, by the question's
      attention, ...), ``blend_budget`` whether the fraction is of all chunk tokens or of each chunk, and
      ``attn_from`` from which depth (a fraction of the layers) the question's attention is counted.
      With both, the heads are recomputed on top of the fraction.
    """

    name = "lazy"
    defers = True  # its misses join the step's encode batch; a recovering variant computes them before it recomputes

    def __init__(
        self,
        cache: CacheManager,
        runner: ModelRunner,
        fingerprint: str,
        batch: EncodeBatch | None = None,
        passage_ids: Sequence[int] = (),
        recompute_first: int = 0,
        blend: float = 0.0,
        blend_select: str = "global",
        blend_budget: str = "global",
        attn_from: float = 0.0,
    ) -> None:
        super().__init__(cache, runner, fingerprint, batch, passage_ids)
        self.recompute_first, self.blend, self.blend_select = recompute_first, blend, blend_select
        self.blend_budget, self.attn_from = blend_budget, attn_from
        assert blend_select in BLEND_SELECTIONS and blend_budget in BLEND_BUDGETS and 0 <= attn_from < 1
        options = [f"first={recompute_first}"] * bool(recompute_first) + [f"blend={blend:g}"] * bool(blend)
        if blend and self.blend_select != "global":
            options.append(f"select={self.blend_select}")
        if blend and self.blend_budget != "global":
            options.append(f"budget={self.blend_budget}")
        if blend and self.attn_from:
            options.append(f"attn_from={self.attn_from:g}")
        if options:
            self.name = "lazy:" + ":".join(options)

    def _plan(self, layout: PromptLayout, plan: Plan) -> None:
        plan.new_ids, plan.new_start = list(layout.question_ids), layout.question_start
        keys = [self.chunk_key(layout.encoding_prefix, c) for c in layout.chunk_ids]  # hashed once
        prefix, chunks = self.base_segments(layout, plan, keys=keys, defer=True)
        placed = [Placement(prefix, 0)]
        for start, key in zip(layout.chunk_starts(), keys):
            seg = chunks[key]
            placed.append(Placement(seg, start - seg.start))
        if (self.blend or self.recompute_first) and self.batch.open:
            self.flush(plan)  # recovery reads the chunks' KV
        if self.blend:
            placed = self._blend(placed, layout, plan)
        elif self.recompute_first:
            placed = self._recompute_heads(placed, layout, plan)
        plan.context = placed
        plan.tokens_context = layout.num_tokens - len(plan.new_ids) - plan.tokens_recomputed

    def _blend(self, placed: list[Placement], layout: PromptLayout, plan: Plan) -> list[Placement]:
        """Recompute the most-deviating chunk tokens (and the heads) in context into private copies of their blocks."""
        from lazyrag.engine.blend import selective_recompute

        def allocate(n: int) -> list[int]:
            blocks = self.cache.allocate(n)
            plan.owned_blocks.extend(blocks)  # release(plan) frees them with the request, even if this fails midway
            return blocks

        b = selective_recompute(
            self.runner,
            placed,
            [None, *layout.chunk_ids],
            self.blend,
            allocate,
            first=self.recompute_first,
            selection=self.blend_select,
            per_chunk=self.blend_budget == "chunk",
            attn_from=self.attn_from,
            question=list(layout.question_ids),
            question_start=layout.question_start,
        )
        plan.tokens_recomputed, plan.recompute_cost = len(b.selected), b.cost
        return b.context

    def _recompute_heads(self, placed: list[Placement], layout: PromptLayout, plan: Plan) -> list[Placement]:
        """Recompute each chunk's first tokens (whole blocks) attending to the prefix and the cached
        chunks before it, all chunks in one batched prefill; the chunk is then read from the next block."""
        bs = self.cache.pool.shape.block_size
        heads = blocks_for(self.recompute_first, bs)
        seqs, ids, spans = [], [], []
        for i, p in enumerate(placed[1:], start=1):
            seg = p.segment
            n = min(seg.num_tokens, heads * bs)
            blocks = self.cache.allocate(blocks_for(n, bs))
            plan.owned_blocks += blocks  # release(plan) frees them with the request, even if this fails midway
            seqs.append(SeqState(context=placed[:i], blocks=blocks, next_pos=seg.start + p.delta))
            ids.append(layout.chunk_ids[i - 1][:n])
            spans.append((p, blocks, n))
        if seqs:
            self.runner.prefill(seqs, ids, logits=False)
        context = [placed[0]]
        for p, blocks, n in spans:
            plan.tokens_recomputed += n
            plan.recompute_cost += n
            head = Segment("", blocks, n, p.segment.start + p.delta, kind=SegmentKind.RECOMPUTED, transient=True)
            context.append(Placement(head, 0))
            if n < p.segment.num_tokens:
                context.append(Placement(p.segment, p.delta, first_block=len(blocks)))
        return context


class PositionAware(Strategy):
    """Block-Attention-style reuse: KV cached per (chunk, position), a materialised, rotated copy each."""

    name = "position_aware"
    keep_base = False  # True: also cache the position-free chunk, to copy from at new positions

    def _wanted(self, layout: PromptLayout) -> list[tuple[str, str, int]]:
        """(the placed copy's key, its position-free chunk's key, the shift between them) of each chunk."""
        wanted = []
        for start, ids in zip(layout.chunk_starts(), layout.chunk_ids):
            base_key = self.chunk_key(layout.encoding_prefix, ids)
            delta = start - len(layout.encoding_prefix)
            wanted.append((base_key if delta == 0 else content_key(base_key, "at", str(delta)), base_key, delta))
        return wanted

    def lookup_keys(self, layout: PromptLayout) -> list[str]:
        keys = [self.prefix_key(layout.prefix_ids)] + [copy for copy, _, _ in self._wanted(layout)]
        return keys + [base for _, base, _ in self._wanted(layout)] * self.keep_base

    def _plan(self, layout: PromptLayout, plan: Plan) -> None:
        plan.new_ids, plan.new_start = list(layout.question_ids), layout.question_start
        # Look up the positioned copies first: the base chunks are needed only to make missing ones.
        wanted = self._wanted(layout)
        copies = {key: self.cache.get(key) for key in dict.fromkeys(k for k, _, _ in wanted)}
        plan.pinned.extend(s for s in copies.values() if s is not None)
        found = {key for key, seg in copies.items() if seg is not None}
        if all(copies.values()):
            prefix = self.prefix_segment(layout.prefix_ids, plan)
        else:
            # without kept position-free chunks, each missing placement is encoded anew (Block-Attention on vLLM)
            missing = None if self.keep_base else {base_key for key, base_key, _ in wanted if copies[key] is None}
            prefix, bases = self.base_segments(layout, plan, keep=self.keep_base, only=missing)
            for key, base_key, delta in wanted:
                if copies[key] is None:
                    base = bases[base_key]
                    blocks = self.cache.allocate(len(base.blocks))
                    self.runner.copy_rotated(base, blocks, delta)
                    copy = copies[key] = self.cache.put(
                        Segment(key, blocks, base.num_tokens, base.start + delta, kind=SegmentKind.COPY)
                    )
                    plan.pinned.append(copy)
            for base in bases.values():  # a source used for copies only is freed now, not at the request's end
                if base.transient and all(copies[k] is not base for k, _, _ in wanted):
                    plan.pinned.remove(base)
                    self.cache.unpin(base)
        hits = sum(key in found for key, _, _ in wanted)
        plan.chunks_hit, plan.chunks_missed = hits, len(wanted) - hits
        plan.context.append(Placement(prefix, 0))
        for key, _, _ in wanted:
            seg = copies[key]
            assert seg is not None  # found, or made above
            plan.context.append(Placement(seg, 0))
        plan.tokens_context = layout.num_tokens - len(plan.new_ids)


class PrefixCaching(Strategy):
    """Automatic prefix caching: whole blocks keyed by a hash chain over the exact token prefix."""

    name = "prefix"

    def _chain(self, ids: list[int]) -> list[str]:
        bs = self.cache.pool.shape.block_size
        keys, prev = [], self.fingerprint
        for i in range(len(ids) // bs):
            prev = content_key(prev, "block", ids[i * bs : (i + 1) * bs])
            keys.append(prev)
        return keys

    def lookup_keys(self, layout: PromptLayout) -> list[str]:
        ids = layout.full_ids()
        return self._chain(ids)[: (len(ids) - 1) // self.cache.pool.shape.block_size]

    def _plan(self, layout: PromptLayout, plan: Plan) -> None:
        ids = layout.full_ids()
        bs = self.cache.pool.shape.block_size
        plan.block_keys = self._chain(ids)
        keys = plan.block_keys[: (len(ids) - 1) // bs]  # keep one token to prefill, for the logits
        for key in keys:
            seg = self.cache.get(key)
            if seg is None:
                break
            plan.pinned.append(seg)
            plan.context.append(Placement(seg, 0))
        self.cache.record(keys[len(plan.context) + 1 :])  # asked for too, though the walk stopped at the first miss
        cached = len(plan.context) * bs
        plan.new_ids, plan.new_start, plan.tokens_context = ids[cached:], cached, cached
        plan.prefix_tokens_reused = min(cached, len(layout.prefix_ids))  # the rest of the reused blocks: chunks
        # A chunk counts as hit when all of it lies in the reused prefix.
        ends = [s + len(c) for s, c in zip(layout.chunk_starts(), layout.chunk_ids)]
        plan.chunks_hit = sum(e <= cached for e in ends)
        plan.chunks_missed = len(ends) - plan.chunks_hit

    def finish(self, plan: Plan, seq: SeqState) -> None:
        """Publish the request's newly computed whole prompt blocks into the hash chain."""
        bs = self.cache.pool.shape.block_size
        first = plan.new_start // bs
        # Tail first: when the budget cannot hold the whole chain, the head evicts the tail, not the reverse.
        for j, key in reversed(list(enumerate(plan.block_keys[first:]))):
            if key in self.cache:
                continue
            block = seq.blocks[j]
            self.cache.pool.incref([block])
            self.cache.put(Segment(key, [block], bs, (first + j) * bs, kind=SegmentKind.PREFIX_BLOCK), pin=False)
        # Like vLLM, release the chain tail first: the head, which every longer match needs, goes last.
        self.cache.touch(reversed(plan.block_keys))


class RerotatingPositionAware(PositionAware):
    """Position-aware caching that also keeps each position-free chunk: a chunk at a new position
    costs a re-rotated copy (milliseconds), not an encode; chunk and copies share the budget."""

    name = "position_aware:rerotate"
    keep_base = True


STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (FullPrefill, PrefixCaching, PositionAware, RerotatingPositionAware, LazyStitching)
}
assert set(STRATEGIES) == set(STRATEGY_NAMES), "lazyrag/strategy_names.py lists the strategies defined here"


class Planner:
    """The strategies by name over one cache and one model runner; ``lazy:...`` variants are made on first use."""

    def __init__(self, cache: CacheManager, runner: ModelRunner, fingerprint: str, passage_ids: Sequence[int] = ()):
        self.cache, self.runner, self.fingerprint = cache, runner, fingerprint
        self.passage_ids = list(passage_ids)
        self.batch = EncodeBatch(cache, runner)  # the step's deferred encodes, shared by every strategy
        self._by_name: dict[str, Strategy] = {
            n: cls(cache, runner, fingerprint, self.batch, self.passage_ids) for n, cls in STRATEGIES.items()
        }

    def __getitem__(self, name: str) -> Strategy:
        if name not in self._by_name:
            self._by_name[name] = LazyStitching(
                self.cache,
                self.runner,
                self.fingerprint,
                self.batch,
                self.passage_ids,
                **lazy_options(check_strategy(name)),
            )
        return self._by_name[name]
