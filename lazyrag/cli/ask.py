"""``lazyrag ask``: one question over the chunks given (or retrieved from a store), the answer streamed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lazyrag.cli.common import (
    HelpFormatter,
    UsageError,
    adapter_arg,
    adapter_kwargs,
    check_embedder,
    check_k,
    check_model,
    check_store,
    model_args,
    passage_arg,
    passage_kwargs,
    store_embedder_arg,
    tensor_parallel_arg,
    tensor_parallel_kwargs,
)
from lazyrag.strategy_names import check_strategy


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ask",
        help="answer one question over chunks you give",
        formatter_class=HelpFormatter,
        description="Answer one question over the given chunks and stream the answer.\n"
        "Chunks come from --chunk (repeatable) and/or --chunks-file (paragraphs separated by blank lines).",
    )
    model_args(p)
    adapter_arg(p)
    passage_arg(p)
    tensor_parallel_arg(p)
    p.add_argument("question")
    p.add_argument("--chunk", action="append", default=[], help="a chunk of context text (repeat for more)")
    p.add_argument("--chunks-file", type=Path, help="a text file; paragraphs separated by blank lines become chunks")
    p.add_argument(
        "--strategy",
        default="lazy",
        help="lazy (default: cached chunks read as they are, fastest), "
        "lazy+recover (lazy, plus about 15%% of chunk tokens recomputed in context, chosen by KV deviation x "
        "the question's attention: closer to full prefill's answers, see the docs' answer quality page), "
        "position_aware, prefix, full, or the recovery spelled out: lazy:first=K (each chunk's first K "
        "tokens recomputed), lazy:blend=R[:select=attn|attn_dev|chunk|gradual] (the fraction R of chunk tokens)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens in the answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens with this much probability",
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system prompt (part of the cached shared prefix)")
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="a corpus store from `lazyrag precache`: retrieve the question's top --k chunks from it "
        "and load their KV from disk instead of recomputing it",
    )
    p.add_argument("--k", type=int, default=5, help="chunks to retrieve from --store")
    store_embedder_arg(p)
    return p


def check(args) -> None:
    check_strategy(args.strategy)
    check_model(args.model)
    if args.chunks_file and not args.chunks_file.is_file():
        raise UsageError(
            f"--chunks-file {args.chunks_file} does not exist; pass a text file whose paragraphs "
            "(separated by blank lines) are the chunks."
        )
    if args.max_new_tokens <= 0 or args.k <= 0:
        raise UsageError("--max-new-tokens and --k must be positive.")
    check_k(args.k)
    if args.store is not None:
        args.store = check_store(args.store)  # opened once: the command attaches and searches this one
    check_embedder(args)


def run(args) -> int:
    from lazyrag.engine import LazyEngine, SamplingParams

    chunks = list(args.chunk)
    if args.chunks_file:  # checked before the model loads (check)
        chunks += [p.strip() for p in args.chunks_file.read_text().split("\n\n") if p.strip()]
    # under torchrun every rank but 0 serves rank 0 inside from_pretrained and exits there: only rank 0 prints
    engine = LazyEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        **adapter_kwargs(args),
        **passage_kwargs(args),
        **tensor_parallel_kwargs(args),
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
