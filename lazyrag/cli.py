"""The ``lazyrag`` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lazyrag import __version__
from lazyrag.defaults import API_KEY_ENV, CACHE_DIR_ENV, DEFAULT_EMBEDDER, MAX_K, MODEL_CACHE_ENV, QUIET_GGUF_ENV
from lazyrag.kv.formats import STORED_KV_DTYPES, resolve_stored_dtype
from lazyrag.strategy_names import check_strategy

DESCRIPTION = """\
lazyrag answers questions over retrieved chunks while reusing each chunk's KV cache at
whatever position the chunk lands in the prompt: every chunk is encoded once, stored once,
and its positional rotation is applied lazily inside attention.
"""

EPILOG = """\
examples:
  lazyrag demo                                  # offline, CPU, embedded SmolLM2-135M-Instruct
  lazyrag ask "Who discovered penicillin?" --chunk "Fleming found penicillin in 1928." --chunk "Tea came in 1662."
  lazyrag ask "..." --chunks-file notes.txt --strategy full     # compare with a plain full prefill
  lazyrag ask "..." --chunks-file notes.txt --model ~/models/Llama-3.1-8B-Instruct --device cuda

strategies (--strategy): lazy (default, ours), position_aware (a re-rotated copy per position),
prefix (exact token-prefix reuse only), full (no reuse; the quality reference).
"""


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


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default in its help: ``(default: X)`` is appended unless the
    help already says what the default is (argparse's ArgumentDefaultsHelpFormatter, minus noise such as
    ``(default: None)`` after a help that explains it, and ``False`` after an on/off flag)."""

    def _get_help_string(self, action):
        help = action.help or ""
        if (
            "%(default)" in help
            or "default" in help
            or action.default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return help
        if action.default is None or action.default is False or action.default == []:
            return help
        return help + " (default: %(default)s)"


MODEL_HELP = (
    "local model folder of Llama, Mistral, Qwen2/2.5 or Qwen3 (config.json + safetensors), .gguf file, or Hugging "
    "Face model id found in the local "
    "Hugging Face cache (HF_HUB_CACHE; never downloaded); default: the embedded SmolLM2-135M-Instruct"
)


def _size_arg(flag: str):
    """An argparse type: a byte size (lazyrag/sizes.py), or the parser's own error naming ``flag``."""

    def parse(value: str) -> int:
        from lazyrag.sizes import parse_bytes

        try:
            return parse_bytes(value, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)"
    )
    _model_cache_arg(p)


def _model_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-model-cache",
        action="store_true",
        help=f"read a .gguf model from the file on every load instead of converting it once into "
        f"${CACHE_DIR_ENV}/models (default: ~/.cache/lazyrag/models); the same as {MODEL_CACHE_ENV}=0",
    )


def _adapter_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter",
        default=None,
        metavar="FOLDER|embedded|none",
        help="a LoRA adapter from `lazyrag tune`, merged into the model at load (the model's fingerprint then "
        "differs: stores and caches of the base model are refused for it); `embedded`: the one shipped "
        "for the embedded model, tuned so that `lazy` answers more like a full prefill (needs peft: "
        "pip install 'lazyrag[tune]'); none (the default): the model as it is",
    )


def _adapter(args) -> dict:
    adapter = getattr(args, "adapter", None)
    return {"adapter": adapter} if adapter and adapter.lower() != "none" else {}


def _passage_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encoding-passage",
        default=None,
        metavar="default|none|FILE",
        help="what chunks are encoded after besides the prompt's prefix: default = three short neutral documents "
        "(a chunk's KV then reads as if other documents came first: closer to full prefill), none = the "
        "prefix alone (stores built before passages existed), or a text file's contents (documents "
        "separated by blank lines). Part of a store's identity: with --store, the store's unless given "
        "(default: default)",
    )


def _passage(args) -> dict:
    """Engine keyword for ``--encoding-passage``; unset with an opened ``--store``, the store's passage."""
    choice = getattr(args, "encoding_passage", None)
    store = getattr(args, "store", None)
    if choice is None and store is not None and hasattr(store, "manifest"):
        m = store.manifest
        if not m.passage_ids:
            return {"encoding_passage": None}
        return (
            {"encoding_passage": m.encoding_passage} if m.encoding_passage else {}
        )  # no text kept: the store says what to do
    if choice in (None, "default"):
        return {}
    if choice == "none":
        return {"encoding_passage": None}
    path = Path(choice)
    if not path.is_file():
        raise SystemExit(f"--encoding-passage {choice}: not default, none or a text file")
    text = path.read_text().strip()
    if not text:
        raise SystemExit(f"--encoding-passage {choice}: the file is empty (use none for no passage)")
    return {"encoding_passage": text}


def _tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="split the model over N processes (its KV heads and MLP across ranks); this process starts the "
        "others. Under torchrun --nproc-per-node N it is N (default: 1, or torchrun's WORLD_SIZE)",
    )


def _tensor_parallel(args) -> dict:
    """Engine keywords for tensor parallelism: ``--tensor-parallel-size``, else torchrun's WORLD_SIZE."""
    size = args.tensor_parallel_size or (
        int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else 1
    )
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1; got {size}")
    return {"tensor_parallel_size": size} if size > 1 else {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazyrag", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"lazyrag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="offline demo: cached chunks, answers of full / lazy / recovery marked right or wrong, TTFT",
        formatter_class=HelpFormatter,
        description="Caches a small bundled corpus once, then answers its 8 questions over the cached "
        "chunks in shuffled orders with a full prefill (the quality reference), plain lazy "
        "stitching and the demo's recovery, streaming each answer, marking it right or wrong "
        "against the expected answer and printing its time to first token. Ends with a table "
        "per strategy and says where the embedded 135M model fails even with full prefill.",
    )
    _model_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer (default: %(default)s)")
    demo.add_argument("--orders", type=int, default=1, help="shuffled chunk orders per question (default: %(default)s)")
    demo.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies to compare (default: full,lazy,lazy+recover; see `lazyrag ask --help`)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the chunk shuffles (default: %(default)s)")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write every answer and the summary to PATH")

    ask = sub.add_parser(
        "ask",
        help="answer one question over chunks you give",
        formatter_class=HelpFormatter,
        description="Answer one question over the given chunks and stream the answer.\n"
        "Chunks come from --chunk (repeatable) and/or --chunks-file (paragraphs separated by blank lines).",
    )
    _model_args(ask)
    _adapter_arg(ask)
    _passage_arg(ask)
    _tensor_parallel_arg(ask)
    ask.add_argument("question")
    ask.add_argument("--chunk", action="append", default=[], help="a chunk of context text (repeat for more)")
    ask.add_argument("--chunks-file", type=Path, help="a text file; paragraphs separated by blank lines become chunks")
    ask.add_argument(
        "--strategy",
        default="lazy",
        help="lazy (default: cached chunks read as they are, fastest), "
        "lazy+recover (lazy, plus about 15%% of chunk tokens recomputed in context, chosen by KV deviation x "
        "the question's attention: closer to full prefill's answers, see the docs' answer quality page), "
        "position_aware, prefix, full, or the recovery spelled out: lazy:first=K (each chunk's first K "
        "tokens recomputed), lazy:blend=R[:select=attn|attn_dev|chunk|gradual] (the fraction R of chunk tokens)",
    )
    ask.add_argument("--max-new-tokens", type=int, default=128, help="most tokens in the answer")
    ask.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ask.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens with this much probability",
    )
    ask.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ask.add_argument("--system", default=None, help="system prompt (part of the cached shared prefix)")
    ask.add_argument(
        "--store",
        type=Path,
        default=None,
        help="a corpus store from `lazyrag precache`: retrieve the question's top --k chunks from it "
        "and load their KV from disk instead of recomputing it",
    )
    ask.add_argument("--k", type=int, default=5, help="chunks to retrieve from --store")
    _store_embedder_arg(ask)
    add_precache_parser(sub)
    add_cache_parser(sub)
    add_eval_parser(sub)
    add_serve_parser(sub)
    add_tune_parser(sub)
    for p in sub.choices.values():
        p.add_argument("-v", "--verbose", action="store_true", help="show model-loading progress bars and library logs")
        p.add_argument("--debug", action="store_true", help="on an error, show the full traceback too")
    return parser


