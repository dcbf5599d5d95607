"""LazyEngine: the front door. Load a Llama model, lay out RAG prompts, and generate with reusable chunk KV.

A request's path: ``generate`` / ``stream`` (or an adapter) -> ``submit`` -> the engine's core (engine/core.py:
one process's, or under tensor parallelism rank 0's, which keeps the other ranks in step) -> the scheduler
(engine/scheduler.py) -> the planner (engine/reuse.py: which KV comes from the cache) -> the
model runner (engine/runner.py) -> the model (model/llama.py) -> an attention backend
(model/attention.py) -> a Triton kernel (kernels/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, cast

import torch

from lazyrag.engine.config import EngineConfig
from lazyrag.engine.core import Core, EngineCore, config_device, config_dtype
from lazyrag.engine.request import GenerationResult, Request, SamplingParams
from lazyrag.engine.runner import ModelRunner
from lazyrag.engine.scheduler import Scheduler
from lazyrag.kv.cache import CacheManager
from lazyrag.kv.identity import KVIdentity
from lazyrag.model import checkpoint_cache
from lazyrag.model.llama import LlamaArgs, LlamaModel
from lazyrag.model.loader import (
    check_llama_config,
    fingerprint,
    load_checkpoint,
    load_config,
    load_sharded,
    resolve_model_source,
)
from lazyrag.model.parallel import TensorParallel, check_divisible, local_args, shard_hf_state_dict, shard_tensor
from lazyrag.prompt import (
    ChunkFinder,
    PromptBuilder,
    PromptLayout,
    check_chunks,
    check_layout,
    check_text,
    pasted_passages,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lazyrag.engine.tensor_parallel import Build
    from lazyrag.store.corpus import CorpusStore

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>")


class RequestStream:
    """One request's output. Iterate it (``for`` in any thread, or ``async for``) for its text deltas,
    then ``result()`` (``await aresult()``) gives the GenerationResult. Leaving the loop early, or
    ``close()``, aborts the request and gives its blocks back. The one way every stream ends."""

    def __init__(self, engine: "LazyEngine", request: Request):
        self.engine, self.request = engine, request

    def _ready_deltas(self) -> list[str]:
        """The text the stepping thread has produced since the last look (empty deltas dropped)."""
        out: list[str] = []
        while self.request.outputs:
            delta, _ = self.request.outputs.popleft()
            if delta:
                out.append(delta)
        return out

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                self.engine._drive(self.request)
                done = self.request.done  # read before draining: outputs added before ``done`` are drained below
                yield from self._ready_deltas()
                if done:
                    return
        finally:
            self.close()

    async def __aiter__(self) -> AsyncIterator[str]:
        req, loop, ready = self.request, asyncio.get_running_loop(), asyncio.Event()
        req.notify = lambda: loop.call_soon_threadsafe(ready.set)  # set before looking, so no wake-up is lost
        self.engine._ensure_driver()
        try:
            while True:
                done = req.done
                for delta in self._ready_deltas():
                    yield delta
                if done:
                    return
                await ready.wait()
                ready.clear()
        finally:
            self.close(wait=False)

    def result(self) -> GenerationResult:
        """Run to the end (the deltas not read are dropped) and return the result; raises the request's error."""
        for _ in self:
            pass
        return self.request.result()

    async def aresult(self) -> GenerationResult:
        async for _ in self:
            pass
        return self.request.result()

    def close(self, wait: bool = True) -> None:
        if not self.request.done:
            self.engine._abandon(self.request, wait)


def _join_group(
    args: LlamaArgs, cfg: EngineConfig, build: Build | None = None
) -> tuple[TensorParallel | None, list[subprocess.Popen[bytes]]]:
    """(None, []) for one process; else the split checked (before any process starts) and this process in the
    tensor-parallel group: (its ``TensorParallel``, the workers it spawned). ``build``: what a spawned worker calls."""
    if cfg.tensor_parallel_size == 1:
        return None, []
    import lazyrag.engine.tensor_parallel as tensor_parallel

    check_divisible(args, cfg.tensor_parallel_size)
    return tensor_parallel.start(cfg, build)


