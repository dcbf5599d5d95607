"""``lazyrag precache``: build a corpus store (chunks, FAISS index, each chunk's KV) for later reuse."""

from __future__ import annotations

import argparse
from pathlib import Path

from lazyrag.cli.common import (
    MODEL_HELP,
    HelpFormatter,
    UsageError,
    adapter_arg,
    adapter_kwargs,
    check_model,
    model_cache_arg,
    passage_arg,
    passage_kwargs,
    size_arg,
)
from lazyrag.defaults import DEFAULT_EMBEDDER
from lazyrag.kv.formats import STORED_KV_DTYPES, resolve_stored_dtype

PRECACHE_HELP = """\
Build a corpus store: chunk the documents with the model's tokenizer, embed them, index them
with FAISS, and compute each chunk's position-free KV once (after the shared prompt prefix).
A later `engine.attach_store(STORE)` (Python) then loads chunk KV from
the store instead of recomputing it.

Inputs: folders of .txt/.md files, or .jsonl / .jsonl.gz files with HotpotQA records
(contexts[].paragraph_text), NQ/DPR records (ctxs[].text) or plain {"id", "title", "text"}, or a
folder LlamaIndex persisted (index.storage_context.persist(FOLDER), with docstore.json): each node
is one chunk, its text as LlamaIndex's query engines put it in prompts (needs llama-index-core).

Interrupted? Rerun the same command: finished shards are kept and the build resumes.
The KV is computed in the engine's dtype (--dtype) and stored unpadded in 16 bits (--stored-kv-dtype
auto: float16 from a float32 engine), read back in the engine's dtype; budget about
2 * layers * kv_heads * head_dim * 2 bytes per token (SmolLM2-135M: 23 KB/token, so the NQ corpus of
2655 passages is about 7 GB). int8 halves that again at a small measured accuracy cost, float32
keeps the computed KV exactly at twice the size (the docs' "Corpus stores" page has the measurements).
"""

