"""lazyrag: RAG with reusable, position-free KV caches.

Each retrieved chunk's KV cache is computed once, stored once, and reused at any position
of any prompt; the positional rotation (RoPE) for its actual place is applied lazily inside
the attention kernels.
"""

from __future__ import annotations

from lazyrag.version import __version__  # noqa: F401

_PUBLIC = ("LazyEngine", "EngineConfig", "SamplingParams", "SchedulerConfig", "GenerationResult")


def get_engine(model: str | None = None, device=None, dtype=None, kv_budget: int | None = None):
    """The process's one engine for ``model`` (None: the embedded default) on ``device``: loaded on the first call,
    the same object after. The LlamaIndex and LangChain adapters use it too, so chunks cached through one are hits
    for the others. ``kv_budget`` (bytes) applies to the first load only."""
    from lazyrag.integrations._common import shared_engine

    return shared_engine(model, device, dtype, kv_budget)


def __getattr__(name):
    # `from lazyrag import LazyEngine` without importing torch at `import lazyrag` time (the CLI's --help stays fast)
    if name in _PUBLIC:
        import lazyrag.engine

        return getattr(lazyrag.engine, name)
    raise AttributeError(name)
