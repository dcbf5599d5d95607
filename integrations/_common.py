"""What the LlamaIndex and LangChain adapters share: one engine per model, stores, retrievers, and
the two ways a request reaches the engine.

* A free-form prompt (a framework formatted it: LlamaIndex templates, LangChain messages) goes
  through ``engine.layout_from_text``, which finds the known chunks inside it by their text.
* A fast path (our retrievers, ``LazyRAG``) hands the chunk texts straight to
  ``engine.build_prompt``: no string search.
"""

from __future__ import annotations

import asyncio
import difflib
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from lazyrag.defaults import MAX_K, MAX_LOGPROBS, MIN_TOP_P, SEED_LIMIT

if TYPE_CHECKING:  # torch is imported only when an engine is really needed
    from lazyrag.engine import GenerationResult, LazyEngine, RequestStream
    from lazyrag.store.build import PrecacheReport
    from lazyrag.store.corpus import CorpusStore
    from lazyrag.store.retriever import Retriever

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_lock = threading.Lock()
_engines: dict[tuple, "LazyEngine"] = {}
_embedders: dict[str, object] = {}
_retrievers: dict[tuple, "Retriever"] = {}
_stores: dict[Path, "CorpusStore"] = {}


def model_name(model: str | None) -> str:
    """A display name without loading anything (LangSmith params, LlamaIndex metadata before load)."""
    return Path(model).name if model else DEFAULT_MODEL_NAME


def _engine_key(model: str | None, device, dtype) -> tuple:
    from lazyrag.engine import EngineConfig

    cfg = EngineConfig(device=device, dtype=dtype)  # resolves the defaults (cuda if present, its dtype)
    return (str(Path(model).expanduser().resolve()) if model else None, str(cfg.device), str(cfg.dtype))


def shared_engine(model: str | None = None, device=None, dtype=None, kv_budget: int | None = None) -> "LazyEngine":
    """One engine per (model, device, dtype) in a process, so every adapter instance shares one
    model load and one chunk cache (chunks cached through LangChain hit in LlamaIndex too).
    ``kv_budget`` sets the pool when the engine is first loaded; asking a loaded one for another raises."""
    key = _engine_key(model, device, dtype)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            from lazyrag.engine import LazyEngine

            kw: dict[str, Any] = {"kv_budget": kv_budget} if kv_budget else {}  # EngineConfig's fields
            engine = _engines[key] = LazyEngine.from_pretrained(model, device=device, dtype=dtype, **kw)
        elif kv_budget and kv_budget != engine.config.kv_budget:
            raise ValueError(
                f"The shared engine for {model_name(model)} on {key[1]} is already loaded with kv_budget="
                f"{engine.config.kv_budget} bytes, and one process shares one engine (and its chunk cache) per model; "
                f"leave kv_budget unset here, or pass {engine.config.kv_budget}."
            )
        return engine


def register_engine(engine: "LazyEngine", model: str | None = None) -> None:
    """Make an already-loaded engine the shared one for ``model`` (e.g. the tests' session engine)."""
    with _lock:
        _engines[_engine_key(model, engine.device, engine.dtype)] = engine


def attach_store_once(engine: "LazyEngine", store) -> None:
    """Attach a corpus store (path) to the engine; attaching the same folder again does nothing.

    Raises lazyrag.store.StoreError for a missing or unfinished store and StoreMismatch for a
    store built for another model/dtype/prefix (messages say how to fix it)."""
    if store is not None:
        corpus = open_store(store)
        with _lock:
            engine.attach_store(corpus)


def open_store(store) -> "CorpusStore":
    """A store folder opened (manifest, table and FAISS index checked and read) once per process, for the
    engine's KV tier and the retrievers alike."""
    from lazyrag.store.corpus import CorpusStore

    path = Path(store).expanduser().resolve()
    with _lock:
        found = _stores.get(path)
    if found is None:
        found = CorpusStore.open(path)  # StoreError for a missing, unfinished or damaged store
        with _lock:
            found = _stores.setdefault(path, found)
    return found


def forget_store(store) -> None:
    """Drop this process's opened copy of a store folder and its retrievers, so the next open reads the
    generation a build just published (engines that attached the old copy keep it)."""
    path = Path(store).expanduser().resolve()
    with _lock:
        _stores.pop(path, None)
        for key in [k for k in _retrievers if k[0] == str(path)]:
            del _retrievers[key]