def add_precache_parser(subparsers) -> argparse.ArgumentParser:
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
    _adapter_arg(p)
    _model_cache_arg(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default=None,
        help="model and KV dtype: float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA); "
        "the store only serves engines with the same dtype",
    )
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
    _passage_arg(p)
    p.add_argument(
        "--kv-budget",
        type=_size_arg("--kv-budget"),
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
    return p


CACHE_HELP = """\
Show what a corpus store from `lazyrag precache` holds, without loading a model: its status, the model and
dtype its KV is for (an engine with another model or dtype refuses it), entries (chunks) and tokens, bytes
on disk (KV shards and the whole folder) and per token, and how it was built.

The live cache of a running engine is `engine.cache_report()` in Python (per tier: entries, bytes, hits,
misses, hit rate, evictions; prefix vs chunk reuse) and `GET /metrics` of `lazyrag serve`.
"""


def add_cache_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "cache",
        help="show a corpus store's entries, bytes on disk, dtype and model (no model load)",
        description=CACHE_HELP,
        formatter_class=HelpFormatter,
        epilog="examples:\n  lazyrag cache --store stores/nq\n  lazyrag cache --store stores/nq --json",
    )
    p.add_argument("--store", type=Path, required=True, help="a corpus store folder (lazyrag precache --out)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    return p


SERVE_HELP = """\
Serve the model over HTTP with the OpenAI API, the way vLLM and SGLang are run: any OpenAI client
(the openai package, LangChain's ChatOpenAI, LlamaIndex's OpenAILike) points its base URL at
http://HOST:PORT/v1 and works unchanged; every chunk's KV is cached once and reused at any position.

MODEL, as for `vllm serve`: a local Llama, Mistral, Qwen2/2.5 or Qwen3 folder, a .gguf file, or a Hugging
Face model id found in the local Hugging Face cache (never downloaded: `hf download ID` first); clients then
send it as "model" (the model's folder or file name is accepted too). --config FILE.yaml takes any option below as a
key (port: 8001, max-num-seqs: 32, ...); options on the command line win over the file's.

Endpoints: POST /v1/chat/completions and /v1/completions (stream=true for server-sent events),
GET /v1/models, /health, /metrics (Prometheus: requests, TTFT and inter-token histograms, chunk
hits and misses, cache bytes per tier), and vLLM's GET /version, POST /tokenize and /detokenize.

Chunks reach a request three ways: an extra "documents" field (a list of texts), chunks already
known to the engine found inside the message text, or, with --store, the top --k chunks retrieved
for the last user message. Extra request fields: "documents", "strategy", "k", "retrieve", and vLLM's
"top_k" and "repetition_penalty"; logprobs (chat: logprobs/top_logprobs, completions: logprobs) and
presence/frequency penalties as in OpenAI's API.
usage.prompt_tokens_details.cached_tokens counts the prompt tokens whose KV was reused (the shared
prefix's included; the response's "lazyrag" stats split it into prefix_tokens_reused and chunk_tokens_reused).
"""

SERVE_EPILOG = """\
examples:
  lazyrag serve                                           # embedded model on http://127.0.0.1:8000/v1
  lazyrag serve --store stores/nq --k 5                   # answer questions from a pre-cached corpus
  lazyrag serve ~/models/Llama-3.1-8B-Instruct --device cuda --host 0.0.0.0 --api-key "$KEY"
  lazyrag serve HuggingFaceTB/SmolLM2-135M-Instruct --max-model-len 4096 --max-num-seqs 32   # from the HF cache
  lazyrag serve --config serve.yaml --port 8001           # options from a YAML file; the command line wins
  lazyrag serve --allowed-origins '["http://localhost:3000"]' --ssl-keyfile key.pem --ssl-certfile cert.pem
  lazyrag serve --replicas 2 --store stores/nq           # 2 engines behind one endpoint, on Ray Serve

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "messages": [{"role": "user", "content": "Who discovered penicillin?"}],
    "documents": ["Alexander Fleming discovered penicillin in 1928."], "stream": true}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-');
  print(c.chat.completions.create(model='SmolLM2-135M-Instruct', messages=[{'role': 'user', 'content': 'Hi'}]))"

  curl http://127.0.0.1:8000/tokenize -H 'Content-Type: application/json' -d '{"prompt": "Hello there"}'
"""


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat, completions, streaming, metrics)",
        description=SERVE_HELP,
        epilog=SERVE_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model takes it (either one; default: the embedded SmolLM2-135M-Instruct)",
    )
    _model_args(p)
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="read options from a YAML file: keys are the options' names without -- (dashes or underscores: "
        "max-num-seqs or max_num_seqs), e.g. {model: ~/models/x, port: 8001, allowed-origins: ['*']}; "
        "options given on the command line override the file's",
    )
    _adapter_arg(p)
    _passage_arg(p)
    _tensor_parallel_arg(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s; 0.0.0.0 for every interface)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id clients send and /v1/models lists; more names are accepted too (default: MODEL as "
        "given, also answering to the model's folder or file name; without MODEL, the model's name)",
    )
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="a corpus store from `lazyrag precache`: its chunk KV is "
        "loaded from disk, and chat requests that bring no chunks get the top --k retrieved from it",
    )
    p.add_argument(
        "--k",
        type=int,
        default=5,
        help=f"chunks retrieved per chat request from --store (default: %(default)s, at most {MAX_K})",
    )
    _store_embedder_arg(p)
    p.add_argument(
        "--strategy",
        default="lazy+recover",
        help="the strategy of requests that name none (default: %(default)s; "
        "lazy is fastest, full is the quality reference; see `lazyrag ask --help`)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=256, help="max_tokens of requests that give none (default: %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="temperature of requests that give none (default: %(default)s, greedy)",
    )
    p.add_argument(
        "--kv-budget",
        type=_size_arg("--kv-budget"),
        default=None,
        metavar="SIZE",
        help="the paged KV pool: 4GiB, 512MB, or a bare number of GiB (default: 1GiB on CPU, 8GiB on CUDA)",
    )
    p.add_argument(
        "--host-gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="a host-RAM tier below the GPU pool (GiB, page-locked): chunk KV evicted from the pool, or not "
        "admitted for want of room, waits there and comes back by a copy instead of an encode (default: none)",
    )
    p.add_argument(
        "--cache-admission",
        action="store_true",
        help="when the pool is full, keep a new chunk only if it was asked for at least as often as the chunks it "
        "would evict (TinyLFU): popular documents stay cached under a stream of one-off ones (at a 1 GB pool on an "
        "H200, +17%% requests/s on a Zipf-popular corpus; benchmarks/NOTES.md). Default: plain LRU",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=256,
        help="generations in flight before new requests get HTTP 503; a request's n choices times its prompts "
        "count, reserved before any retrieval or tokenizing (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=8.0,
        metavar="MB",
        help="a larger request body gets HTTP 413 before it is read (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else no key). A key on the "
        "command line shows in `ps`: prefer the variable or --api-key-file",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request body whose next part takes longer than this gets HTTP 408 (default: %(default)s)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="uvicorn's: connections and tasks at once before new ones get HTTP 503 (default: no limit). Slow "
        "clients that never finish their headers are a reverse proxy's to stop (nginx, a load balancer)",
    )
    p.add_argument(
        "--api-key-file", type=Path, default=None, metavar="PATH", help="read the API key from this file's first line"
    )
    p.add_argument(
        "--api-key-covers",
        default="v1",
        choices=["v1", "all"],
        help="what the key guards: the /v1/ API (default, as vLLM), or all routes (also /metrics, /docs, "
        "/openapi.json, /tokenize); /health and /version stay open",
    )
    p.add_argument(
        "--no-pasted-context",
        dest="pasted_context",
        action="store_false",
        help="reuse only chunks sent as `documents` or already known; by default the paragraphs pasted into a "
        "prompt (a LangChain or LlamaIndex RAG prompt's retrieved texts) are cached on first sight and "
        "reused in any order from the next request on",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="sequences decoding at once (SchedulerConfig.max_running; default: 64); more wait in the queue",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="new prompt tokens prefilled in one step (SchedulerConfig.max_prefill_tokens; default: 8192)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        metavar="N",
        help="a prompt with more new tokens is prefilled N at a step, so that a cancelled request stops "
        "between pieces and other requests are admitted meanwhile (SchedulerConfig.long_prefill_tokens; "
        "default: 8192 on a GPU, 2048 on the CPU)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prompt plus answer tokens a request may take: a longer prompt gets HTTP 400 (default: the "
        "model's max_position_embeddings, which it cannot exceed)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed the random generators (torch's, Python's) once the model is loaded, as vLLM's --seed: "
        "sampling requests without a seed of their own then draw the same numbers in the same order "
        'after every start; a request\'s "seed" still makes that request reproducible on its own '
        "(default: not seeded)",
    )
    p.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="log_level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per request in the log")
    p.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=None,
        metavar="LIST",
        help="CORS: origins a browser page may call the API from, a JSON list or commas: "
        "'[\"http://localhost:3000\"]', '*' for any (default: none, no CORS headers; vLLM's is '*')",
    )
    p.add_argument(
        "--allowed-methods",
        type=_string_list,
        default=["*"],
        metavar="LIST",
        help="CORS: methods allowed with --allowed-origins (default: *)",
    )
    p.add_argument(
        "--allowed-headers",
        type=_string_list,
        default=["*"],
        metavar="LIST",
        help="CORS: request headers allowed with --allowed-origins (default: *)",
    )
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="HTTPS: the private key file (PEM)")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE", help="HTTPS: the certificate file (PEM)")
    p.add_argument(
        "--root-path",
        default=None,
        metavar="PATH",
        help="the path prefix a proxy strips before requests reach the server (uvicorn's root_path, e.g. "
        "/lazyrag); the API docs' links then carry it",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engines behind the one endpoint, each its own process (Ray Serve; pip install 'lazyrag[replicas]'). "
        "A request goes where most of its documents' KV already is (--router); all replicas read the same "
        "--store. Use replicas for more traffic than one engine serves; a model too big for one GPU "
        "needs tensor parallelism instead (default: %(default)s, no Ray)",
    )
    p.add_argument(
        "--router",
        default="chunk_affinity",
        choices=["chunk_affinity", "least_loaded", "round_robin"],
        help="with --replicas: how a request picks its replica (default: %(default)s: least queued work plus "
        "the request's documents a replica lacks, from the replicas' KV events)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: join this Ray cluster ('auto' for the one `ray start` made here) instead of "
        "starting Ray on this machine",
    )
    return p


