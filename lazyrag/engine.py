"""LazyEngine: load a Llama model, lay out RAG prompts, and generate with reusable chunk KV."""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, Iterator

import torch

from lazyrag.kv.block_pool import BlockPool, KVShape
from lazyrag.kv.cache import CacheConfig, SegmentCache
from lazyrag.kv.strategies import STRATEGIES, LazyStitching, Plan, Strategy, lazy_options
from lazyrag.model.attention import make_attention_backend
from lazyrag.model.llama import LlamaArgs, LlamaModel, build_rope
from lazyrag.model.loader import check_llama_config, fingerprint, load_checkpoint, resolve_model_source
from lazyrag.model.runner import ModelRunner
from lazyrag.prompt import (DEFAULT_SYSTEM_PROMPT, ChunkFinder, PromptBuilder, PromptLayout, check_chunks, check_layout,
                            check_text)
from lazyrag.sampling import SamplingParams
from lazyrag.scheduler import GenerationResult, Request, RequestStats, Scheduler, SchedulerConfig  # noqa: F401  (re-exported)

DEFAULT_KV_BUDGET = {"cpu": 1 << 30, "cuda": 8 << 30}
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>")


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError("dtype must be one of float32, bfloat16, float16")
    return dtype


class LazyEngine:
    """One model, one paged KV pool, one cache of position-free chunk KV, four strategies."""

    def __init__(
        self,
        model: LlamaModel,
        config,
        tokenizer,
        *,
        device: torch.device,
        dtype: torch.dtype,
        model_fingerprint: str,
        block_size: int = 16,
        kv_budget: int | None = None,
        attention: str | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        model_name: str = "model",
        cuda_graphs: bool | None = None,
        compile_elementwise: bool | None = None,
        scheduler_config: SchedulerConfig | None = None,
        cache_config: CacheConfig | None = None,
    ):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.device, self.dtype, self.fingerprint, self.model_name = device, dtype, model_fingerprint, model_name
        args = model.args
        shape = KVShape(args.num_layers, args.num_kv_heads, args.head_dim, block_size, dtype)
        budget = kv_budget if kv_budget is not None else DEFAULT_KV_BUDGET.get(device.type, 1 << 30)
        self.pool = BlockPool.with_budget(shape, budget, device)
        self.cache = SegmentCache(self.pool, cache_config)
        rope_cos, rope_sin, rope_scaling = build_rope(config, device)
        self.attention = make_attention_backend(attention, device)
        self.runner = ModelRunner(model, self.pool, self.attention, rope_cos, rope_sin, rope_scaling)
        if compile_elementwise is None:
            compile_elementwise = device.type == "cuda"
        if compile_elementwise:
            self.runner.compile_elementwise()
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda" and self.attention.name == "triton"
        if cuda_graphs:
            # padding tokens of captured shapes write their K/V here; no sequence reads it
            self.runner.enable_cuda_graphs(scratch_block=self.pool.allocate(1)[0])
        self.strategies: dict[str, Strategy] = {n: cls(self.cache, self.runner, model_fingerprint) for n, cls in STRATEGIES.items()}
        self.prompts = PromptBuilder(tokenizer, system_prompt) if tokenizer is not None else None
        self.chunk_finder = ChunkFinder()  # texts of known chunks, to find them inside free-form prompts
        self._eos = self._end_tokens()
        self.scheduler = Scheduler(self.runner, tokenizer, self._eos, scheduler_config)
        self._lock = threading.Lock()  # held by whichever thread steps the scheduler (or touches the cache)
        self._work = threading.Event()  # set when a request arrives, for the asyncio driver thread
        self._driver: threading.Thread | None = None
        self._driver_lock = threading.Lock()
        self._stepping_thread: int | None = None  # ident of the thread inside ``step``, if any

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model: str | None = None, device=None, dtype=None, **kwargs) -> "LazyEngine":
        """Load the embedded default model (``model=None``), a local Llama folder, or a ``.gguf`` file."""
        device = _resolve_device(device)
        dtype = _resolve_dtype(dtype, device)
        source = resolve_model_source(model)
        hf_model, tokenizer = load_checkpoint(source, dtype)
        kwargs.setdefault("model_name", source.name)
        return cls.from_hf(hf_model, tokenizer, device=device, dtype=dtype, **kwargs)

    @classmethod
    def from_hf(cls, hf_model, tokenizer, device=None, dtype=None, **kwargs) -> "LazyEngine":
        """Wrap an already-loaded transformers ``LlamaForCausalLM`` (its weights are copied)."""
        device = _resolve_device(device)
        dtype = _resolve_dtype(dtype, device)
        check_llama_config(hf_model.config)
        sd = {k: v.detach().to(dtype) for k, v in hf_model.state_dict().items()}
        return cls._from_state_dict(hf_model.config, sd, tokenizer, device, dtype, **kwargs)

    @classmethod
    def from_config(cls, config, tokenizer=None, device=None, dtype=None, seed: int = 0, **kwargs) -> "LazyEngine":
        """Random weights for a Llama config: for benchmarks, where speed does not depend on values."""
        device = _resolve_device(device)
        dtype = _resolve_dtype(dtype, device)
        check_llama_config(config)
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaModel(LlamaArgs.from_hf(config)).to(dtype)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
        return cls(model.eval(), config, tokenizer, device=device, dtype=dtype, model_fingerprint=f"random-{seed}", **kwargs)

    @classmethod
    def _from_state_dict(cls, config, state_dict, tokenizer, device, dtype, **kwargs) -> "LazyEngine":
        fp = fingerprint(config, state_dict, dtype)
        with torch.device("meta"):
            model = LlamaModel(LlamaArgs.from_hf(config))
        model = model.to_empty(device=device).to(dtype)
        model.load_hf_state_dict({k: v.to(dtype) for k, v in state_dict.items()})
        if model.args.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        return cls(model.eval(), config, tokenizer, device=device, dtype=dtype, model_fingerprint=fp, **kwargs)

    def _end_tokens(self) -> set[int]:
        ids = set()
        tok = self.tokenizer
        if tok is not None:
            if tok.eos_token_id is not None:
                ids.add(tok.eos_token_id)
            vocab = tok.get_vocab()
            ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
        eos = getattr(self.config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    # -- prompts --------------------------------------------------------------------------

    def build_prompt(self, question: str, chunks: list[str], system: str | None = None) -> PromptLayout:
        """Token ids of each segment: shared prefix, each chunk (tokenized alone), question tail."""
        if self.prompts is None:
            raise ValueError("This engine has no tokenizer; pass token ids through a PromptLayout instead.")
        chunks = check_chunks(chunks)
        layout = self.prompts.build(check_text(question, "question"), chunks,
                                    None if system is None else check_text(system, "system"))
        self._check_length(layout.num_tokens)
        for text in chunks:
            self.chunk_finder.add(text)
        return layout

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text of chat messages ({"role", "content"}) through the model's chat template."""
        return self.prompts.render(messages)

    def layout_from_text(self, text: str) -> PromptLayout:
        """Lay out a finished prompt (chat template applied), reusing every known chunk found in it.

        Known chunks (cached, pre-cached or in an attached store) are found by their text,
        in time linear in the prompt's length. The text before the first is the request's
        prefix, the text after the last is computed in context like a question; non-blank
        text between chunks becomes a segment of its own (encoded once, cached by content),
        and blank text between them is the chunks' own separator. Chunks keep their KV
        encoded after the engine's shared encoding prefix, whatever the prompt's prefix is.
        """
        if self.prompts is None:
            raise ValueError("This engine has no tokenizer; pass token ids through a PromptLayout instead.")
        layout = self.prompts.split_text(check_text(text, "prompt"), self.chunk_finder.find(text))
        self._check_length(layout.num_tokens)
        return layout

    def _check_length(self, num_tokens: int, max_new_tokens: int = 0) -> None:
        limit = self.model.args.max_positions
        if num_tokens + max_new_tokens > limit:
            raise ValueError(
                f"The prompt has {num_tokens} tokens and asks for {max_new_tokens} more, over the model's "
                f"{limit}-token context; pass fewer or shorter chunks, or lower max_new_tokens."
            )

    # -- generation -----------------------------------------------------------------------

    def _strategy(self, name: str) -> Strategy:
        """A strategy by name; ``lazy:first=K`` is lazy with each chunk's first K tokens recomputed in context,
        ``lazy:blend=R`` with the fraction R of chunk tokens that deviate most (CacheBlend); see ``lazy_options``."""
        if name not in self.strategies and name.startswith("lazy:"):
            self.strategies[name] = LazyStitching(self.cache, self.runner, self.fingerprint, **lazy_options(name))
        if name not in self.strategies:
            raise ValueError(f"Unknown strategy {name!r}; choose one of {', '.join(self.strategies)} (or lazy:first=K, lazy:blend=R).")
        return self.strategies[name]

    def precache(self, chunks: list[str], system: str | None = None) -> int:
        """Encode the chunks' KV now (after the shared prefix) so later prompts hit; returns how many were new."""
        layout = self.build_prompt("", chunks, system)
        with self._lock:
            strategy = self.strategies["lazy"]
            plan = Plan(context=[], new_ids=[], new_start=0)
            try:
                strategy.base_segments(layout, plan)
            finally:
                strategy.release(plan)
            return plan.chunks_missed

    def attach_store(self, store):
        """Serve chunk KV from a corpus store built by ``lazyrag precache``: misses load from disk, not recompute."""
        from lazyrag.store import attach_store

        store = attach_store(self, store)
        for row in store.rows():  # so free-form prompts (LlamaIndex, LangChain) find the store's chunks
            if row.text:
                self.chunk_finder.add(row.text)
        return store

    # -- requests: every generation goes through the continuous-batching scheduler --------

    def add_request(self, layout: PromptLayout, params: SamplingParams, strategy: str = "lazy", *,
                    arrival: float | None = None, prompt_logits_only: bool = False, notify=None) -> Request:
        """Queue a request for the scheduler (vLLM's ``add_request``); ``step`` runs it. Any thread.

        ``arrival`` (on ``scheduler.clock``) is when the request arrived, for TTFT; default now.
        ``notify`` is called from the stepping thread whenever the request has new output or ends.
        """
        strat = self._strategy(strategy)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a lazyrag.sampling.SamplingParams; got {type(params).__name__}.")
        check_layout(layout, self.model.args.vocab_size)
        self._check_length(layout.num_tokens, 0 if prompt_logits_only else params.max_new_tokens)
        req = Request(layout, params, strat, arrival=self.scheduler.clock() if arrival is None else arrival,
                      prompt_logits_only=prompt_logits_only, notify=notify)
        self.scheduler.add(req)
        self._work.set()
        return req

    def step(self) -> bool:
        """One forward pass over the requests in flight (a batched prefill or a batched decode step)."""
        with self._lock:
            return self._step_locked()

    def _step_locked(self) -> bool:
        self._stepping_thread = threading.get_ident()
        try:
            return self.scheduler.step()
        finally:
            self._stepping_thread = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def _drive(self, req: Request) -> None:
        """Step the scheduler (which advances every request in flight) until ``req`` has output or is done."""
        while not (req.outputs or req.done):
            with self._lock:
                if req.outputs or req.done:  # another thread stepped while this one waited for the lock
                    return
                self._step_locked()

    def _abandon(self, req: Request) -> None:
        """The caller stopped listening: give the request's blocks and pins back now."""
        if not req.done:
            self.scheduler.abort(req)
            self._work.set()
            if self._stepping_thread == threading.get_ident():
                return  # a finalizer inside this thread's own step: that step drops it
            with self._lock:
                self.scheduler.drop_aborted()

    def stream_layout(self, layout: PromptLayout, params: SamplingParams, strategy: str = "lazy") -> Iterator[tuple[str, int]]:
        """Yields (text delta, token id) per generated token; returns a GenerationResult (StopIteration.value).

        Thread-safe: requests from several threads are batched together, whichever thread
        holds the engine's lock steps them all.
        """
        req = self.add_request(layout, params, strategy)
        try:
            while True:
                self._drive(req)
                while req.outputs:
                    yield req.outputs.popleft()
                if req.done and not req.outputs:
                    return req.result()
        finally:
            self._abandon(req)

    def generate_layout(self, layout: PromptLayout, params: SamplingParams, strategy: str = "lazy") -> GenerationResult:
        it = self.stream_layout(layout, params, strategy)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value

    def layout_logits(self, layout: PromptLayout, strategy: str = "lazy") -> torch.Tensor:
        """Logits ``[V]`` (fp32, CPU) of the token after the prompt."""
        req = self.add_request(layout, SamplingParams(max_new_tokens=1), strategy, prompt_logits_only=True)
        try:
            self._drive(req)
        finally:
            self._abandon(req)
        req.result()  # raises the request's error, if any
        return req.prompt_logits

    # -- asyncio: a background thread steps the scheduler; coroutines wait on their request --

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
                if not self.scheduler.has_work():
                    self._work.wait()

    async def astream_layout(self, layout: PromptLayout, params: SamplingParams, strategy: str = "lazy",
                             on_finish: Callable[[GenerationResult], None] | None = None) -> AsyncIterator[tuple[str, int]]:
        """Async (text delta, token id) events of one request; concurrent requests are batched together.
        ``on_finish`` receives the GenerationResult (stats, finish reason) after the last event."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        req = self.add_request(layout, params, strategy, notify=lambda: loop.call_soon_threadsafe(ready.set))
        self._ensure_driver()
        try:
            while True:
                await ready.wait()
                ready.clear()
                while req.outputs:
                    yield req.outputs.popleft()
                if req.done and not req.outputs:
                    break
            result = req.result()  # raises the request's error, if any
        finally:
            self._abandon(req)
        if on_finish is not None:
            on_finish(result)

    async def agenerate_layout(self, layout: PromptLayout, params: SamplingParams, strategy: str = "lazy") -> GenerationResult:
        done: list[GenerationResult] = []
        async for _ in self.astream_layout(layout, params, strategy, on_finish=done.append):
            pass
        return done[0]

    async def agenerate(self, question: str, chunks: list[str], max_new_tokens: int = 128, temperature: float = 0.0,
                        top_p: float = 1.0, stop: list[str] | None = None, strategy: str = "lazy",
                        system: str | None = None, seed: int | None = None) -> GenerationResult:
        """``generate`` for asyncio: awaiting many at once batches them on the GPU."""
        layout = self.build_prompt(question, chunks, system)
        return await self.agenerate_layout(layout, SamplingParams(max_new_tokens, temperature, top_p, stop, seed), strategy)

    async def astream(self, question: str, chunks: list[str], max_new_tokens: int = 128, temperature: float = 0.0,
                      top_p: float = 1.0, stop: list[str] | None = None, strategy: str = "lazy",
                      system: str | None = None, seed: int | None = None) -> AsyncIterator[str]:
        """``stream`` for asyncio."""
        layout = self.build_prompt(question, chunks, system)
        async for delta, _ in self.astream_layout(layout, SamplingParams(max_new_tokens, temperature, top_p, stop, seed), strategy):
            if delta:
                yield delta

    def generate(
        self,
        question: str,
        chunks: list[str],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        strategy: str = "lazy",
        system: str | None = None,
        seed: int | None = None,
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks``; each chunk's KV is reused from the cache when it was seen before."""
        layout = self.build_prompt(question, chunks, system)
        return self.generate_layout(layout, SamplingParams(max_new_tokens, temperature, top_p, stop, seed), strategy)

    def stream(
        self,
        question: str,
        chunks: list[str],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        strategy: str = "lazy",
        system: str | None = None,
        seed: int | None = None,
    ) -> Iterator[str]:
        """Yield the answer's text as it is generated."""
        layout = self.build_prompt(question, chunks, system)
        for delta, _ in self.stream_layout(layout, SamplingParams(max_new_tokens, temperature, top_p, stop, seed), strategy):
            if delta:
                yield delta

    def next_token_logits(self, question: str, chunks: list[str], strategy: str = "lazy", system: str | None = None) -> torch.Tensor:
        """Logits ``[V]`` (fp32, CPU) of the token after the prompt."""
        return self.layout_logits(self.build_prompt(question, chunks, system), strategy)