def precache_documents(
    documents: list, source: str, out, adapter_or_engine, options: dict, who: str
) -> "PrecacheReport":
    """The adapters' ``precache_store``: a framework's documents (``lazyrag.store.build.Document``, one per
    node / LangChain Document, in a stable order) into the corpus store at ``out``, as ``lazyrag precache``
    builds one; ``source`` names them in the manifest's ``sources``.

    ``options`` are PrecacheConfig's fields (chunk_tokens, overlap, chunks_per_shard, index, embedder, limit,
    system, progress, verify, overwrite, stored_kv_dtype); unknown ones raise TypeError. ``chunk_tokens``
    defaults to None here: every document stays one chunk, so its stored text is the text prompts show
    (``whole_document_chunk_tokens``). The KV is computed by ``adapter_or_engine`` (an adapter's engine, or
    the shared engine of the default model when None); a given one then has the store attached."""
    from lazyrag.store.build import PrecacheConfig, precache

    allowed = [f for f in PrecacheConfig.__dataclass_fields__ if f not in ("inputs", "out")]
    unknown = [k for k in options if k not in allowed]
    if unknown:
        hints = "".join(f"\n  {k}: {_did_you_mean(k, allowed, 'not a precache option.')}" for k in unknown)
        raise TypeError(
            f"{who}() got unknown option(s) {', '.join(map(repr, unknown))}.{hints}\nIt takes: {', '.join(allowed)}."
        )
    config = PrecacheConfig([source], str(out), **{"chunk_tokens": None, **options})
    engine = shared_engine() if adapter_or_engine is None else getattr(adapter_or_engine, "engine", adapter_or_engine)
    report = precache(engine, config, load_embedder(config.embedder), documents=documents)
    forget_store(out)  # a copy opened before this build serves the previous generation
    if adapter_or_engine is not None:
        attach_store_once(engine, out)
    return report


def load_embedder(name: str | None = None):
    """A sentence-transformers model, loaded once per process (default: the embedded all-MiniLM-L6-v2)."""
    from lazyrag.store.retriever import DEFAULT_EMBEDDER, load_embedder as load

    name = name or DEFAULT_EMBEDDER
    with _lock:
        if name not in _embedders:
            _embedders[name] = load(name)
        return _embedders[name]


def open_retriever(store, embedder: str | None = None) -> "Retriever":
    """lazyrag's Retriever over a store folder, opened once per (folder, embedder).

    Missing or unfinished stores raise lazyrag.store.StoreError (from CorpusStore.open); a
    finished store without a single chunk raises it here, since every query would return nothing."""
    from lazyrag.store.corpus import StoreError
    from lazyrag.store.retriever import Retriever, store_embedder

    path = Path(store).expanduser().resolve()
    key = (str(path), embedder)
    with _lock:
        found = _retrievers.get(key)
    if found is not None:
        return found
    corpus = open_store(path)
    if len(corpus) == 0:
        raise StoreError(
            f"The store at {path} holds no chunks, so there is nothing to retrieve; "
            "build it from a non-empty corpus with: lazyrag precache CORPUS --out STORE"
        )
    retriever = Retriever(corpus, load_embedder(store_embedder(corpus, embedder)))  # StoreError for a foreign embedder
    with _lock:
        return _retrievers.setdefault(key, retriever)


# -- learning chunks from any retriever ----------------------------------------------------------
# A framework prompt is a string; the engine finds the chunks it knows inside it. The adapters'
# retrieval hooks (LlamaIndex instrumentation, a LangChain callback handler) register what any
# retriever returns, so a stock vector store's chunks are found (and cached) from the 2nd prompt on.

_learning_engines: "weakref.WeakSet" = weakref.WeakSet()
_recently_retrieved: deque = deque(maxlen=4096)  # texts seen before an adapter loaded its engine


def learn_into(engine: "LazyEngine") -> None:
    """Register every chunk text retrieved from now on (and the recent ones) in ``engine``."""
    with _lock:
        _learning_engines.add(engine)
        pending = list(_recently_retrieved)
    engine.register_chunks(pending)


def learn_chunks(texts: Iterable[str]) -> None:
    """Chunk texts a retriever returned: registration only, the KV is encoded when a prompt first uses one."""
    texts = [t for t in texts if t]
    with _lock:
        _recently_retrieved.extend(texts)
        engines = list(_learning_engines)
    for engine in engines:
        engine.register_chunks(texts)


# -- constructor arguments ------------------------------------------------------------------------

# names other local-model adapters take that have no meaning here, and what to do instead
_NOT_HERE = {
    "device_map": "lazyrag runs the whole model on one device: pass device='cuda' or device='cpu'.",
    "tokenizer_name": "the tokenizer is read from the model folder or .gguf file.",
    "tokenizer": "the tokenizer is read from the model folder or .gguf file.",
    "model_kwargs": "pass dtype= (float32, bfloat16, float16) and device=; there are no other load options.",
    "tokenizer_kwargs": "the tokenizer is read from the model folder or .gguf file.",
    "pipeline_kwargs": "pass max_tokens/max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed and stop "
    "directly.",
}
_GENERATE_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_new_tokens", "do_sample", "stop")