PRECACHE_EPILOG = """\
examples:
  lazyrag precache nq_open_oracle_2655.jsonl.gz --out stores/nq       # JSONL rows with a text field, or ctxs (NQ)
  lazyrag precache hotpotqa_dev_500.jsonl --out stores/hotpot --limit 200
  lazyrag precache my_docs/ --out stores/docs --chunk-tokens 512 --overlap 64 --index hnsw
  lazyrag precache my_docs/ --out stores/docs --verify     # check row digests, rebuild bad shards and the index
  lazyrag precache my_index/ --out stores/index            # a folder index.storage_context.persist() wrote
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "precache",
        help="build a corpus store (chunks, FAISS index, chunk KV) for later reuse",
        description=PRECACHE_HELP,
        epilog=PRECACHE_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help="folders of .txt/.md files, .txt/.md files, .jsonl(.gz) files, or folders "
        "LlamaIndex persisted (docstore.json)",
    )
    p.add_argument("--out", required=True, help="store folder (created, or resumed if it holds an unfinished build)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    adapter_arg(p)
    model_cache_arg(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default=None,
        help="model and KV dtype: float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA); "
        "the store only serves engines with the same dtype",
    )
    _chunking_args(p)
    _build_args(p)
    return p


def _chunking_args(p: argparse.ArgumentParser) -> None:
    """How documents become chunks, and how chunks are indexed and encoded."""
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="tokens per chunk incl. its separator; a multiple of the KV block size "
        "(16); default 256, or for LlamaIndex folders as many as keep every node whole",
    )
    p.add_argument(
        "--overlap", type=int, default=32, help="tokens repeated between consecutive chunks of a long document"
    )
    p.add_argument("--chunks-per-shard", type=int, default=32, help="chunks per KV file (the unit of resume)")
    p.add_argument(
        "--index",
        default="flat",
        choices=["flat", "ivf", "hnsw"],
        help="FAISS index: exact (flat) or approximate for large corpora",
    )
    p.add_argument(
        "--embedder",
        default=DEFAULT_EMBEDDER,
        help=f"sentence-transformers model folder (default: {DEFAULT_EMBEDDER}, embedded)",
    )
    p.add_argument("--limit", type=int, default=None, help="read only the first N documents (quick runs)")
    p.add_argument(
        "--system",
        default=None,
        help="system prompt encoded before every chunk (must match the engine that reads the store)",
    )
    passage_arg(p)


def _build_args(p: argparse.ArgumentParser) -> None:
    """The build itself: its KV pool, the stored dtype, verify / overwrite, progress."""
    p.add_argument(
        "--kv-budget",
        type=size_arg("--kv-budget"),
        default=None,
        metavar="SIZE",
        help="the engine's KV pool while encoding: 4GiB, 512MB, or a bare number of GiB (default: 1GiB on CPU)",
    )
    p.add_argument(
        "--stored-kv-dtype",
        default="auto",
        choices=STORED_KV_DTYPES,
        help="how the store keeps KV: auto = 16 bits (float16 from a float32 engine, else the engine's dtype); "
        "int8 = per-channel K / per-token V scales, half of that; float32 = exactly as computed "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every stored chunk (KV, key, start, text) against its digest "
        "first; corrupt shards are rebuilt, and the index rewritten",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the store at --out and build from scratch (only the "
        "store's own files: a folder holding anything else is refused and left as it is)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def check(args) -> None:
    check_model(args.model)
    missing = [i for i in args.inputs if not Path(i).exists()]
    named = [i for i in missing if i.startswith(("llama_index:", "langchain:"))]  # sources of a Python precache_store
    if named:
        raise UsageError(
            f"{named[0]} names the in-memory documents a Python call stored (precache_store in "
            "lazyrag.integrations.llama_index or .langchain): rerun that call with verify=True (or "
            "overwrite=True) to repair (or rebuild) the store."
        )
    if missing:
        raise UsageError(
            f"precache input(s) not found: {', '.join(missing)}. Pass folders of .txt/.md files, "
            ".txt/.md files, .jsonl(.gz) files, or folders LlamaIndex persisted."
        )
    if args.chunk_tokens is None:
        from lazyrag.store.build import DEFAULT_CHUNK_TOKENS

        # None (each node one chunk) when every input is a LlamaIndex folder: its nodes are split already
        args.chunk_tokens = None if len(_llama_index_folders(args.inputs)) == len(args.inputs) else DEFAULT_CHUNK_TOKENS
    elif args.chunk_tokens <= 0 or args.chunk_tokens % 16:
        raise UsageError(f"--chunk-tokens {args.chunk_tokens} must be a positive multiple of the KV block size, 16.")
    if args.chunk_tokens is not None and not 0 <= args.overlap < args.chunk_tokens:
        raise UsageError(f"--overlap {args.overlap} must be at least 0 and below --chunk-tokens {args.chunk_tokens}.")
    if args.limit is not None and args.limit <= 0:
        raise UsageError("--limit must be a positive number of documents.")
    if args.chunks_per_shard <= 0:
        raise UsageError("--chunks-per-shard must be positive.")
    from lazyrag.store.corpus import check_new_store_folder

    check_new_store_folder(Path(args.out), args.overwrite)  # someone else's folder: refused before the model loads


def _llama_index_folders(inputs: list[str]) -> set[str]:
    from lazyrag.store.build import LLAMA_INDEX_DOCSTORE

    return {i for i in inputs if (Path(i) / LLAMA_INDEX_DOCSTORE).is_file()}


def _documents(inputs: list[str]):
    """The documents of inputs that include folders LlamaIndex persisted (their nodes, one document each, read
    by llama-index-core as the adapter's ``precache_store`` reads them; the other inputs as precache reads
    them), or None: precache reads the inputs itself."""
    folders = _llama_index_folders(inputs)
    if not folders:
        return None
    from lazyrag.store.build import read_documents

    try:
        from lazyrag.integrations.llama_index import node_documents, persisted_nodes
    except ImportError as e:
        if not (e.name or "").startswith("llama_index"):
            raise
        raise UsageError(
            f"{sorted(folders)[0]} is a folder LlamaIndex persisted; reading its nodes needs llama-index-core: "
            "pip install llama-index-core"
        ) from e
    return [d for i in inputs for d in (node_documents(persisted_nodes(i)) if i in folders else read_documents([i]))]


def _finished_store(args) -> str | None:
    """A summary if ``--out`` already holds a finished build of these inputs and options, so rerunning
    the command returns at once instead of loading the model to find nothing to do."""
    from lazyrag.store.corpus import read_manifest

    out = Path(args.out)
    if not _store_files_finished(args, out):
        return None
    m = read_manifest(out)
    if not _manifest_matches(args, m) or not _inputs_unchanged(args, out, m):
        return None
    return (
        f"{out} is already a finished store of these inputs ({m.num_chunks} chunks, {m.num_tokens} tokens); "
        "nothing to do. Pass --verify to check its checksums or --overwrite to rebuild it."
    )


def _store_files_finished(args, out: Path) -> bool:
    """Whether ``out`` holds a finished build's files and the flags leave it to be compared with its manifest."""
    from lazyrag.store.corpus import INDEX, INDEX_NEXT, KV_DIR, MANIFEST, TABLE, rebuild_interrupted

    if args.overwrite or args.verify or not (out / MANIFEST).is_file() or rebuild_interrupted(out):
        return False
    if args.limit is not None:  # the manifest does not say how many documents the build read: the build finds out
        return False
    if not all((out / name).exists() for name in (TABLE, INDEX, KV_DIR)):
        return False  # files deleted under a finished manifest: the build makes them again
    return not (out / INDEX_NEXT).exists()  # a run killed while publishing its index: the build finishes that


