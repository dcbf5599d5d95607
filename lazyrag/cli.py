"""The ``lazyrag`` command."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
lazyrag answers questions over retrieved chunks while reusing each chunk's KV cache at
whatever position the chunk lands in the prompt: every chunk is encoded once, stored once,
and its positional rotation is applied lazily inside attention.
"""

EPILOG = """\
examples:
  lazyrag demo                                  # offline, CPU, embedded SmolLM2-135M-Instruct
  lazyrag ask "Who discovered penicillin?" --chunk "Fleming found penicillin in 1928." --chunk "Tea came to Britain in 1662."
  lazyrag ask "..." --chunks-file notes.txt --strategy full     # compare with a plain full prefill
  lazyrag ask "..." --chunks-file notes.txt --model ~/models/Llama-3.1-8B-Instruct --device cuda

strategies (--strategy): lazy (default, ours), position_aware (a re-rotated copy per position),
prefix (exact token-prefix reuse only), full (no reuse; the quality reference).
"""


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Llama folder (config.json + safetensors) or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazyrag", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="offline demo: cache a bundled corpus, answer 3 questions, compare TTFT full vs lazy",
                          description="Caches a small bundled corpus once, then answers three questions with the cached chunks "
                                      "stitched in shuffled orders, streaming the answers, and prints time to first token of a "
                                      "full prefill versus lazy stitching side by side.")
    _model_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--repeats", type=int, default=3, help="shuffled orders timed per question (median reported)")
    demo.add_argument("--seed", type=int, default=0)

    ask = sub.add_parser("ask", help="answer one question over chunks you give", formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Answer one question over the given chunks and stream the answer.\n"
                                     "Chunks come from --chunk (repeatable) and/or --chunks-file (paragraphs separated by blank lines).")
    _model_args(ask)
    ask.add_argument("question")
    ask.add_argument("--chunk", action="append", default=[], help="a chunk of context text (repeat for more)")
    ask.add_argument("--chunks-file", type=Path, help="a text file; paragraphs separated by blank lines become chunks")
    ask.add_argument("--strategy", default="lazy", help="lazy (default), position_aware, prefix, full, lazy:first=K "
                     "(lazy, recomputing each chunk's first K tokens in context for quality) or lazy:blend=R "
                     "(recomputing the fraction R of chunk tokens whose KV deviates most, CacheBlend)")
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ask.add_argument("--top-p", type=float, default=1.0)
    ask.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ask.add_argument("--system", default=None, help="system prompt (part of the cached shared prefix)")
    ask.add_argument("--store", type=Path, default=None,
                     help="a corpus store from `lazyrag precache`: retrieve the question's top --k chunks from it "
                          "and load their KV from disk instead of recomputing it")
    ask.add_argument("--k", type=int, default=5, help="chunks to retrieve from --store")
    from lazyrag.store.build import add_precache_parser

    add_precache_parser(sub)
    from lazyrag.eval import add_eval_parser

    add_eval_parser(sub)
    return parser


def _ask(args) -> int:
    from lazyrag.engine import LazyEngine
    from lazyrag.engine import SamplingParams

    chunks = list(args.chunk)
    if args.chunks_file:
        if not args.chunks_file.is_file():
            print(f"error: --chunks-file {args.chunks_file} does not exist", file=sys.stderr)
            return 2
        chunks += [p.strip() for p in args.chunks_file.read_text().split("\n\n") if p.strip()]
    engine = LazyEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    if args.store is not None:
        from lazyrag.store.retriever import Retriever
        from lazyrag.store import StoreError

        try:
            store = engine.attach_store(args.store)
        except StoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for hit in Retriever(store).retrieve(args.question, args.k):
            print(f"[retrieved {hit.score:.3f}] {hit.doc_id}: {hit.text[:90]!r}", file=sys.stderr)
            chunks.append(hit.text)
    stream = engine.stream(args.question, chunks, SamplingParams(args.max_new_tokens, args.temperature, args.top_p,
                                                                 args.stop, strategy=args.strategy), system=args.system)
    for delta in stream:
        print(delta, end="", flush=True)
    r = stream.result()
    s = r.stats
    print(f"\n\n[{s.strategy}] TTFT {1e3 * r.ttft_s:.0f} ms, {s.new_tokens} tokens in {r.total_s:.2f} s; "
          f"chunks hit {s.chunks_hit}, missed {s.chunks_missed}; prefilled {s.tokens_prefilled} of {s.prompt_tokens} prompt tokens",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from lazyrag.model.loader import ModelLoadError

    try:
        if args.command == "demo":
            from lazyrag.demo import run_demo

            run_demo(args.model, args.device, args.max_new_tokens, args.repeats, args.seed)
            return 0
        if args.command == "eval":
            from lazyrag.eval import run_eval

            return run_eval(args)
        if args.command == "precache":
            from lazyrag.store.build import run_precache

            return run_precache(args)
        if args.command == "ask":
            return _ask(args)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
