"""EngineCore: the engine's shared state (scheduler, planner, chunk cache, model runner) and every operation on it.

``LazyEngine`` (engine.py) is the front door: prompts, the chunk finder, streams, the thread that steps, the
locks. It changes or reads the state below only through a core's methods, and never asks how many processes
run it (vLLM v1's ``LLMEngine`` -> ``EngineCoreClient`` -> ``EngineCore``):

- one process: an ``EngineCore``, whose methods act on its own state;
- tensor parallelism: on rank 0 a ``TensorParallelCore`` (engine/tensor_parallel.py) with the same methods,
  each of which sends its own name and arguments to the other ranks and runs the same method on rank 0's
  ``EngineCore`` (nano-vllm's ``ModelRunner.call``); the other ranks' loop calls it on theirs.

The methods that change state (``step``, ``drop_aborted``, ``encode``, ``attach``, ``forget``) are called with the
engine's lock held; ``add`` and ``abort`` from any thread at any time, as the scheduler's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lazyrag.engine.config import EngineConfig
from lazyrag.engine.request import Plan, Request, SamplingParams
from lazyrag.engine.reuse import Planner
from lazyrag.engine.runner import ModelRunner
from lazyrag.engine.scheduler import Scheduler
from lazyrag.kv.block_pool import BlockPool, KVShape
from lazyrag.kv.cache import CacheManager
from lazyrag.kv.identity import KVIdentity
from lazyrag.model.attention import make_attention_backend
from lazyrag.model.llama import LlamaModel, build_rope
from lazyrag.prompt import PromptLayout

if TYPE_CHECKING:
    from lazyrag.store.corpus import CorpusStore


def config_device(cfg: EngineConfig) -> torch.device:
    """``cfg.device`` as ``EngineConfig.__post_init__`` resolved it (a ``torch.device``, never a str or None)."""
    device = cfg.device
    assert isinstance(device, torch.device)
    return device


def config_dtype(cfg: EngineConfig) -> torch.dtype:
    """``cfg.dtype`` as ``EngineConfig.__post_init__`` resolved it (never a str or None)."""
    dtype = cfg.dtype
    assert dtype is not None and not isinstance(dtype, str)
    return dtype


KVByKey = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Core(Protocol):
    """What ``LazyEngine`` asks of its core: an ``EngineCore`` or, under tensor parallelism, a
    ``TensorParallelCore``. ``scheduler``, ``planner``, ``cache`` and ``runner`` are this process's own, for
    reading."""

    scheduler: Scheduler
    planner: Planner
    cache: CacheManager
    runner: ModelRunner
    attention_backend: str
    supports_warm_up: bool

    def seeded(self, params: SamplingParams) -> SamplingParams: ...
    def add(self, req: Request) -> None: ...
    def abort(self, req: Request) -> None: ...
    def drop_aborted(self) -> None: ...
    def step(self) -> bool: ...
    def has_work(self) -> bool: ...
    def now(self) -> float: ...
    def encode(self, prefix_ids: list[int], chunks: list[list[int]], read: bool) -> tuple[int, KVByKey]: ...
    def attach(self, store: CorpusStore | Path, identity: KVIdentity) -> CorpusStore: ...
    def attached(self, folder: Path) -> CorpusStore | None: ...
    def chunk_key(self, prefix_ids: list[int], chunk_ids: list[int]) -> str: ...
    def prefix_key(self, prefix_ids: list[int]) -> str: ...
    def identity(self, model_name: str, system: str, prefix_ids: list[int], encoding_passage: str) -> KVIdentity: ...
    def forget(self) -> None: ...
    def problem(self) -> str | None: ...
    def close(self) -> None: ...


class EngineCore:
    """One process's scheduler, planner, chunk cache and model runner over ``model`` (under tensor parallelism this
    rank's shard: its pool holds its share of the KV heads), and the operations on them."""

    supports_warm_up = True  # ``LazyEngine.warm_up`` runs a request, then ``forget``s it

    def __init__(
        self,
        model: LlamaModel,
        hf_config: Any,  # a transformers config, or a SavedConfig (model/loader.py): read by attribute
        config: EngineConfig,
        fingerprint: str,
        tokenizer: Any,  # a transformers tokenizer, or None
        end_tokens: set[int],
        passage_ids: list[int],
    ):
        args, tp = model.args, model.tp
        self.fingerprint = fingerprint
        self.tensor_parallel_size = 1 if tp is None else tp.size
        device, kv_budget, attention_name = config_device(config), config.kv_budget, config.attention
        assert kv_budget is not None and not isinstance(kv_budget, str) and attention_name is not None  # resolved
        # under tensor parallelism ``args`` is this rank's shard: the pool holds its KV heads of every block
        shape = KVShape(args.num_layers, args.num_kv_heads, args.head_dim, config.block_size, config_dtype(config))
        pool = BlockPool.with_budget(shape, kv_budget, device)
        self.cache = CacheManager(pool, config.cache)
        if tp is not None:
            self.cache.kv_heads = tp.head_range(args.num_kv_heads * tp.size)
        rope_cos, rope_sin, rope_scaling = build_rope(hf_config, device)
        attention = make_attention_backend(attention_name, device)
        self.attention_backend = attention.name
        self.runner = ModelRunner(model, pool, attention, rope_cos, rope_sin, rope_scaling)
        if config.compile_elementwise:
            self.runner.compile_elementwise()
        if config.triton_elementwise:
            self.runner.use_triton_elementwise()
        half = args.head_dim // 2
        if config.fused_kv_store and half >= 8 and half & (half - 1) == 0:  # the fused kernel's head_dim
            self.runner.fuse_kv_store()
        self.runner.short_prefill_blas = config.short_prefill_blas
        if config.gemv:
            self.runner.use_gemv()
        if config.skinny_gemm:
            self.runner.use_skinny_gemm()
        if config.cuda_graphs:
            # padding tokens of captured shapes write their K/V here; no sequence reads it
            self.runner.enable_cuda_graphs(scratch_block=pool.allocate(1)[0])
        self.planner = Planner(self.cache, self.runner, fingerprint, passage_ids)
        self.scheduler = Scheduler(self.runner, self.cache, self.planner, tokenizer, end_tokens, config.scheduler)

    # -- requests: ``add`` and ``abort`` from any thread, the rest with the engine's lock held ----------

    def seeded(self, params: SamplingParams) -> SamplingParams:
        """The params a request runs with: in one process, as given (under tensor parallelism a sampled request
        without a seed gets one here, for every rank to draw the same tokens)."""
        return params

    def add(self, req: Request) -> None:
        """Queue ``req``; the next ``step`` takes it in."""
        self.scheduler.add(req)

    def abort(self, req: Request) -> None:
        """Mark ``req`` aborted; the next ``step`` (or ``drop_aborted``) gives back what it holds."""
        self.scheduler.abort(req)

    def drop(self, req: Request) -> None:
        """End ``req`` now unless it has ended: what a tensor-parallel rank does with a request rank 0 ended alone."""
        if not req.done:
            self.scheduler.drop(req)

    def drop_aborted(self) -> None:
        self.scheduler.drop_aborted()

    def step(self) -> bool:
        """One forward pass over the requests in flight; False when there was nothing to do."""
        return self.scheduler.step()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def now(self) -> float:
        """The scheduler's clock: what a request's arrival and finish are measured on."""
        return self.scheduler.clock()

    # -- chunk KV ahead of time, and stores -----------------------------------------------------

    def encode(self, prefix_ids: list[int], chunks: list[list[int]], read: bool) -> tuple[int, KVByKey]:
        """Encode the chunks' KV (each after ``prefix_ids``) into the cache unless already there. How many were new
        and, with ``read``, each segment's K/V ``[L, T, Hkv, D]`` on the CPU by content key (the prefix's too)."""
        layout = PromptLayout(prefix_ids=prefix_ids, chunk_ids=chunks, question_ids=[])
        strategy = self.planner["lazy"]
        plan = Plan(context=[], new_ids=[], new_start=0)
        try:
            prefix, found = strategy.base_segments(layout, plan)
            kv = {}
            if read:
                kv = {key: self.cache.read_kv(seg) for key, seg in found.items()}
                kv[prefix.key] = self.cache.read_kv(prefix)
        finally:
            strategy.release(plan)
        return plan.chunks_missed, kv

    def attach(self, store: CorpusStore | Path, identity: KVIdentity) -> CorpusStore:
        """Open the store (a ``CorpusStore``, or its folder), check that its KV is this engine's (``identity``) and
        add it to the cache's tiers, last in lookup order. The store."""
        from lazyrag.store.corpus import CorpusStore

        if not isinstance(store, CorpusStore):
            store = CorpusStore.open(store)
        store.check_compatible(identity)
        self.cache.add_tier(store)
        return store

    def attached(self, folder: Path) -> CorpusStore | None:
        """The store of ``folder`` (resolved) among the cache's tiers, if attached."""
        from lazyrag.store.corpus import CorpusStore

        return next((t for t in self.cache.tiers if isinstance(t, CorpusStore) and t.path.resolve() == folder), None)

    def chunk_key(self, prefix_ids: list[int], chunk_ids: list[int]) -> str:
        """The content key of a chunk's KV encoded after ``prefix_ids`` (what the cache and stores index by)."""
        return self.planner["lazy"].chunk_key(prefix_ids, chunk_ids)

    def prefix_key(self, prefix_ids: list[int]) -> str:
        return self.planner["lazy"].prefix_key(prefix_ids)

    def identity(self, model_name: str, system: str, prefix_ids: list[int], encoding_passage: str) -> KVIdentity:
        """What chunk KV computed after ``prefix_ids`` (``system``'s) depends on; a store must match it."""
        shape = self.cache.pool.shape
        # the model's KV heads, not this rank's share: a store holds every head, and each rank reads its own
        return KVIdentity(
            self.fingerprint,
            model_name,
            str(shape.dtype).replace("torch.", ""),
            shape.block_size,
            shape.num_layers,
            shape.num_kv_heads * self.tensor_parallel_size,
            shape.head_dim,
            system,
            list(prefix_ids),
            self.prefix_key(prefix_ids),
            list(self.planner.passage_ids),
            encoding_passage,
        )

    def forget(self) -> None:
        """Empty the cache and zero the counters: as new, after ``LazyEngine.warm_up``'s request."""
        self.cache.reset()
        self.scheduler.steps = dict.fromkeys(self.scheduler.steps, 0)
        self.runner.tokens_forwarded = 0
        self.planner.batch.tokens_flushed = 0

    # -- health -----------------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why this core cannot serve, or None: one process always can."""
        return None

    def close(self) -> None:
        """Nothing to stop in one process."""
