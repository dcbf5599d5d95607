"""``lazyrag precache``'s arguments, apart from the builder so that ``lazyrag --help`` imports no torch."""
from __future__ import annotations

import argparse

from lazyrag.defaults import DEFAULT_EMBEDDER

PRECACHE_HELP = """\
Build a corpus store: chunk the documents with the model's tokenizer, embed them, index them
with FAISS, and compute each chunk's position-free KV once (after the shared prompt prefix).
A later `engine.attach_store(STORE)` (Python) then loads chunk KV from
the store instead of recomputing it.

Inputs: folders of .txt/.md files, or .jsonl / .jsonl.gz files with HotpotQA records
(contexts[].paragraph_text), NQ/DPR records (ctxs[].text) or plain {"id", "title", "text"}.

Interrupted? Rerun the same command: finished shards are kept and the build resumes.
The KV is stored in the engine's dtype (--dtype), unpadded, so it is bit-exact; budget about
2 * layers * kv_heads * head_dim * bytes per token (SmolLM2-135M fp32: 46 KB/token, so the NQ
corpus of 2655 passages is about 15 GB; --dtype bfloat16 halves that, for a bf16 engine).
"""

PRECACHE_EPILOG = """\
examples:
  lazyrag precache ../shared/data/nq_open_oracle_2655.jsonl.gz --out stores/nq
  lazyrag precache ../shared/data/hotpotqa_dev_500.jsonl --out stores/hotpot --limit 200
  lazyrag precache my_docs/ --out stores/docs --chunk-tokens 512 --overlap 64 --index hnsw
  lazyrag precache my_docs/ --out stores/docs --verify     # check checksums, rebuild bad shards
"""


def add_precache_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("precache", help="build a corpus store (chunks, FAISS index, chunk KV) for later reuse",
                              description=PRECACHE_HELP, epilog=PRECACHE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="folders of .txt/.md files, .txt/.md files, or .jsonl(.gz) files")
    p.add_argument("--out", required=True, help="store folder (created, or resumed if it holds an unfinished build)")
    p.add_argument("--model", default=None, help="local Llama folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="model and KV dtype: float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA); "
                                                  "the store only serves engines with the same dtype")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk incl. its separator; a multiple of the KV block size (16)")
    p.add_argument("--overlap", type=int, default=32, help="tokens repeated between consecutive chunks of a long document")
    p.add_argument("--chunks-per-shard", type=int, default=32, help="chunks per KV file (the unit of resume)")
    p.add_argument("--index", default="flat", choices=["flat", "ivf", "hnsw"], help="FAISS index: exact (flat) or approximate for large corpora")
    p.add_argument("--embedder", default=DEFAULT_EMBEDDER, help=f"sentence-transformers model folder (default: {DEFAULT_EMBEDDER}, embedded)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N documents (quick runs)")
    p.add_argument("--system", default=None, help="system prompt encoded before every chunk (must match the engine that reads the store)")
    p.add_argument("--kv-budget", type=int, default=None, help="bytes of the engine's KV pool while encoding (default: 1 GiB on CPU)")
    p.add_argument("--verify", action="store_true", help="check every stored chunk's checksum first; corrupt shards are rebuilt")
    p.add_argument("--overwrite", action="store_true", help="delete an existing store at --out and build from scratch")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p