# pydantic Field constraints of the adapters' numeric fields (``_adapter.AdapterFields`` and the adapters' own):
# what SamplingParams and the engine accept
SAMPLING_LIMITS = {
    "temperature": dict(ge=0.0, allow_inf_nan=False),
    "top_p": dict(ge=MIN_TOP_P, le=1.0, allow_inf_nan=False),
    "seed": dict(ge=0, lt=SEED_LIMIT),
    "top_k": dict(gt=0, le=MAX_K),
    "positive": dict(gt=0),
    "sampling_top_k": dict(ge=-1),
    "repetition_penalty": dict(gt=0.0, allow_inf_nan=False),
    "penalty": dict(ge=-2.0, le=2.0, allow_inf_nan=False),
    "top_logprobs": dict(ge=0, le=MAX_LOGPROBS),
}


def openai_logprobs(engine: "LazyEngine", logprobs) -> dict | None:
    """A result's logprobs (list of TokenLogprob, or None) in OpenAI's chat format, as ChatOpenAI reports them:
    ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``."""
    if logprobs is None:
        return None
    from lazyrag.engine.sampling import logprob_entries, openai_chat_logprobs

    return openai_chat_logprobs(logprob_entries(engine.tokenizer, logprobs))


def check_top_k(k, name: str = "similarity_top_k") -> int:
    """A retriever adapter's k: a positive int, at most MAX_K (the retriever also clamps it to the store's size)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_K}; got {k!r}")
    return k


def check_prompt(prompt, who: str) -> str:
    """A completion prompt: a str (None, bytes or numbers are refused, not answered)."""
    if not isinstance(prompt, str):
        hint = " (decode it first: prompt.decode())" if isinstance(prompt, (bytes, bytearray)) else ""
        raise TypeError(f"{who} takes the prompt as a str; got {type(prompt).__name__}{hint}.")
    return prompt


def _did_you_mean(name: str, known: list[str], otherwise: str = "not an argument of this model.") -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {close[0]}?" if close else otherwise


def init_kwargs(cls, data: Any, renames: dict[str, str]) -> Any:
    """A pydantic ``mode="before"`` validator's work for an adapter's constructor: the names users bring
    from HuggingFaceLLM / ChatHuggingFace mapped to ours (``renames``; ``generate_kwargs`` spread into
    the sampling fields), and a clear error for anything else, instead of silently dropping it."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old, new in renames.items():
        if old in data:
            if new in data:
                raise ValueError(f"{cls.__name__} got both {old}= and {new}=; pass {new}= only.")
            data[new] = data.pop(old)
    gen = dict(data.pop("generate_kwargs", None) or {})
    bad = [k for k in gen if k not in _GENERATE_KEYS]
    if bad:
        raise ValueError(
            f"{cls.__name__} cannot honour generate_kwargs {', '.join(map(repr, bad))}: it samples with "
            f"{', '.join(_GENERATE_KEYS)} only. Remove them."
        )
    if "do_sample" in gen:  # as in transformers: greedy unless sampling, which defaults to temperature 1
        gen.setdefault("temperature", 1.0) if gen.pop("do_sample") else gen.update(temperature=0.0)
    for key, value in gen.items():
        data.setdefault(renames.get(key, key), value)  # an explicit constructor argument wins
    unknown = [k for k in data if k not in cls.model_fields]
    if unknown:
        known = sorted(set(cls.model_fields) | set(renames) | {"generate_kwargs"})
        hints = "".join(f"\n  {k}: {_NOT_HERE.get(k) or _did_you_mean(k, known)}" for k in unknown)
        raise ValueError(
            f"{cls.__name__} got unknown argument(s) {', '.join(map(repr, unknown))}.{hints}\n"
            f"It takes: {', '.join(known)}."
        )
    return data


# -- requests: each is the engine's RequestStream: iterate it (``for`` or ``async for``) for text, then
# ``result()`` / ``await aresult()``; concurrent ones are batched by the engine's scheduler ---------------


def stream_prompt(engine: "LazyEngine", prompt: str, params) -> "RequestStream":
    """A finished prompt text (chat template applied); known chunks inside it reuse their KV."""
    return engine.submit(engine.layout_from_text(prompt), params)


def stream_chunks(
    engine: "LazyEngine", question: str, chunks: list[str], params, system: str | None = None
) -> "RequestStream":
    """The fast path: chunk texts handed straight to the engine, tokenized alone, no string search."""
    return engine.submit(engine.build_prompt(question, chunks, system), params)


def result_info(result: "GenerationResult") -> dict:
    """What a response carries about its request: reuse stats, time to first token, finish reason."""
    return {
        "stats": result.stats.as_dict(),
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "finish_reason": result.finish_reason,
    }


# -- the same, for asyncio: the engine's scheduler thread does the work, the event loop only waits --


async def aload_engine(adapter) -> "LazyEngine":
    """``adapter.engine``, loading it (seconds, the first time) in a worker thread, not in the event loop."""
    if getattr(adapter, "_engine", None) is None:
        await asyncio.to_thread(lambda: adapter.engine)
    return adapter.engine
