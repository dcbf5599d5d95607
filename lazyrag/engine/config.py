"""One configuration for an engine: which model, where, how much KV memory, and how requests are batched."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lazyrag.kv.cache import CacheConfig
from lazyrag.model.checkpoint_cache import cache_enabled
from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE, DEFAULT_SYSTEM_PROMPT
from lazyrag.sizes import parse_bytes

DEFAULT_KV_BUDGET = {"cpu": 1 << 30, "cuda": 8 << 30}


@dataclass
class SchedulerConfig:
    max_running: int = 64  # sequences in flight (decoding) at once
    max_prefill_tokens: int = 8192  # new tokens in one prefill batch (a longer single prompt still runs alone)
    # a prompt with more new tokens is prefilled in pieces of this many, one piece a step (vLLM's chunked prefill),
    # so that an abort lands between pieces instead of after the whole prompt; None: 8192 on cuda, 2048 on cpu
    long_prefill_tokens: int | None = None
    # the chunks that a step's requests miss are encoded together, in one batched forward before the step's prefill
    # (the cache changes as if each request encoded its own); False: each request encodes its misses as it is planned
    batch_encodes: bool = True
    # launch each greedy decode step on the previous step's tokens while they are still on the device, so the
    # host's work overlaps the device's (vLLM's async scheduling); None: on with cuda
    async_scheduling: bool | None = None
    # the chunks of the next this-many waiting requests are promoted from the host or disk tier ahead of their
    # planning, in the background (on cuda, on a copy stream of its own: the copies overlap the step's forward);
    # None: 4 on cuda without tensor parallelism (its ranks must plan over the same cache), else 0
    prefetch_waiting: int | None = None


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct; or a local Llama folder or .gguf file
    adapter: str | None = None  # a LoRA adapter folder (``lazyrag tune``) merged at load; "embedded": the shipped one
    # a GGUF model is converted once into a cache folder and loaded from it afterwards (model/checkpoint_cache.py);
    # None: on, unless the environment has LAZYRAG_MODEL_CACHE=0
    model_cache: bool | None = None
    device: str | torch.device | None = None  # None: cuda when available, else cpu
    dtype: str | torch.dtype | None = None  # None: bfloat16 on cuda, float32 on cpu
    kv_budget: int | str | None = (
        None  # bytes of the paged KV pool ("4GiB", "512MB" too); None: 8 GiB on cuda, 1 GiB on cpu
    )
    block_size: int = 16  # tokens per KV block
    attention: str | None = None  # "triton" | "torch"; None: triton on cuda, torch on cpu
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    # text every chunk is encoded after, past the prompt's prefix, so its KV is computed as if another document came
    # first (prompt.py); part of every chunk's cache key and of a store's identity. None: chunks follow the prefix alone
    encoding_passage: str | None = DEFAULT_ENCODING_PASSAGE
    cuda_graphs: bool | None = None  # None: on with cuda + triton
    compile_elementwise: bool | None = None  # None: on with cuda
    # norms and silu*up as Triton kernels (kernels/elementwise.py), replacing the compiled ones; None: on with cuda +
    # triton
    triton_elementwise: bool | None = None
    fused_kv_store: bool | None = None  # q/k rotation and the K/V pool write in one Triton kernel; None: on with triton
    # torch's BLAS library for short prefills (<= 512 tokens, e.g. a question over cached documents): "cublaslt" |
    # "cublas"; None: cuBLASLt on cuda (measured faster at 64 tokens), torch's own choice elsewhere
    short_prefill_blas: str | None = None
    gemv: bool | None = (
        None  # one-token projections as Triton GEMVs, the norm / silu*up folded in; None: on with cuda + triton
    )
    skinny_gemm: bool | None = (
        None  # 2-64 token projections as Triton skinny GEMMs (kernels/gemm.py); None: off until measured
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # one model across N processes (engine/tensor_parallel.py): heads and MLP columns split, an all-reduce per
    # row-parallel layer; from_pretrained starts the N - 1 workers itself unless torchrun launched them
    tensor_parallel_size: int = 1
    # bound on every collective (and on the workers' wait for the next command): a dead rank fails requests
    # within it instead of hanging them; the driver pings the workers at a quarter of it when idle
    tensor_parallel_timeout_s: float = 60.0
    # the fields left None (resolved below): ``with_changes`` resolves them again
    defaulted: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.adapter is not None and str(self.adapter).lower() == "none":
            self.adapter = None
        self.defaulted = tuple(f for f in _RESOLVED if getattr(self, f) is None) + tuple(
            f for f in _RESOLVED_SCHEDULER if getattr(self.scheduler, f) is None
        )
        self.device = (
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if self.device is None
            else torch.device(self.device)
        )
        on_cuda = self.device.type == "cuda"
        self._resolve_dtype(on_cuda)
        if self.kv_budget is None:
            self.kv_budget = DEFAULT_KV_BUDGET.get(self.device.type, 1 << 30)
        elif isinstance(self.kv_budget, str):  # "4GiB", "512MB"
            self.kv_budget = parse_bytes(self.kv_budget, "kv_budget")
        if self.model_cache is None:
            self.model_cache = cache_enabled()
        self._check_sizes()
        # every other None resolved here, once: the engine reads the settings as they are
        self._resolve_kernels(on_cuda)
        self._resolve_scheduler(on_cuda)

    def _resolve_dtype(self, on_cuda: bool) -> None:
        """``dtype``: the device's default for None, the torch dtype for a name."""
        if self.dtype is None:
            self.dtype = torch.bfloat16 if on_cuda else torch.float32
        elif isinstance(self.dtype, str):
            dtype = getattr(torch, self.dtype.replace("torch.", ""), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {self.dtype!r}")
            self.dtype = dtype

    def _check_sizes(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1; got {self.block_size}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer of at least 1; got {self.tensor_parallel_size!r}"
            )
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s must be positive; got {self.tensor_parallel_timeout_s!r}")

    def _resolve_kernels(self, on_cuda: bool) -> None:
        """The attention backend and the kernel switches left None: the device's defaults."""
        if self.attention is None:
            self.attention = "triton" if on_cuda else "torch"
        triton_on_cuda = on_cuda and self.attention == "triton"
        defaults = {
            "compile_elementwise": on_cuda,
            "triton_elementwise": triton_on_cuda,
            "gemv": triton_on_cuda,
            "cuda_graphs": triton_on_cuda,
            "skinny_gemm": False,
            # where the model's head_dim allows it (the engine checks: head_dim / 2 a power of two, >= 8)
            "fused_kv_store": self.attention == "triton",
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.short_prefill_blas = (self.short_prefill_blas or "cublaslt") if on_cuda else None

    def _resolve_scheduler(self, on_cuda: bool) -> None:
        """The scheduler's fields left None: the device's defaults; then its long_prefill_tokens checked."""
        if self.scheduler.async_scheduling is None:
            self.scheduler = replace(self.scheduler, async_scheduling=on_cuda)
        if self.scheduler.long_prefill_tokens is None:
            self.scheduler = replace(self.scheduler, long_prefill_tokens=8192 if on_cuda else 2048)
        if self.scheduler.prefetch_waiting is None:
            self.scheduler = replace(
                self.scheduler, prefetch_waiting=4 if on_cuda and self.tensor_parallel_size == 1 else 0
            )
        long_prefill_tokens = self.scheduler.long_prefill_tokens
        if long_prefill_tokens is not None and long_prefill_tokens < 1:  # None: resolved just above, never left
            raise ValueError(f"long_prefill_tokens must be at least 1; got {long_prefill_tokens}")

    def with_changes(self, **fields: Any) -> "EngineConfig":
        """A copy with ``fields`` changed and the defaults it took resolved again (another device changes them)."""
        again: dict[str, Any] = {f: None for f in self.defaulted if f not in _RESOLVED_SCHEDULER and f not in fields}
        scheduler_again: dict[str, Any] = {f: None for f in self.defaulted if f in _RESOLVED_SCHEDULER}
        if scheduler_again and "scheduler" not in fields:
            again["scheduler"] = replace(self.scheduler, **scheduler_again)
        return replace(self, **again, **fields)


# EngineConfig's fields whose None means "the default for this device", resolved in __post_init__
_RESOLVED = (
    "device",
    "dtype",
    "kv_budget",
    "model_cache",
    "attention",
    "compile_elementwise",
    "triton_elementwise",
    "gemv",
    "cuda_graphs",
    "skinny_gemm",
    "fused_kv_store",
    "short_prefill_blas",
)
# SchedulerConfig's fields whose None means "the default for this device", likewise
_RESOLVED_SCHEDULER = ("async_scheduling", "long_prefill_tokens", "prefetch_waiting")