def _attached(
    engine: "LazyEngine", tp: TensorParallel | None, workers: Sequence[subprocess.Popen[bytes]]
) -> "LazyEngine":
    """The engine of one process as it is; under tensor parallelism rank 0's, its core driving the others' (on any
    other rank this serves rank 0 with the engine's core and exits)."""
    if tp is None:
        return engine
    import lazyrag.engine.tensor_parallel as tensor_parallel

    timeout = engine.config.tensor_parallel_timeout_s
    engine.core = tensor_parallel.attach(cast(EngineCore, engine.core), tp, list(workers), timeout, engine._lock)
    return engine


def _rank_args(args: LlamaArgs, tp: TensorParallel | None, cfg: EngineConfig) -> LlamaArgs:
    """The model's args, or under tensor parallelism this rank's shard of them; a rank's GPU is cuda:LOCAL_RANK."""
    if tp is None:
        return args
    if cast(torch.device, cfg.device).type == "cuda":  # EngineConfig.__post_init__ resolved it
        cfg.device = torch.device("cuda", tp.local_rank)
    shard: LlamaArgs = local_args(args, tp.size)
    return shard


class LazyEngine:
    """One model, one paged KV pool, one cache of position-free chunk KV, and a continuous-batching
    scheduler that plans each request with its strategy (``SamplingParams.strategy``)."""

    def __init__(
        self,
        model: LlamaModel,
        hf_config: Any,  # a transformers config, or a SavedConfig (model/loader.py): read by attribute
        tokenizer: Any,  # a transformers tokenizer, or None
        config: EngineConfig,
        model_fingerprint: str,
        model_name: str = "model",
    ):
        self.model, self.hf_config, self.tokenizer, self.config = model, hf_config, tokenizer, config
        self.fingerprint, self.model_name = model_fingerprint, model_name
        tp = model.tp
        if tp is not None and config.cache.disk_dir:  # each rank's disk tier holds its own heads
            config.cache = dataclasses.replace(
                config.cache, disk_dir=str(Path(config.cache.disk_dir) / f"tp{tp.size}-rank{tp.rank}")
            )
        self.prompts = (
            PromptBuilder(tokenizer, config.system_prompt, config.encoding_passage) if tokenizer is not None else None
        )
        self.chunk_finder = ChunkFinder()  # texts of known chunks, to find them inside free-form prompts
        passage_ids = self.prompts.passage_ids() if self.prompts is not None else []
        # scheduler, planner, cache and runner; every change to them goes through the core's methods. Under tensor
        # parallelism ``_attached`` wraps it on rank 0 in a core that keeps the other ranks' cores in step
        self.core: Core = EngineCore(
            model, hf_config, config, model_fingerprint, tokenizer, self._end_tokens(), passage_ids
        )
        self._lock = threading.Lock()  # held by whichever thread steps the core (or changes its state)
        self._stepping_thread: int | None = None  # ident of the thread inside ``step``, if any
        self._work = threading.Event()  # set when a request arrives, for the asyncio driver thread
        self._driver: threading.Thread | None = None
        self._driver_lock = threading.Lock()

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, warmup: bool = True, **config: Any) -> "LazyEngine":
        """Load the embedded default model (``model=None``), a local Llama folder, or a ``.gguf`` file.
        Keyword arguments are ``EngineConfig`` fields (device, dtype, kv_budget, scheduler, cache, model_cache, ...).
        A GGUF is converted once into a cache folder and read from there afterwards (``model_cache=False``, or
        LAZYRAG_MODEL_CACHE=0, reads the GGUF every time). ``warmup``: run a tiny request first and forget it
        (``warm_up``), so that no first-call cost falls on the first real request.
        With ``tensor_parallel_size=N`` the model is split over N processes (engine/tensor_parallel.py): this
        one is rank 0 and starts the other N - 1 itself, unless torchrun started them all (then on every rank
        but 0 this call serves rank 0 and exits the process when it stops)."""
        engine = cls._load(EngineConfig(model=model, **config))
        if warmup:
            engine.warm_up()
        return engine

    @classmethod
    def _load(cls, cfg: EngineConfig) -> "LazyEngine":
        source, dtype = resolve_model_source(cfg.model), config_dtype(cfg)
        cached = source.gguf_file is not None and cfg.model_cache
        name = source.name
        if cfg.adapter is not None:
            from lazyrag.tune.adapter import adapter_folder, apply_adapter

            name = f"{source.name}+{adapter_folder(cfg.adapter).name}"
            if not cached:  # merged here, in this process: the converted-model cache merges it once for every load
                if cfg.tensor_parallel_size > 1:
                    raise ValueError(
                        "An adapter is merged into the whole model at load, which tensor parallelism does not "
                        "hold in one process: merge it into a model folder first (peft's merge_and_unload, then "
                        "save_pretrained) and pass that folder as the model, or load a GGUF with the model "
                        "cache on (it caches the merged model, which every rank then reads its shard of)."
                    )
                hf_model, tokenizer = load_checkpoint(source, torch.float32)  # merged in float32, then cast once
                hf_model = apply_adapter(hf_model, cfg.adapter)
                return cls.from_hf(hf_model, tokenizer, model_name=name, config=cfg)
        if cfg.tensor_parallel_size == 1:
            if cached:
                config, tokenizer, state, fp = checkpoint_cache.load(source, dtype, adapter=cfg.adapter)
                return cls._assemble(config, tokenizer, state, fp, name, cfg)
            hf_model, tokenizer = load_checkpoint(source, dtype)
            return cls.from_hf(hf_model, tokenizer, model_name=name, config=cfg)
        config = load_config(source)
        args = LlamaArgs.from_hf(config)
        tp, workers = _join_group(args, cfg, (cls._load, (cfg,), {}))  # every rank joins, then all load their shards
        assert tp is not None  # tensor_parallel_size > 1: this process is in a group
        try:
            keep = lambda name, t: shard_tensor(name, t, args, tp)  # noqa: E731
            if cached:
                _, tokenizer, state, fp = checkpoint_cache.load(source, dtype, keep, adapter=cfg.adapter)
            else:
                tokenizer, state, fp = load_sharded(source, config, dtype, keep)
        except BaseException:
            import lazyrag.engine.tensor_parallel as tensor_parallel

            tensor_parallel.abandon_start(workers)
            raise
        return cls._assemble(config, tokenizer, state, fp, name, cfg, tp, workers)

    @classmethod
    def from_hf(
        cls,
        hf_model: PreTrainedModel,
        tokenizer: Any,
        model_name: str = "model",
        config: EngineConfig | None = None,
        **fields: Any,
    ) -> "LazyEngine":
        """Wrap an already-loaded transformers ``LlamaForCausalLM`` (its weights are copied). With
        ``tensor_parallel_size=N`` only under torchrun (every rank passes its own copy of the model)."""
        cfg = config.with_changes(**fields) if config is not None else EngineConfig(**fields)
        check_llama_config(hf_model.config)
        dtype = config_dtype(cfg)
        state = {k: v.detach().to(dtype) for k, v in hf_model.state_dict().items()}
        fp = fingerprint(hf_model.config, state, dtype)  # of the whole model: every rank's, and TP=1's
        if cfg.tensor_parallel_size > 1:
            import lazyrag.engine.tensor_parallel as tensor_parallel

            if not tensor_parallel.launched_by_torchrun():
                raise ValueError(
                    "from_hf cannot start tensor-parallel workers for a model already in memory (they load it "
                    "themselves): use LazyEngine.from_pretrained(path, tensor_parallel_size=N), or start every "
                    "rank with torchrun --nproc-per-node N."
                )
        args = LlamaArgs.from_hf(hf_model.config)
        tp, workers = _join_group(args, cfg)
        if tp is not None:
            state = shard_hf_state_dict(state, args, tp)
        return cls._assemble(hf_model.config, tokenizer, state, fp, model_name, cfg, tp, workers)

    @classmethod
    def _assemble(
        cls,
        hf_config: Any,
        tokenizer: Any,
        state: dict[str, torch.Tensor],
        fp: str,
        model_name: str,
        cfg: EngineConfig,
        tp: TensorParallel | None = None,
        workers: Sequence[subprocess.Popen[bytes]] = (),
    ) -> "LazyEngine":
        """The engine over ``state`` (transformers' names; under tensor parallelism this rank's shard)."""
        args = _rank_args(LlamaArgs.from_hf(hf_config), tp, cfg)
        device, dtype = config_device(cfg), config_dtype(cfg)
        with torch.device("meta"):
            model = LlamaModel(args, tp)
        # to_empty(device).to(dtype) in one step, with torch.empty: to_empty's empty_like of a meta tensor imports
        # sympy (0.5 s of a model load on 2 cores), and no float32 copy of the weights is made on the way
        model = model._apply(  # type: ignore[no-untyped-call]  # torch.nn.Module._apply has no annotations
            lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        )
        model.load_hf_state_dict(state)
        if model.args.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        return _attached(cls(model.eval(), hf_config, tokenizer, cfg, fp, model_name), tp, workers)

    @classmethod
    def from_config(cls, hf_config: Any, tokenizer: Any = None, seed: int = 0, **fields: Any) -> "LazyEngine":
        """Random weights for a Llama config: for benchmarks, where speed does not depend on values. With
        ``tensor_parallel_size=N`` each rank makes only its shard (the same seed on every rank, so the
        replicated weights agree); a 70B shape needs no checkpoint and no host copy of the whole model."""
        cfg = EngineConfig(**fields)
        check_llama_config(hf_config)
        args = LlamaArgs.from_hf(hf_config)
        tp, workers = _join_group(args, cfg, (cls.from_config, (hf_config, tokenizer, seed), fields))
        args = _rank_args(args, tp, cfg)
        torch.manual_seed(seed)
        with torch.device(config_device(cfg)):
            model = LlamaModel(args, tp).to(cfg.dtype)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
        return _attached(cls(model.eval(), hf_config, tokenizer, cfg, f"random-{seed}", "random"), tp, workers)

    def _end_tokens(self) -> set[int]:
        ids = set()
        tok = self.tokenizer
        if tok is not None:
            if tok.eos_token_id is not None:
                ids.add(tok.eos_token_id)
            vocab = tok.get_vocab()
            ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    @property
    def device(self) -> torch.device:
        return config_device(self.config)

    @property
    def dtype(self) -> torch.dtype:
        return config_dtype(self.config)

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.model.tp is None else self.model.tp.size

    # this process's scheduler, chunk cache and model runner, to read (benchmarks, metrics, tests)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def cache(self) -> CacheManager:
        return self.core.cache

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def attention_backend(self) -> str:
        return self.core.attention_backend

    def warm_up(self) -> None:
        """Run one tiny request (the prefix encoded and cached, the question prefilled over it as ``lazy`` reads
        cached KV, one decode step), then forget it: the engine is as it was (nothing cached, every block free, every
        counter zero), but each op has run once, so the first real request does not pay first-call costs (on CUDA:
        Triton compiles and graph captures; on 2 CPU cores it costs 0.25 s and changes little). Chunks are left out:
        one would bring the encoding passage's ~250 tokens, for no other op. Under tensor parallelism it does nothing
        (``TensorParallelCore.supports_warm_up``). Only for a new engine: it forgets everything the cache holds."""
        if not self.core.supports_warm_up or self.prompts is None:
            return
        if len(self.cache) or self.has_unfinished_requests():
            raise ValueError(
                "warm_up() is for a new engine (it empties the cache afterwards), and this one has cached "
                "KV or requests in flight: call it right after loading, or not at all."
            )
        layout = self.prompts.build("Hi?", [], None)  # not build_prompt: nothing joins the texts found in prompts
        RequestStream(self, self.add_request(layout, SamplingParams(max_new_tokens=2, ignore_eos=True))).result()
        with self._lock:
            self.core.forget()

    def health_problem(self) -> str | None:
        """Why this engine cannot answer (under tensor parallelism: a rank died), or None when it can."""
        return self.core.problem()

    def close(self) -> None:
        """Tensor parallelism: stop the other ranks (they exit). Later requests fail. One process: nothing to do."""
        self.core.close()

    @property
    def max_context(self) -> int:
        """Tokens of prompt plus answer the model takes."""
        return self.model.args.max_positions

    def kv_identity(self, system: str | None = None) -> KVIdentity:
        """What chunk KV computed by this engine (after ``system``'s prefix) depends on; a store must match it."""
        prompts = self.require_prompts()
        system = system or prompts.system_prompt
        return self.core.identity(self.model_name, system, prompts.prefix_ids(system), prompts.encoding_passage or "")

    # -- prompts --------------------------------------------------------------------------

    def require_prompts(self) -> PromptBuilder:
        """The engine's prompt builder; a clear error for an engine without a tokenizer."""
        if self.prompts is None:
            raise ValueError("This engine has no tokenizer; pass token ids through a PromptLayout instead.")
        return self.prompts

    def build_prompt(self, question: str, chunks: list[str], system: str | None = None) -> PromptLayout:
        """Token ids of each segment: shared prefix, each chunk (tokenized alone), question tail."""
        chunks = check_chunks(chunks)
        layout = self.require_prompts().build(
            check_text(question, "question"), chunks, None if system is None else check_text(system, "system")
        )
        self._check_length(layout.num_tokens)
        self.register_chunks(chunks)
        return layout

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of chat messages ({"role", "content"}) through the model's chat template."""
        return self.require_prompts().render(messages)

    def register_chunks(self, texts: Iterable[str]) -> None:
        """Make chunk texts findable inside free-form prompts (``layout_from_text``), e.g. retrieved nodes."""
        for text in texts:
            self.chunk_finder.add(text)

    def register_pasted(self, prompt: str | list[dict[str, Any]]) -> int:
        """Make the passages pasted into a prompt reusable, as if they had come as chunks: a raw prompt (its
        last paragraph, the question, left out) or chat messages (the paragraphs of user and system messages,
        but the question paragraph of the last user message and a system message's first, its instructions).
        From then on ``layout_from_text`` finds them in any prompt, in any order, and their KV is computed
        once. Returns how many passages the prompt held (known or new)."""
        if isinstance(prompt, str):
            passages = pasted_passages(prompt, keep_last=False)
        else:
            users = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
            last = users[-1] if users else -1
            passages = [
                p
                for i, m in enumerate(prompt)
                if m.get("role") in ("user", "system") and isinstance(m.get("content"), str)
                for p in pasted_passages(m["content"], keep_last=i != last)[m.get("role") == "system" :]
            ]
        # a paragraph around a chunk known already (a store's, say) would hide it: that chunk is reused as it is
        self.register_chunks(p for p in passages if not self.chunk_finder.find(p))
        return len(passages)

    def layout_from_text(self, text: str) -> PromptLayout:
        """Lay out a finished prompt (chat template applied), reusing every known chunk found in it.

        Known chunks (cached, pre-cached, registered or in an attached store) are found by their
        text, in time linear in the prompt's length. The text before the first is the request's
        prefix, the text after the last is computed in context like a question; non-blank
        text between chunks becomes a segment of its own (encoded once, cached by content),
        and blank text between them is the chunks' own separator. Chunks keep their KV
        encoded after the engine's shared encoding prefix, whatever the prompt's prefix is.
        """
        layout = self.require_prompts().split_text(check_text(text, "prompt"), self.chunk_finder.find(text))
        self._check_length(layout.num_tokens)
        return layout

    def _check_length(self, num_tokens: int, max_new_tokens: int = 0) -> None:
        if num_tokens + max_new_tokens > self.max_context:
            raise ValueError(
                f"The prompt has {num_tokens} tokens and asks for {max_new_tokens} more, over the model's "
                f"{self.max_context}-token context; pass fewer or shorter chunks, or lower max_new_tokens."
            )

    # -- chunk KV ahead of time, and stores -------------------------------------------------

    def encode_chunks(
        self, chunks: list[list[int]], prefix_ids: list[int] | None = None, read: bool = False
    ) -> tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Encode the chunks' KV (token ids, each after ``prefix_ids``, default the shared prefix) into the
        cache unless already there. Returns how many were new and, with ``read``, each segment's K/V
        ``[L, T, Hkv, D]`` on the CPU by content key (the prefix's included), as a store writes them."""
        prefix_ids = self.require_prompts().prefix_ids() if prefix_ids is None else prefix_ids
        prefix_ids, chunks = list(prefix_ids), [list(c) for c in chunks]
        with self._lock:
            return self.core.encode(prefix_ids, chunks, read)

    def chunk_key(self, chunk_ids: list[int], prefix_ids: list[int]) -> str:
        """The content key of a chunk's KV encoded after ``prefix_ids`` (what the cache and stores index by)."""
        return self.core.chunk_key(prefix_ids, chunk_ids)

    def precache(self, chunks: list[str], system: str | None = None) -> int:
        """Encode the chunks' KV now (after the shared prefix) so later prompts hit; returns how many were new."""
        layout = self.build_prompt("", chunks, system)
        return self.encode_chunks(layout.chunk_ids, layout.prefix_ids)[0]

    def attach_store(self, store: CorpusStore | str | Path) -> CorpusStore:
        """Serve chunk KV from a corpus store built by ``lazyrag precache``: misses load from disk, not
        recompute, and free-form prompts find the store's chunks. Attaching the same folder again is a no-op."""
        from lazyrag.store.corpus import CorpusStore

        folder = Path(store.path if isinstance(store, CorpusStore) else store).expanduser().resolve()
        attached = self.core.attached(folder)
        if attached is not None:
            return attached
        store = self.core.attach(store if isinstance(store, CorpusStore) else folder, self.kv_identity())
        self.register_chunks(store.chunk_texts())  # rows that fail their check are logged, their KV recomputed
        return store

    def cache_report(self) -> dict[str, Any]:
        """The chunk cache made visible: per tier (``"device"`` pool, then host, disk and attached corpus stores,
        in lookup order) its entries, bytes, hits, misses, hit rate and evictions; the overall hit rate; and
        ``reuse``: hits and tokens served for prefix segments vs chunks (``CacheManager.report``)."""
        return self.core.cache.report()

    # -- requests: every generation goes through the continuous-batching scheduler --------

    def add_request(
        self,
        layout: PromptLayout,
        params: SamplingParams,
        *,
        arrival: float | None = None,
        prompt_logits_only: bool = False,
        notify: Callable[[], object] | None = None,
    ) -> Request:
        """Queue a request for the scheduler (vLLM's ``add_request``); ``step`` runs it. Any thread.

        Everything about the request is checked here, so a bad one fails alone before it joins a batch.
        ``arrival`` (on ``scheduler.clock``) is when the request arrived, for TTFT; default now.
        ``notify`` is called from the stepping thread whenever the request has new output or ends.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a lazyrag.SamplingParams; got {type(params).__name__}.")
        check_layout(layout, self.model.args.vocab_size)
        self._check_length(layout.num_tokens, 0 if prompt_logits_only else params.max_new_tokens)
        req = Request(
            layout,
            self.core.seeded(params),
            arrival=self.core.now() if arrival is None else arrival,
            prompt_logits_only=prompt_logits_only,
            notify=notify,
        )
        self.core.add(req)
        self._work.set()
        return req

    def submit(self, layout: PromptLayout, params: SamplingParams) -> RequestStream:
        """Queue a request and return its stream (iterate it, sync or async, then ``result()``)."""
        return RequestStream(self, self.add_request(layout, params))

    def step(self) -> bool:
        """One forward pass over the requests in flight (a batched prefill or a batched decode step)."""
        with self._lock:
            return self._step_locked()

    def _step_locked(self) -> bool:
        self._stepping_thread = threading.get_ident()
        try:
            return self.core.step()
        finally:
            self._stepping_thread = None

    def has_unfinished_requests(self) -> bool:
        return self.core.has_work()

    def _drive(self, req: Request) -> None:
        """Step the scheduler (which advances every request in flight) until ``req`` has output or is done.
        Thread-safe: requests from several threads are batched, whichever thread holds the lock steps them all."""
        while not (req.outputs or req.done):
            with self._lock:
                if req.outputs or req.done:  # another thread stepped while this one waited for the lock
                    return
                self._step_locked()

    def _abandon(self, req: Request, wait: bool = True) -> None:
        """The caller stopped listening: give the request's blocks and pins back now (``wait=False``:
        at the driver thread's next step, without waiting for the lock)."""
        if not req.done:
            self.core.abort(req)
            self._work.set()
            if not wait or self._stepping_thread == threading.get_ident():
                # the next step drops it (the driver's, for an event loop that must not block; or this thread's own)
                return
            with self._lock:
                self.core.drop_aborted()

    # asyncio: a background thread steps the scheduler; coroutines wait on their request

    def _ensure_driver(self) -> None:
        with self._driver_lock:
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive_forever, name="lazyrag-scheduler", daemon=True)
                self._driver.start()

    def _drive_forever(self) -> None:
        while True:
            busy = self.step()  # never raises for a request's fault: the scheduler fails that request alone
            if not busy:
                self._work.clear()
                if not self.has_unfinished_requests():
                    self._work.wait()

    # -- the front door -------------------------------------------------------------------

    def _params(self, params: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
        if params is not None and sampling:
            raise ValueError(f"pass either params= or sampling keywords ({', '.join(sampling)}), not both")
        return params if params is not None else SamplingParams(**sampling)

    def generate(
        self,
        question: str,
        chunks: list[str],
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        **sampling: Any,
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks``; each chunk's KV is reused from the cache when it was seen before.
        ``sampling``: SamplingParams fields (max_new_tokens, temperature, top_p, stop, seed, strategy, ...)."""
        return self.submit(self.build_prompt(question, chunks, system), self._params(params, sampling)).result()

    def stream(
        self,
        question: str,
        chunks: list[str],
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        **sampling: Any,
    ) -> RequestStream:
        """``generate``, streamed: iterate the returned stream for text deltas (then ``.result()`` for stats)."""
        return self.submit(self.build_prompt(question, chunks, system), self._params(params, sampling))

    async def agenerate(
        self,
        question: str,
        chunks: list[str],
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        **sampling: Any,
    ) -> GenerationResult:
        """``generate`` for asyncio: awaiting many at once batches them on the device."""
        return await self.stream(question, chunks, params, system=system, **sampling).aresult()

    def astream(
        self,
        question: str,
        chunks: list[str],
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        **sampling: Any,
    ) -> RequestStream:
        """``stream`` for asyncio: ``async for delta in engine.astream(...)``."""
        return self.stream(question, chunks, params, system=system, **sampling)

    def layout_logits(self, layout: PromptLayout, strategy: str = "lazy") -> torch.Tensor:
        """Logits ``[V]`` (fp32, CPU) of the token after the prompt."""
        req = self.add_request(layout, SamplingParams(max_new_tokens=1, strategy=strategy), prompt_logits_only=True)
        RequestStream(self, req).result()  # raises the request's error, if any
        assert req.prompt_logits is not None  # set as the request finished (it ran to its end: nothing aborts it)
        return req.prompt_logits

    def next_token_logits(
        self, question: str, chunks: list[str], strategy: str = "lazy", system: str | None = None
    ) -> torch.Tensor:
        """Logits ``[V]`` (fp32, CPU) of the token after the prompt."""
        return self.layout_logits(self.build_prompt(question, chunks, system), strategy)
