"""Offline pre-caching: corpus files -> chunks -> embeddings + FAISS + position-free KV in a store.

    from lazyrag.store.build import PrecacheConfig, precache
    report = precache(engine, PrecacheConfig(inputs=["docs/"], out="store"))
    # documents already in memory: ``inputs`` then only names their source (the manifest's ``sources``)
    config = PrecacheConfig(["my:documents"], "store", chunk_tokens=None)
    report = precache(engine, config, documents=[Document(id, text, meta)])

(``lazyrag.integrations.llama_index.precache_store`` and ``lazyrag.integrations.langchain.precache_store``
pass a framework's nodes or Documents this way.)

The chunk KV comes from the engine's own ``lazy`` strategy (the same code that encodes a
missed chunk at request time), so a stored chunk is what the engine would cache for it: read
back exactly, and equal to a recomputation up to the float rounding of another batch shape.
One ``precache`` writes a store at a time: a second one on the same ``out`` waits for the
first (saying so), then finds its chunks done.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from lazyrag.defaults import DEFAULT_EMBEDDER
from lazyrag.prompt import PromptBuilder, check_text
from lazyrag.store.corpus import (
    LAYOUT_VERSION,
    MANIFEST,
    PREFIX_ID,
    ChunkRow,
    CorpusStore,
    StoreError,
    check_new_store_folder,
    clear_store,
    engine_manifest,
    read_manifest,
    rebuild_interrupted,
    writer_lock,
)
from lazyrag.store.retriever import embed, load_embedder

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer

    from lazyrag.engine.engine import LazyEngine

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")
LLAMA_INDEX_DOCSTORE = "docstore.json"  # a folder index.storage_context.persist() wrote
DEFAULT_CHUNK_TOKENS = 256


@dataclass
class Document:
    id: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class PrecacheConfig:
    inputs: list[str]
    out: str
    # a multiple of the KV block size, separator included; None: each document one chunk, sized for the longest
    # (inputs already split: LlamaIndex nodes, LangChain splits); see whole_document_chunk_tokens
    chunk_tokens: int | None = 256
    overlap: int = 32  # tokens shared by consecutive chunks of one long document
    chunks_per_shard: int = 32  # chunks per KV file, and per resume step
    index: str = "flat"  # flat | ivf | hnsw
    embedder: str = DEFAULT_EMBEDDER
    limit: int | None = None  # documents to read (for quick runs)
    system: str | None = None  # system prompt of the encoding prefix (default: the engine's)
    progress: bool = True
    verify: bool = False  # check every stored chunk against its digest first; rebuild the bad shards
    overwrite: bool = (
        False  # delete the store at ``out`` (its own files only: see corpus.clear_store) and build from scratch
    )
    # how the shards keep KV (kv/codec.py): auto (16 bits) | float32 (the engine's KV exactly) | bfloat16 | float16 |
    # int8
    stored_kv_dtype: str = "auto"


@dataclass
class PrecacheReport:
    store: str
    documents: int
    chunks: int
    chunks_encoded: int  # in this run (the rest were done by an earlier, interrupted run)
    tokens_encoded: int
    seconds: float
    store_bytes: int
    corrupt: list[int] = field(default_factory=list)  # chunk ids --verify found bad (their shards were rebuilt)

    def summary(self) -> str:
        rate = self.tokens_encoded / self.seconds if self.seconds else 0.0
        verified = f"verify found {len(self.corrupt)} corrupt chunk(s), rebuilt; " if self.corrupt else ""
        return (
            f"{self.store}: {self.chunks} chunks from {self.documents} documents; {verified}encoded "
            f"{self.chunks_encoded} chunks ({self.tokens_encoded} tokens) in {self.seconds:.1f} s = {rate:.0f} "
            f"tokens/s; store {self.store_bytes / 2**30:.2f} GiB"
        )


# -- reading ------------------------------------------------------------------------------------


def _records_to_documents(rec: dict[str, Any], line_no: int, source: str) -> Iterator[Document]:
    """HotpotQA (``contexts[]``), NQ/DPR (``ctxs[]``), or a plain record with ``text``/``contents``."""
    if isinstance(rec.get("contexts"), list):
        for c in rec["contexts"]:
            yield Document(
                f"{source}:{c.get('id', line_no)}",
                _titled(c.get("title"), c.get("paragraph_text") or c.get("text", "")),
                {"title": c.get("title", ""), "source": source},
            )
    elif isinstance(rec.get("ctxs"), list):
        for j, c in enumerate(rec["ctxs"]):
            yield Document(
                f"{source}:{line_no}.{j}",
                _titled(c.get("title"), c.get("text", "")),
                {"title": c.get("title", ""), "source": source},
            )
    else:
        text = rec.get("text") or rec.get("contents") or rec.get("paragraph_text") or ""
        yield Document(
            str(rec.get("id", f"{source}:{line_no}")),
            _titled(rec.get("title"), text),
            {"title": rec.get("title", ""), "source": source},
        )


def _titled(title: str | None, text: str) -> str:
    return f"{title}\n{text}" if title else text


def read_documents(inputs: list[str], limit: int | None = None) -> Iterator[Document]:
    """Documents from folders of .txt/.md files and .jsonl(.gz) files, in a stable order, non-empty only."""
    return _usable(_read_inputs(inputs), limit)


def _read_inputs(inputs: list[str]) -> Iterator[Document]:
    for inp in inputs:
        path = Path(inp).expanduser()
        if path.is_dir() and (path / LLAMA_INDEX_DOCSTORE).is_file():  # its nodes are read by the CLI, or the adapter
            raise StoreError(
                f"{inp} is a folder LlamaIndex persisted ({LLAMA_INDEX_DOCSTORE}): pre-cache its nodes with "
                f"`lazyrag precache {inp} --out STORE` or lazyrag.integrations.llama_index.precache_store({inp!r}, "
                "STORE)."
            )
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
            docs: Iterator[Document] = (
                Document(str(p.relative_to(path)), p.read_text(errors="replace"), {"source": str(p)}) for p in files
            )
        elif path.is_file() and path.name.endswith((".jsonl", ".jsonl.gz")):
            docs = _read_jsonl(path)
        elif path.is_file() and path.suffix in TEXT_SUFFIXES:
            docs = iter([Document(path.name, path.read_text(errors="replace"), {"source": str(path)})])
        else:
            raise StoreError(
                f"{inp}: expected a folder of .txt/.md files, a .txt/.md file, or a .jsonl / .jsonl.gz file."
            )
        yield from docs


def _usable(docs: Iterable[Document], limit: int | None) -> Iterator[Document]:
    """The non-empty documents, at most ``limit`` of them."""
    n = 0
    for doc in docs:
        if not doc.text.strip():
            continue
        if limit is not None and n >= limit:
            return
        n += 1
        yield doc


def _in_memory(documents: Iterable[object]) -> Iterator[Document]:
    """``precache(documents=...)``'s items checked, their metadata made JSON (values it cannot hold become their
    str())."""
    for i, doc in enumerate(documents):
        if not isinstance(doc, Document) or not isinstance(doc.text, str):
            what = (
                f"a Document whose text is {type(doc.text).__name__}"
                if isinstance(doc, Document)
                else type(doc).__name__
            )
            raise TypeError(
                f"precache(documents=...) takes lazyrag.store.build.Document(id, text, meta) items; item {i} is {what}."
            )
        yield Document(str(doc.id), doc.text, json.loads(json.dumps(doc.meta, default=str)))


def _read_jsonl(path: Path) -> Iterator[Document]:
    """Each non-blank line one JSON object; a line that is not (or whose text is not valid Unicode) is named."""
    opener = gzip.open if path.name.endswith(".gz") else open
    i = -1
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            for i, line in enumerate(f):
                if line.strip():
                    yield from _line_documents(line, i, path)
        except UnicodeDecodeError as e:
            raise StoreError(
                f"{path}, line {i + 2}: not UTF-8 text ({e.reason} at byte {e.start} of its block); "
                "re-encode the file as UTF-8."
            ) from None


def _line_documents(line: str, i: int, path: Path) -> Iterator[Document]:
    where = f"{path}, line {i + 1}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise StoreError(
            f"{where} is not JSON ({e.msg}, column {e.colno}): a .jsonl file holds one JSON object a line."
        ) from None
    if not isinstance(rec, dict):
        raise StoreError(
            f'{where} is a JSON {type(rec).__name__}, not an object: each line needs a "text" field '
            '(or "contents", or NQ\'s "ctxs" / HotpotQA\'s "contexts").'
        )
    for doc in _records_to_documents(rec, i, path.name):
        try:
            check_text(doc.text, "its text")
        except ValueError as e:
            raise StoreError(f"{where}: {e}") from None
        yield doc


# -- chunking -----------------------------------------------------------------------------------


@dataclass
class Chunk:
    doc_id: str
    text: str
    ids: list[int]  # as the engine tokenizes the chunk (PromptBuilder.encode_chunk)
    meta: dict[str, Any]


def chunk_documents(
    docs: Iterable[Document], prompts: PromptBuilder, chunk_tokens: int, overlap: int, block_size: int
) -> list[Chunk]:
    """Token windows of each document, sized so a chunk (with its separator) fills whole KV blocks.

    Chunks with identical text are kept once: they have the same KV (same content key).
    """
    if chunk_tokens % block_size:
        raise ValueError(
            f"--chunk-tokens {chunk_tokens} is not a multiple of the KV block size {block_size}; "
            f"use e.g. {max(block_size, chunk_tokens // block_size * block_size)}."
        )
    sep = _separator_tokens(prompts)
    window = chunk_tokens - sep
    if not 0 <= overlap < window:
        raise ValueError(
            f"--overlap must be at least 0 and below the chunk size ({window} tokens of text); got {overlap}."
        )
    tok = prompts.tokenizer
    seen: set[str] = set()
    out: list[Chunk] = []
    for doc in docs:
        ids = prompts.encode(doc.text.strip())
        a, part = 0, 0
        while a < len(ids):
            end = min(a + window, len(ids))
            while True:  # decoding and re-tokenizing can add a token: shrink until the chunk fits its blocks
                text = doc.text.strip() if (a, end) == (0, len(ids)) else tok.decode(ids[a:end]).strip()
                cids = prompts.encode_chunk(text)
                if len(cids) <= chunk_tokens or end - a <= 1:
                    break
                end -= 1
            digest = hashlib.sha256(text.encode()).hexdigest()
            if text and digest not in seen:
                seen.add(digest)
                out.append(Chunk(doc.id, text, cids, {**doc.meta, "part": part}))
            part += 1
            if end == len(ids):
                break
            a = max(end - overlap, a + 1)
    return out


def _separator_tokens(prompts: PromptBuilder) -> int:
    """Tokens the chunk separator adds to a chunk's text."""
    return len(prompts.encode_chunk("x")) - len(prompts.encode("x"))