TUNE_HELP = """\
Adapt a model so that its answers over chunks encoded on their own (the lazy strategy: cached
chunk KV read at any position, no recompute) match its answers over a full prefill.

It distils the model to itself: for prompts drawn from the tune parts of the QA sets (the
question's own passages plus distractors of the same set: 5, 10 or 20 passages, shuffled) it
takes the base model's greedy full-prefill answer, then trains a LoRA adapter (or, --method
full, every weight) to minimise KL(base full || tuned lazy) + --full-weight x KL(base full ||
tuned full) over the answer tokens. No labels, and the report parts the docs' quality
tables are measured on are never read. The lazy pass computes exactly what the engine computes.

Progress bar, a checkpoint every --save-every steps, and resume after a kill: rerun the same
command. The KL on held-out tune prompts is printed as it goes and kept in OUT/log.jsonl.
Then: lazyrag ask|serve|precache|eval ... --adapter OUT.
"""

TUNE_EPILOG = """\
examples:
  lazyrag tune --out adapters/smollm2-lazy                       # the embedded model, LoRA, 1000 steps (GPU)
  lazyrag tune --out adapters/smollm2-lazy --max-steps 5 --device cpu     # a few steps on the CPU
  lazyrag tune --model ~/models/Llama-3.1-8B-Instruct --out adapters/llama-lazy --sets nq,hotpotqa
  lazyrag ask "Who discovered penicillin?" --chunk "..." --adapter adapters/smollm2-lazy
"""