def _manifest_matches(args, m) -> bool:
    """Whether the finished manifest ``m`` records the options, dtypes and model these flags ask for."""
    from lazyrag.prompt import DEFAULT_SYSTEM_PROMPT

    asked = {
        "chunk_tokens": args.chunk_tokens,
        "overlap": args.overlap,
        "chunks_per_shard": args.chunks_per_shard,
        "index_kind": args.index,
        "embedder": args.embedder or DEFAULT_EMBEDDER,
        "system_prompt": args.system or DEFAULT_SYSTEM_PROMPT,
    }
    if args.chunk_tokens is None:
        del asked["chunk_tokens"]  # whole nodes: the build works out the size (the same, for unchanged inputs)
    if m.status != "complete" or any(getattr(m, k) != v for k, v in asked.items()):
        return False  # unfinished or other settings: the build resumes or explains the mismatch
    if args.dtype is not None and args.dtype != m.dtype:
        return False
    if resolve_stored_dtype(args.stored_kv_dtype, m.dtype) != m.stored_kv_dtype:
        return False  # the build refuses another stored dtype, saying what to do
    from lazyrag.model.loader import resolve_model_source  # no weights read: the name the engine would carry

    return resolve_model_source(args.model).name == m.model_name


def _inputs_unchanged(args, out: Path, m) -> bool:
    """Whether the manifest ``m`` covers every input and none changed since the build wrote it."""
    from lazyrag.store.corpus import MANIFEST

    if not {str(Path(i)) for i in args.inputs} <= set(m.sources):
        return False
    built = (out / MANIFEST).stat().st_mtime
    inputs = [f for i in args.inputs for f in ([Path(i)] if Path(i).is_file() else Path(i).rglob("*"))]
    return not any(f.stat().st_mtime > built for f in inputs)  # an input changed since the build


def run(args) -> int:
    done = _finished_store(args)
    if done:
        print(done)
        return 0
    from lazyrag.engine import LazyEngine
    from lazyrag.prompt import DEFAULT_SYSTEM_PROMPT
    from lazyrag.store.build import PrecacheConfig, precache

    kw = {"kv_budget": args.kv_budget} if args.kv_budget else {}
    documents = _documents(args.inputs)  # before the model loads: a folder that cannot be read fails at once
    config = PrecacheConfig(
        list(args.inputs),
        args.out,
        args.chunk_tokens,
        args.overlap,
        args.chunks_per_shard,
        args.index,
        args.embedder,
        args.limit,
        args.system,
        progress=not args.quiet,
        verify=args.verify,
        overwrite=args.overwrite,
        stored_kv_dtype=args.stored_kv_dtype,
    )
    engine = LazyEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        **adapter_kwargs(args),
        system_prompt=args.system or DEFAULT_SYSTEM_PROMPT,
        **passage_kwargs(args),
        **kw,
    )
    print(precache(engine, config, documents=documents).summary())  # StoreError / ValueError are reported by main
    return 0
