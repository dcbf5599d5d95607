"""The request path: front door (engine.py), requests (request.py), continuous batching (scheduler.py),
KV reuse planning (reuse.py), the model runner (runner.py, cuda_graphs.py) and CacheBlend (blend.py)."""

from lazyrag.engine.config import EngineConfig, SchedulerConfig
from lazyrag.engine.engine import LazyEngine, RequestStream
from lazyrag.engine.request import GenerationResult, Request, RequestStats, SamplingParams

__all__ = [
    "EngineConfig",
    "SchedulerConfig",
    "LazyEngine",
    "RequestStream",
    "GenerationResult",
    "Request",
    "RequestStats",
    "SamplingParams",
]