def add_tune_parser(sub) -> argparse.ArgumentParser:
    from lazyrag import eval as quality

    p = sub.add_parser(
        "tune",
        help="adapt a model to answer over cached chunks (lazy) as over a full prefill",
        description=TUNE_HELP,
        epilog=TUNE_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument(
        "--out", type=Path, required=True, help="the adapter folder to write (a checkpoint inside it while it runs)"
    )
    p.add_argument(
        "--method",
        default="lora",
        choices=["lora", "full"],
        help="a LoRA adapter, or every weight (default: %(default)s)",
    )
    p.add_argument("--max-steps", type=int, default=1000, help="training steps (default: %(default)s)")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts in a step's batch (default: %(default)s)")
    p.add_argument(
        "--passages", default="5,10,20", help="passages per training prompt, drawn per prompt (default: %(default)s)"
    )
    p.add_argument(
        "--sets", default=",".join(quality.DATASETS), help="QA sets whose tune parts are read (default: %(default)s)"
    )
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="SET=FILE",
        help="a set's file where not the default (repeatable)",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 2e-4 for LoRA, 2e-5 for full)")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (default: %(default)s)")
    p.add_argument(
        "--full-weight",
        type=float,
        default=0.25,
        help="weight of KL(base full || tuned full), which keeps full prefill and plain chat as they were (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=32,
        help="teacher answers are cut at this many tokens (default: %(default)s)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="steps between KL reports on held-out prompts (default: %(default)s)",
    )
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and distractors (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long: checkpoint and write the adapter as far as it got (rerun to go on)",
    )
    _passage_arg(p)
    return p


