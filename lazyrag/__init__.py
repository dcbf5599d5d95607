"""lazyrag: RAG with reusable, position-free KV caches.

Each retrieved chunk's KV cache is computed once, stored once, and reused at any position
of any prompt; the positional rotation (RoPE) for its actual place is applied lazily inside
the attention kernels.
"""
__version__ = "0.2.0"  # CHANGELOG.md says what each version changed


_PUBLIC = ("LazyEngine", "EngineConfig", "SamplingParams", "SchedulerConfig", "GenerationResult")


def __getattr__(name):
    # `from lazyrag import LazyEngine` without importing torch at `import lazyrag` time (the CLI's --help stays fast)
    if name in _PUBLIC:
        import lazyrag.engine

        return getattr(lazyrag.engine, name)
    raise AttributeError(name)