def whole_document_chunk_tokens(
    docs: list[Document], prompts: PromptBuilder, block_size: int, room: int, stored: int | None = None
) -> int:
    """``chunk_tokens=None``: a chunk size that keeps every document one chunk (as ``chunk_documents`` splits),
    so a framework's node is stored exactly as it appears in prompts. ``stored``: the chunk size of the
    store being resumed or extended, kept when every document fits it; otherwise the default 256 or the
    smallest multiple of ``block_size`` above it that holds the longest. ValueError for a document longer
    than ``room`` (the model's context after the encoding prefix)."""
    sep = _separator_tokens(prompts)
    need, doc_id = max(
        (max(len(prompts.encode(d.text.strip())) + sep, len(prompts.encode_chunk(d.text))), d.id) for d in docs
    )
    if need > room:
        raise ValueError(
            f"Document {doc_id} has {need} tokens, more than the model's context holds after the encoding prefix "
            f"({room}): split it first (a smaller chunk size in LlamaIndex's node parser or LangChain's text "
            "splitter), or pass chunk_tokens to have precache split it into windows."
        )
    if stored is not None and stored >= need:
        return stored
    return max(DEFAULT_CHUNK_TOKENS, -(-need // block_size) * block_size)


# -- building -----------------------------------------------------------------------------------


def _encode_kv(
    engine: LazyEngine, prefix_ids: list[int], chunk_ids: list[list[int]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each chunk's K/V via the engine's lazy strategy (encoded after the shared prefix), copied to CPU."""
    return engine.encode_chunks(chunk_ids, prefix_ids, read=True)[1]


# The KV layout of every store: all the model's KV heads, as one process computes them. A tensor-parallel engine
# reads any store, each rank slicing its own heads (CacheManager.kv_heads), so stores need no size of their own;
# one is written only at size 1 (a rank holds only its share of the heads).
STORE_TENSOR_PARALLEL_SIZE = 1


def check_store_writer(engine: LazyEngine) -> None:
    """Refuse to build a store with an engine whose ranks each hold a share of the KV heads."""
    size = getattr(engine, "tensor_parallel_size", 1)
    if size != STORE_TENSOR_PARALLEL_SIZE:
        raise StoreError(
            f"This engine runs at tensor_parallel_size={size}, so each rank holds only its share of the KV "
            "heads; a store keeps every head. Build the store with one process (lazyrag precache without "
            "torchrun, or tensor_parallel_size=1): a tensor-parallel engine then reads it, each rank its heads."
        )


def precache(
    engine: LazyEngine,
    config: PrecacheConfig,
    embedder: SentenceTransformer | None = None,
    documents: Iterable[Document] | None = None,
) -> PrecacheReport:
    """Build (or resume) the store at ``config.out``; returns what was done and how fast.

    ``documents``: Documents already in memory (a framework's nodes, in a stable order), stored instead of
    reading ``config.inputs``, which then only name where they came from (the manifest's ``sources``, e.g.
    "llama_index:docstore"). The same documents in the same order resume a build; more appended extend it.

    Holds the store's writer lock throughout: a concurrent run on the same ``out`` waits,
    then resumes (and so encodes only what the first one left undone). ``config.overwrite`` deletes
    the store's own files first, refusing a folder that holds anything else (``corpus.clear_store``);
    any run finishes an interrupted overwrite.
    """
    t0 = time.perf_counter()
    out = Path(config.out)
    check_store_writer(engine)
    if documents is not None and not config.inputs:
        config = replace(config, inputs=["documents"])
    docs = list(
        read_documents(config.inputs, config.limit)
        if documents is None
        else _usable(_in_memory(documents), config.limit)
    )
    if not docs:
        raise StoreError(f"No documents found in {', '.join(config.inputs)}.")
    identity = engine.kv_identity(config.system)  # raises for an engine without a tokenizer
    prompts = engine.prompts
    assert prompts is not None  # kv_identity raised otherwise
    chunk_tokens = config.chunk_tokens
    if chunk_tokens is None:
        resumed = (out / MANIFEST).is_file() and not config.overwrite and not rebuild_interrupted(out)
        stored = read_manifest(out).chunk_tokens if resumed else None
        chunk_tokens = whole_document_chunk_tokens(
            docs, prompts, identity.block_size, engine.max_context - len(identity.prefix_ids), stored
        )
        config = replace(config, chunk_tokens=chunk_tokens)
    chunks = chunk_documents(docs, prompts, chunk_tokens, config.overlap, identity.block_size)
    split = sorted({c.doc_id for c in chunks if c.meta["part"]}) if documents is not None else []
    if split:
        log.warning(
            "%d document(s) are longer than chunk_tokens=%d and were split into windows (%s): a prompt holding one "
            "whole reuses only the windows found in it; chunk_tokens=None keeps every document whole",
            len(split),
            chunk_tokens,
            ", ".join(split[:5]) + (", ..." if len(split) > 5 else ""),
        )
    embedder = embedder or load_embedder(config.embedder)
    manifest = engine_manifest(
        identity,
        embedder=config.embedder,
        embed_dim=_embed_dim(embedder),
        chunk_tokens=chunk_tokens,
        overlap=config.overlap,
        chunks_per_shard=config.chunks_per_shard,
        index_kind=config.index,
        stored_kv_dtype=config.stored_kv_dtype,
    )
    check_new_store_folder(out, config.overwrite)  # before a lock file goes into someone else's folder
    with writer_lock(out):
        # an interrupted --overwrite is finished by any run: the store it was deleting is half gone
        if config.overwrite or rebuild_interrupted(out):
            clear_store(out)
        corrupt = _verify(out) if config.verify else []
        store = CorpusStore.create_or_resume(out, manifest)
        encoded, tokens = _build(engine, config, store, chunks, embedder, t0)
    return PrecacheReport(
        str(out), len(docs), len(chunks), encoded, tokens, time.perf_counter() - t0, store.size_bytes(), corrupt
    )


def _verify(out: Path) -> list[int]:
    """Drop the shards of chunks that fail their digest (the build then recomputes them); their ids."""
    if not (out / MANIFEST).is_file():
        return []
    manifest = read_manifest(out)
    if manifest.layout_version != LAYOUT_VERSION:
        return []  # nothing to check chunk by chunk: create_or_resume refuses the whole store
    bad = CorpusStore(out, manifest).verify(repair=True)
    if bad:
        log.warning("verify: %d corrupt chunk(s) in %s (%s); their shards will be rebuilt", len(bad), out, bad[:20])
    return bad


def _build(
    engine: LazyEngine,
    config: PrecacheConfig,
    store: CorpusStore,
    chunks: list[Chunk],
    embedder: SentenceTransformer,
    t0: float,
) -> tuple[int, int]:
    """Encode and store every chunk whose shard is not done, then write the index; (chunks, tokens) encoded."""
    from tqdm import tqdm

    manifest = store.manifest
    keys = [engine.chunk_key(c.ids, manifest.prefix_ids) for c in chunks]
    _check_same_input(store, keys)

    done = store.done_shards()
    if "prefix.safetensors" not in done:
        kv = _encode_kv(engine, manifest.prefix_ids, [])
        row = ChunkRow(PREFIX_ID, manifest.prefix_key, "", "", len(manifest.prefix_ids), kind="prefix")
        store.add_shard("prefix.safetensors", [row], kv, None)

    per = config.chunks_per_shard
    stored = set(store.keys_by_id())
    todo: list[tuple[str, Sequence[int]]] = []  # (shard file, its chunk ids)
    for s in range(0, len(chunks), per):
        ids: Sequence[int] = range(s, min(s + per, len(chunks)))
        missing = [i for i in ids if i not in stored]
        if len(missing) == len(ids):
            todo.append((f"shard-{s // per:06d}.safetensors", ids))
        elif missing:  # the last shard of a store now extended by more input: the new chunks in a file of their own,
            # so the rows and file readers of the published generation use are never rewritten
            todo.append((f"shard-{s // per:06d}-{missing[0]:06d}.safetensors", missing))
    n_done = len(chunks) - sum(len(ids) for _, ids in todo)
    encoded = tokens = 0
    bar = tqdm(
        total=len(chunks),
        initial=n_done,
        unit="chunk",
        desc="precache",
        disable=not config.progress,
        dynamic_ncols=True,
    )
    for name, ids in todo:
        batch = [chunks[i] for i in ids]
        kv = _encode_kv(engine, manifest.prefix_ids, [c.ids for c in batch])
        vecs = embed(embedder, [c.text for c in batch])
        rows = [
            ChunkRow(i, keys[i], c.doc_id, c.text, len(c.ids), start=len(manifest.prefix_ids), meta=c.meta)
            for i, c in zip(ids, batch)
        ]
        store.add_shard(name, rows, kv, vecs)
        encoded += len(batch)
        tokens += sum(len(c.ids) for c in batch)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    store.finish(config.index, [str(Path(i)) for i in config.inputs])
    return encoded, tokens


def _embed_dim(model: SentenceTransformer) -> int:
    get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    dim = get()  # sentence-transformers: None for a model whose output size it cannot tell
    assert dim is not None, "the embedder does not say the size of its embeddings"
    return int(dim)


def _check_same_input(store: CorpusStore, keys: list[str]) -> None:
    """On resume, the chunks already stored must be the ones this input produces at the same ids."""
    for cid, key in store.keys_by_id().items():
        if cid != PREFIX_ID and (cid >= len(keys) or keys[cid] != key):
            raise StoreError(
                f"{store.path} was built from other input (chunk {cid} differs). Rerun with the same inputs, "
                "--limit and chunking options, or use a new --out folder (or --overwrite)."
            )