def add_eval_parser(sub) -> argparse.ArgumentParser:
    from lazyrag import eval as quality  # no torch: its description is the module's docstring

    p = sub.add_parser(
        "eval",
        help="answer quality of the strategies side by side on NQ, HotpotQA, SQuAD, 2WikiMultihopQA or MuSiQue",
        description=quality.__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--dataset",
        choices=quality.DATASETS,
        default=None,
        help="which benchmark (default: nq where its file is found, else squad, whose sample ships with lazyrag)",
    )
    _passage_arg(p)
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="the dataset file (default: the repository's copy in a clone; from a wheel, the 40-question "
        "sample shipped for squad, 2wiki and musique; nq and hotpotqa need --data)",
    )
    p.add_argument(
        "--split",
        choices=quality.SPLITS,
        default="all",
        help="tune: the 30%% of each set that methods are chosen on; report: the other 70%%, which results quote",
    )
    p.add_argument("--n", type=int, default=100, help="questions")
    p.add_argument("--distractors", type=int, default=4, help="nq: random passages besides the gold one")
    p.add_argument(
        "--passages",
        type=int,
        default=None,
        metavar="N",
        help="every question over N passages: its own, then distractors from other questions of the same set "
        "and split, shuffled (nq: the gold one and N - 1 random others); e.g. 10 or 20, where encoding "
        "chunks on their own costs most (default: each set's own)",
    )
    p.add_argument("--shuffle", action="store_true", help="hotpotqa, squad, 2wiki, musique: shuffle the paragraphs")
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="nq retrieval mode: chunks are the top --k of this corpus store (lazyrag precache), not gold + "
        "distractors",
    )
    p.add_argument("--k", type=int, default=5, help="retrieval mode: chunks per question")
    _store_embedder_arg(p)
    p.add_argument(
        "--strategies",
        default="full,position_aware,lazy,lazy:first=16,lazy:first=32",
        help="comma-separated: full, prefix, position_aware, lazy, lazy+recover (the named recovery, "
        "= lazy:blend=0.15:select=attn_dev), lazy:first=K (each chunk's first K tokens "
        "recomputed in context), lazy:blend=R (CacheBlend: the fraction R of chunk tokens whose KV deviates "
        "most; add :select=S to choose otherwise: chunk = R of each chunk, attn = by the question's attention, "
        "attn_dev = deviation x attention, gradual = CacheBlend's 2-stage filter; :budget=chunk = R of each chunk; "
        ":attn_from=F = the question's attention from depth F of the layers on), or both, "
        "e.g. lazy:first=4:blend=0.12:select=attn_dev",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument(
        "--batch",
        type=int,
        default=4,
        help="questions whose requests (all strategies) run as one batch (on a GPU, 32-64)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes, each with its own engine and KV budget (8 GiB each on cuda), spread over the visible "
        "GPUs. On one H200, 6 workers ran about 1.4x faster than 1 and 12 ran out of memory; on a laptop keep 1",
    )
    p.add_argument(
        "--kv-budget",
        type=_size_arg("--kv-budget"),
        default=None,
        metavar="SIZE",
        help="each worker's paged KV pool: 4GiB, 512MB, or a bare number of GiB (default: 8GiB on cuda, 1GiB on "
        "cpu); lower it to run more workers",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the question sample and the distractors")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    _adapter_arg(p)
    _model_cache_arg(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new batch after this long; score and report the questions done so far",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on from OUT.partial.jsonl, where every run saves each batch as it finishes (a run stopped by "
        "--time-limit or killed): only the questions left are scored, the report covers them all",
    )
    p.add_argument(
        "--skip-answered",
        type=Path,
        nargs="+",
        default=None,
        metavar="REPORT",
        help="leave out the questions that earlier reports of this set (lazyrag eval JSON) answered with "
        "every strategy asked here, without a failed request: a later run scores only the rest, and "
        "benchmarks/quality_sets.py merges the reports by question",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="cuda: no CUDA graphs or compiled elementwise ops; each worker starts about 2 min sooner, "
        "steps run about 8%% slower (the better trade for runs of a few minutes)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="model and KV dtype (default: bfloat16 on cuda, float32 on cpu)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("lazyrag-eval/quality.json"),
        help="the report (JSON; a .png plot and the .partial.jsonl checkpoint beside it), relative to the "
        "current folder; missing folders are created",
    )
    return p


def _string_list(value: str) -> list[str]:
    """``--allowed-origins`` and kin: a JSON list (vLLM's form) or comma-separated values."""
    if value.strip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list ({e})") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(
                f"{value!r}: give a JSON list of strings, e.g. '[\"http://localhost:3000\"]'"
            )
        return items
    return [v.strip() for v in value.split(",") if v.strip()]


# -- options from a YAML file (serve --config), as vLLM reads them --


def _config_argv(parser: argparse.ArgumentParser, path: str, drop_model: bool) -> list[str]:
    """The options of a ``--config`` YAML file as command-line arguments, to be parsed before the real ones (which
    then win). Keys are the parser's long option names, with dashes or underscores; anything else is refused."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror or e}).") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path} is not valid YAML: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise UsageError(
            f"--config {path} must hold option names and values (e.g. `port: 8001`), not a {type(data).__name__}."
        )
    actions = {
        o[2:]: a
        for a in parser._actions
        for o in a.option_strings
        if o.startswith("--") and o not in ("--help", "--config")
    }
    unknown = [str(k) for k in data if str(k).replace("_", "-") not in actions]
    if unknown:
        raise UsageError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}. Valid keys, the options of "
            f"`lazyrag {parser.prog.split()[-1]}` (dashes or underscores): {', '.join(sorted(actions))}."
        )
    argv = []
    for key, value in data.items():
        name = str(key).replace("_", "-")
        action, flag = actions[name], f"--{name}"
        if value is None or (drop_model and action.dest == "model"):
            continue  # the command line's MODEL or --model wins
        if action.nargs == 0:  # an on/off flag
            if not isinstance(value, bool):
                raise UsageError(f"--config {path}: {key} is an on/off option; give true or false, not {value!r}.")
            argv += [flag] if value else []
        elif isinstance(value, (list, tuple)) and (
            isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
        ):
            argv += (
                [f"{flag}={v}" for v in value]
                if isinstance(action, argparse._AppendAction)
                else [flag, *map(str, value)]
            )
        elif isinstance(value, (list, tuple, dict)):
            argv.append(f"{flag}={json.dumps(value)}")
        else:
            argv.append(f"{flag}={str(value).lower() if isinstance(value, bool) else value}")
    return argv


def _with_config(parser: argparse.ArgumentParser, argv: list[str], args):
    """``args`` again with the ``--config`` file's options under the command line's."""
    assert parser._subparsers is not None  # the commands' subparsers
    subparsers = parser._subparsers._group_actions[0]
    assert isinstance(subparsers, argparse._SubParsersAction)
    command = subparsers.choices[args.command]
    at = argv.index(args.command) + 1
    given = args.model is not None or getattr(args, "model_tag", None) is not None
    return parser.parse_args(argv[:at] + _config_argv(command, args.config, drop_model=given) + argv[at:])


# -- argument checks that need no model: a mistake is reported in a second, not after the load --


class UsageError(ValueError):
    """A command-line argument that cannot work; the message says what to pass instead."""


def _check_model(model: str | None) -> None:
    """A model that cannot be found is reported before anything loads (a hub id: looked up in the local cache)."""
    if model is not None and not Path(model).expanduser().exists():
        from lazyrag.model.loader import ModelLoadError, resolve_model_source  # no torch

        try:
            resolve_model_source(model)
        except ModelLoadError as e:
            raise UsageError(str(e)) from None


def _check_store(store: Path):
    from lazyrag.store.corpus import CorpusStore

    return CorpusStore.open(store)  # StoreError (what to do) for a missing, foreign or unfinished store


def _store_embedder_arg(p) -> None:
    p.add_argument(
        "--embedder",
        default=None,
        metavar="NAME_OR_FOLDER",
        help="the embedder of --store, when the store was built with a local model folder (precache --embedder): "
        "lazyrag loads a folder only when you name it, and it must be the one the store names "
        "(default: the store's, if it is the embedded default)",
    )


def _check_embedder(args) -> None:
    """The store's embedder, or the one ``--embedder`` names, settled before the model loads (StoreError: what to
    pass)."""
    if args.store is None:
        if args.embedder is not None:
            raise UsageError("--embedder names the embedder of --store; pass it with --store.")
        return
    from lazyrag.store.retriever import store_embedder

    args.embedder = store_embedder(args.store, args.embedder)


def _check_ask(args) -> None:
    check_strategy(args.strategy)
    _check_model(args.model)
    if args.chunks_file and not args.chunks_file.is_file():
        raise UsageError(
            f"--chunks-file {args.chunks_file} does not exist; pass a text file whose paragraphs "
            "(separated by blank lines) are the chunks."
        )
    if args.max_new_tokens <= 0 or args.k <= 0:
        raise UsageError("--max-new-tokens and --k must be positive.")
    _check_k(args.k)
    if args.store is not None:
        args.store = _check_store(args.store)  # opened once: the command attaches and searches this one
    _check_embedder(args)


def _check_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise UsageError(f"--k {k} must be from 1 to {MAX_K} (chunks retrieved per question).")


def _check_precache(args) -> None:
    _check_model(args.model)
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


def _precache_documents(inputs: list[str]):
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


def _check_eval(args) -> None:
    _check_model(args.model)
    if args.n <= 0 or args.batch <= 0 or args.workers <= 0 or args.max_new_tokens <= 0 or (args.kv_budget or 1) <= 0:
        raise UsageError("--n, --batch, --workers, --max-new-tokens and --kv-budget must be positive.")
    if args.passages is not None and (args.passages < 1 or args.store is not None):
        raise UsageError("--passages must be at least 1, and takes no --store (retrieval chooses the passages there).")
    _check_k(args.k)
    for name in args.strategies.split(","):
        check_strategy(name)
    if args.store is not None:
        args.store = _check_store(args.store)  # opened once: the command attaches and searches this one
    _check_embedder(args)
    for report in args.skip_answered or ():
        if not report.is_file():
            raise UsageError(f"--skip-answered: {report} does not exist; pass lazyrag eval reports (JSON).")


def _finished_store(args) -> str | None:
    """A summary if ``--out`` already holds a finished build of these inputs and options, so rerunning
    the command returns at once instead of loading the model to find nothing to do."""
    from lazyrag.prompt import DEFAULT_SYSTEM_PROMPT
    from lazyrag.store.corpus import INDEX, INDEX_NEXT, KV_DIR, MANIFEST, TABLE, read_manifest, rebuild_interrupted

    out = Path(args.out)
    if args.overwrite or args.verify or not (out / MANIFEST).is_file() or rebuild_interrupted(out):
        return None
    if args.limit is not None:  # the manifest does not say how many documents the build read: the build finds out
        return None
    if not all((out / name).exists() for name in (TABLE, INDEX, KV_DIR)):
        return None  # files deleted under a finished manifest: the build makes them again
    if (out / INDEX_NEXT).exists():
        return None  # a run killed while publishing its index: the build finishes that
    m = read_manifest(out)
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
        return None  # unfinished or other settings: the build resumes or explains the mismatch
    if args.dtype is not None and args.dtype != m.dtype:
        return None
    if resolve_stored_dtype(args.stored_kv_dtype, m.dtype) != m.stored_kv_dtype:
        return None  # the build refuses another stored dtype, saying what to do
    from lazyrag.model.loader import resolve_model_source  # no weights read: the name the engine would carry

    if resolve_model_source(args.model).name != m.model_name:
        return None
    if not {str(Path(i)) for i in args.inputs} <= set(m.sources):
        return None
    built = (out / MANIFEST).stat().st_mtime
    inputs = [f for i in args.inputs for f in ([Path(i)] if Path(i).is_file() else Path(i).rglob("*"))]
    if any(f.stat().st_mtime > built for f in inputs):
        return None  # an input changed since the build
    return (
        f"{out} is already a finished store of these inputs ({m.num_chunks} chunks, {m.num_tokens} tokens); "
        "nothing to do. Pass --verify to check its checksums or --overwrite to rebuild it."
    )


def _require(command: str, *modules: str) -> None:
    """lazyrag.extras.require as a usage error: the command's optional modules, and the extra that installs them."""
    from lazyrag.extras import MissingExtra, require

    try:
        require(command, *modules)
    except MissingExtra as e:
        raise UsageError(str(e)) from None


def _api_key(args) -> None:
    """``args.api_key`` from --api-key, else --api-key-file, else $LAZYRAG_API_KEY (None: no key)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError("Pass the API key once: --api-key or --api-key-file.")
    if args.api_key_file is not None:
        try:
            args.api_key = (
                args.api_key_file.read_text().splitlines()[0].strip() if args.api_key_file.stat().st_size else ""
            )
        except OSError as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: {e.strerror}.") from None
    elif args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("The API key is empty: give a key, or none to serve without one.")
    if args.api_key is not None and not args.api_key.isprintable():
        raise UsageError("The API key holds control characters; it must fit in an HTTP header.")


def _check_serve(args) -> None:
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise UsageError(f"Two models given: {args.model_tag} (MODEL) and --model {args.model}; pass one of them.")
    args.model = args.model_tag if args.model_tag is not None else args.model
    _api_key(args)
    check_strategy(args.strategy)
    _check_model(args.model)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}.")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be in [0, 2**63); got {args.seed}.")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        if getattr(args, flag) is not None and not Path(getattr(args, flag)).expanduser().is_file():
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not a file.")
    if args.ssl_keyfile and not args.ssl_certfile:
        raise UsageError("--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key).")
    if args.root_path is not None:
        if not args.root_path.startswith("/"):
            raise UsageError(f"--root-path {args.root_path} must start with /, e.g. /lazyrag.")
        args.root_path = args.root_path.rstrip("/")
    if args.allowed_origins is not None and not args.allowed_origins:
        raise UsageError("--allowed-origins is empty; give origins (a JSON list or commas), or '*' for any.")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} must be in 1-65535.")
    if not args.body_timeout > 0 or (args.limit_concurrency is not None and args.limit_concurrency < 1):
        raise UsageError("--body-timeout must be a positive number of seconds and --limit-concurrency at least 1.")
    if not 0 < args.k <= MAX_K or args.max_tokens <= 0 or args.max_pending <= 0 or not args.max_request_mb > 0:
        raise UsageError(
            f"--k must be in 1-{MAX_K}; --max-tokens, --max-pending and --max-request-mb must be positive."
        )
    if not 0 <= args.temperature <= 100:
        raise UsageError("--temperature must be in [0, 100] (0 = greedy).")
    if not args.host_gb >= 0:
        raise UsageError(f"--host-gb must be a number of GiB of at least 0 (0 = no host tier); got {args.host_gb}.")
    _require("lazyrag serve", "fastapi", "prometheus_client", "uvicorn")
    if args.replicas < 1:
        raise UsageError("--replicas must be at least 1.")
    if args.replicas > 1:
        try:
            import ray.serve  # noqa: F401
        except ImportError:
            raise UsageError("lazyrag serve --replicas needs Ray Serve: pip install 'lazyrag[replicas]'.") from None
        http = [f for f in ("allowed_origins", "ssl_certfile", "root_path") if getattr(args, f)]
        if http:
            raise UsageError(
                f"--{http[0].replace('_', '-')} is not supported with --replicas yet (Ray Serve's proxy takes "
                "the HTTP traffic): put the endpoint behind your gateway."
            )
        if (args.tensor_parallel_size or 1) > 1:
            raise UsageError(
                "--replicas with --tensor-parallel-size is not supported yet (a replica is one process): run "
                "one tensor-parallel server per set of GPUs, or replicas of a model that fits one device."
            )
    if args.store is not None:
        args.store = _check_store(args.store)
    _check_embedder(args)


def _check_demo(args) -> None:
    _check_model(args.model)
    if args.max_new_tokens <= 0 or args.orders <= 0:
        raise UsageError("--max-new-tokens and --orders must be positive.")
    for name in (args.strategies or "full").split(","):
        check_strategy(name)
    if args.strategies and "full" not in args.strategies.split(","):
        raise UsageError("--strategies must include full: it is the reference every answer is compared with.")


def _check_cache(args) -> None:
    from lazyrag.store.corpus import MANIFEST, StoreError

    if not (args.store / MANIFEST).is_file():
        raise StoreError(
            f"{args.store} is not a corpus store (no {MANIFEST}); build one with: "
            f"lazyrag precache CORPUS --out {args.store}"
        )


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def store_report(path: Path) -> dict:
    """What ``lazyrag cache --store`` shows: read from the manifest and the folder, no model, no index load."""
    import time

    from lazyrag.store.corpus import KV_DIR, read_manifest, rebuild_interrupted

    m = read_manifest(path)
    kv_bytes = _folder_bytes(path / KV_DIR)
    status = "half deleted by an interrupted precache --overwrite: rerun it" if rebuild_interrupted(path) else m.status
    return {
        "store": str(path),
        "status": status,
        "model": m.model_name,
        "model_fingerprint": m.model_fingerprint,
        "dtype": m.dtype,
        "stored_kv_dtype": m.stored_kv_dtype,
        "kv_shape": f"{m.num_layers} layers x {m.num_kv_heads} KV heads x {m.head_dim}",
        "block_size": m.block_size,
        "entries": m.num_chunks,
        "tokens": m.num_tokens,
        "prefix_tokens": len(m.prefix_ids),
        "kv_bytes": kv_bytes,
        "bytes_on_disk": _folder_bytes(path),
        # the KV files hold every chunk's tokens and, once, the shared prefix's
        "bytes_per_token": kv_bytes // (m.num_tokens + len(m.prefix_ids)) if m.num_tokens else None,
        "chunk_tokens": m.chunk_tokens,
        "overlap": m.overlap,
        "index": m.index_kind,
        "embedder": m.embedder,
        "layout_version": m.layout_version,
        "sources": len(m.sources),
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)),
    }


def _size(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _cache(args) -> int:
    import json

    report = store_report(args.store)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"corpus store {report['store']}", show_header=True, header_style="bold")
    table.add_column("field")
    table.add_column("value", overflow="fold")
    shown = {
        **report,
        "kv_bytes": f"{_size(report['kv_bytes'])} ({report['kv_bytes']} B)",
        "bytes_on_disk": f"{_size(report['bytes_on_disk'])} ({report['bytes_on_disk']} B)",
        "bytes_per_token": _size(report["bytes_per_token"]),
    }
    for key, value in shown.items():
        if key != "store":
            table.add_row(key.replace("_", " "), str(value))
    Console().print(table)
    return 0


def _tune_config(args):
    from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE
    from lazyrag.tune import TuneConfig

    passage = _passage(args).get("encoding_passage", DEFAULT_ENCODING_PASSAGE)
    data = dict(item.split("=", 1) for item in args.data)
    return TuneConfig(
        model=args.model,
        out=str(args.out),
        method=args.method,
        max_steps=args.max_steps,
        prompts_per_step=args.prompts_per_step,
        passages=tuple(int(x) for x in args.passages.split(",")),
        sets=tuple(args.sets.split(",")),
        data=data,
        learning_rate=args.lr,
        lora_rank=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        full_weight=args.full_weight,
        answer_tokens=args.answer_tokens,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        device=args.device,
        encoding_passage=passage,
        progress=True,
        time_limit=args.time_limit,
    )


def _check_tune(args) -> None:
    _check_model(args.model)
    if any("=" not in item for item in args.data):
        raise UsageError("--data takes SET=FILE, e.g. --data squad=squad_dev.jsonl.gz")
    try:
        if any(int(x) < 1 for x in args.passages.split(",")):
            raise ValueError
    except ValueError:
        raise UsageError(
            f"--passages takes positive whole numbers separated by commas; got {args.passages!r}"
        ) from None
    _require("lazyrag tune", "peft")
    _tune_config(args)  # the config's own checks (sets, steps, method) before the model loads


def _tune(args) -> int:
    from lazyrag.tune import tune

    print(tune(_tune_config(args)).summary())
    return 0


CHECKS = {
    "cache": _check_cache,
    "demo": _check_demo,
    "ask": _check_ask,
    "precache": _check_precache,
    "eval": _check_eval,
    "serve": _check_serve,
    "tune": _check_tune,
}


def _ask(args) -> int:
    from lazyrag.engine import LazyEngine, SamplingParams

    chunks = list(args.chunk)
    if args.chunks_file:  # checked before the model loads (_check_ask)
        chunks += [p.strip() for p in args.chunks_file.read_text().split("\n\n") if p.strip()]
    # under torchrun every rank but 0 serves rank 0 inside from_pretrained and exits there: only rank 0 prints
    engine = LazyEngine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, **_adapter(args), **_passage(args), **_tensor_parallel(args)
    )
    if args.store is not None:
        from lazyrag.store.retriever import Retriever

        store = engine.attach_store(args.store)  # StoreError (model mismatch, ...) is reported by main
        for hit in Retriever(store, args.embedder).retrieve(args.question, args.k):
            print(f"[retrieved {hit.score:.3f}] {hit.doc_id}: {hit.text[:90]!r}", file=sys.stderr)
            chunks.append(hit.text)
    stream = engine.stream(
        args.question,
        chunks,
        SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.stop, strategy=args.strategy),
        system=args.system,
    )
    for delta in stream:
        print(delta, end="", flush=True)
    r = stream.result()
    s = r.stats
    print(
        f"\n\n[{s.strategy}] TTFT {1e3 * r.ttft_s:.0f} ms, {s.new_tokens} tokens in {r.total_s:.2f} s; "
        f"chunks hit {s.chunks_hit}, missed {s.chunks_missed}; prefilled {s.tokens_prefilled} of {s.prompt_tokens} "
        "prompt tokens",
        file=sys.stderr,
    )
    engine.close()  # tensor parallelism: the other ranks exit
    return 0


def _precache(args) -> int:
    from lazyrag.engine import LazyEngine
    from lazyrag.prompt import DEFAULT_SYSTEM_PROMPT
    from lazyrag.store.build import PrecacheConfig, precache

    kw = {"kv_budget": args.kv_budget} if args.kv_budget else {}
    documents = _precache_documents(args.inputs)  # before the model loads: a folder that cannot be read fails at once
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
        **_adapter(args),
        system_prompt=args.system or DEFAULT_SYSTEM_PROMPT,
        **_passage(args),
        **kw,
    )
    print(precache(engine, config, documents=documents).summary())  # StoreError / ValueError are reported by main
    return 0


def _serve(args) -> int:
    if args.replicas > 1:
        return _serve_replicas(args)
    from lazyrag.engine import LazyEngine
    from lazyrag.model.loader import resolve_model_source
    from lazyrag.server import ServerConfig, run_server

    kw = {"kv_budget": args.kv_budget} if args.kv_budget else {}
    cache = _cache_fields(args)
    if cache:
        from lazyrag.kv.cache import CacheConfig

        kw["cache"] = CacheConfig(**cache)
    scheduler = _scheduler_fields(args)
    if scheduler:
        from lazyrag.engine import SchedulerConfig

        kw["scheduler"] = SchedulerConfig(**scheduler)
    print(f"lazyrag serve: loading {resolve_model_source(args.model).name}...", end=" ", file=sys.stderr, flush=True)
    engine = LazyEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        **kw,
        **_adapter(args),
        **_passage(args),
        **_tensor_parallel(args),
    )
    retriever = None
    if args.store is not None:
        from lazyrag.store.retriever import Retriever

        retriever = Retriever(engine.attach_store(args.store), args.embedder)
    print(f"ready in {time.perf_counter() - args.started:.1f} s", file=sys.stderr, flush=True)
    if args.seed is not None:
        from lazyrag.server.app import seed_sampling

        seed_sampling(args.seed)
    model_name, aliases = _served_names(args, engine.model_name)
    cors = (
        {
            "allowed_origins": tuple(args.allowed_origins),
            "allowed_methods": tuple(args.allowed_methods),
            "allowed_headers": tuple(args.allowed_headers),
            "allow_credentials": args.allow_credentials,
        }
        if args.allowed_origins
        else {}
    )
    config = ServerConfig(
        model_name=model_name,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        strategy=args.strategy,
        k=args.k,
        max_pending=args.max_pending,
        max_request_bytes=int(args.max_request_mb * (1 << 20)),
        body_timeout_s=args.body_timeout,
        api_key=args.api_key,
        api_key_covers=args.api_key_covers,
        aliases=aliases,
        pasted_context=args.pasted_context,
        max_model_len=args.max_model_len,
        **cors,
    )
    uvicorn = {
        k: v
        for k, v in (
            ("ssl_keyfile", args.ssl_keyfile),
            ("ssl_certfile", args.ssl_certfile),
            ("root_path", args.root_path),
            ("limit_concurrency", args.limit_concurrency),
        )
        if v
    }
    if args.disable_uvicorn_access_log:
        uvicorn["access_log"] = False
    scheme = "https" if args.ssl_certfile else "http"
    print(
        f"lazyrag serve: {config.model_name} on {engine.device} at "
        f"{scheme}://{args.host}:{args.port}{args.root_path or ''}/v1 (default strategy "
        f"{config.strategy}{', store ' + str(args.store.path) if args.store is not None else ''})",
        file=sys.stderr,
    )
    run_server(engine, config, args.host, args.port, retriever, args.log_level, **uvicorn)
    return 0


def _scheduler_fields(args) -> dict:
    """SchedulerConfig fields from vLLM's flags, those given."""
    fields = {
        "max_running": args.max_num_seqs,
        "max_prefill_tokens": args.max_num_batched_tokens,
        "long_prefill_tokens": args.long_prefill_token_threshold,
    }
    return {k: v for k, v in fields.items() if v is not None}


def _served_names(args, engine_name: str) -> tuple[str, tuple[str, ...]]:
    """(the model id responses carry, the other ids accepted), as vLLM names a served model: --served-model-name's
    names, else MODEL as the user wrote it (a hub id, a path) also answering to the model's own name and its
    aliases, else the model's name."""
    if args.served_model_name:
        return args.served_model_name[0], tuple(args.served_model_name[1:])
    if args.model is not None:
        names = (engine_name, *model_aliases(engine_name))
        return args.model, tuple(n for n in dict.fromkeys(names) if n != args.model)
    return engine_name, model_aliases(engine_name)


def model_aliases(name: str) -> tuple[str, ...]:
    from lazyrag.server.app import model_aliases as aliases

    return aliases(name)


def _cache_fields(args) -> dict:
    """CacheConfig fields from serve's flags (the host tier, the admission filter), those given."""
    fields = {"host_bytes": int(args.host_gb * (1 << 30)), "admission": args.cache_admission}
    return {k: v for k, v in fields.items() if v}


def _serve_replicas(args) -> int:
    from lazyrag.server.replicas import ReplicaSpec, run

    server = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "strategy": args.strategy,
        "k": args.k,
        "max_pending": args.max_pending,
        "pasted_context": args.pasted_context,
        "max_request_bytes": int(args.max_request_mb * (1 << 20)),
        "body_timeout_s": args.body_timeout,
    }
    if args.max_model_len:
        server["max_model_len"] = args.max_model_len
    if args.served_model_name or args.model is not None:
        from lazyrag.model.loader import resolve_model_source

        server["model_name"], server["aliases"] = _served_names(args, resolve_model_source(args.model).name)
    spec = ReplicaSpec(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_budget=args.kv_budget,
        **_passage(args),
        store=None if args.store is None else str(args.store.path),
        embedder=args.embedder,
        server=server,
        cache=_cache_fields(args),
        adapter=args.adapter,
        scheduler=_scheduler_fields(args),
        seed=args.seed,
    )
    print(
        f"lazyrag serve: {args.replicas} replicas ({args.router} routing) at http://{args.host}:{args.port}/v1; "
        "GET /routing shows each replica's state; Ctrl-C stops them",
        file=sys.stderr,
    )
    run(
        spec,
        args.replicas,
        args.router,
        args.host,
        args.port,
        args.ray_address,
        api_key=args.api_key,
        api_key_covers=args.api_key_covers,
    )
    return 0


def _quiet_loading(command: str) -> None:
    """No model-loading progress bars or library warnings on every start (``-v`` shows them)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # also turns off transformers' bars
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if command in ("ask", "serve"):
        # the GGUF reader's bar is a bare tqdm: only tqdm's own switch stops it
        os.environ.setdefault("TQDM_DISABLE", "1")
    elif command in ("precache", "eval"):
        # their own bars report the run's progress (--quiet there) and stay; the loader silences only the GGUF
        # reader's (model/loader.py; the variable reaches eval's worker processes too)
        os.environ.setdefault(QUIET_GGUF_ENV, "1")


def _usage_errors() -> tuple[type, ...]:
    """The errors whose message says what to do: bad input, a broken or mismatched store, a model that
    cannot load. (Read from the modules already imported: importing torch just to report is slow.)"""
    found = [ValueError, OSError]  # OSError: a full disk, a folder not writable, a file gone (its message names it)
    for module, name in (("lazyrag.store", "StoreError"), ("lazyrag.model.loader", "ModelLoadError")):
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


def _run(args) -> int:
    if args.command == "demo":
        from lazyrag.demo import run_demo

        kw = {"strategies": tuple(args.strategies.split(","))} if args.strategies else {}
        run_demo(args.model, args.device, args.max_new_tokens, args.orders, args.seed, json_out=args.json, **kw)
        return 0
    if args.command == "eval":
        from lazyrag.eval import run_eval

        args.out.parent.mkdir(parents=True, exist_ok=True)  # the checkpoint is written there from the first batch
        return run_eval(args, _passage(args))
    if args.command == "precache":
        done = _finished_store(args)
        if done:
            print(done)
            return 0
        return _precache(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "cache":
        return _cache(args)
    if args.command == "tune":
        return _tune(args)
    return _ask(args)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "config", None):
        try:
            args = _with_config(parser, argv, args)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    args.started = started  # serve's "ready in": the command's own time, the model load most of it
    if not args.verbose:
        _quiet_loading(args.command)
    if getattr(args, "no_model_cache", False):
        # through the environment, so it reaches every engine the command makes: eval's and tensor parallelism's
        # worker processes and the replicas' (model/checkpoint_cache.py)
        os.environ[MODEL_CACHE_ENV] = "0"
    try:
        CHECKS.get(args.command, lambda a: None)(args)
        return _run(args)
    except Exception as e:
        if args.debug or not isinstance(e, _usage_errors()):
            raise  # a bug, not a usage problem: the traceback is what is needed
        print(f"error: {e}", file=sys.stderr)
        print(f"(run `lazyrag {args.command} ... --debug` to see where it failed)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
