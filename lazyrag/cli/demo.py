"""``lazyrag demo``: the bundled corpus answered with full prefill, lazy stitching and the recovery, side by side."""

from __future__ import annotations

import argparse

from lazyrag.cli.common import HelpFormatter, UsageError, check_model, model_args
from lazyrag.strategy_names import check_strategy


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="offline demo: cached chunks, answers of full / lazy / recovery marked right or wrong, TTFT",
        formatter_class=HelpFormatter,
        description="Caches a small bundled corpus once, then answers its 8 questions over the cached "
        "chunks in shuffled orders with a full prefill (the quality reference), plain lazy "
        "stitching and the demo's recovery, streaming each answer, marking it right or wrong "
        "against the expected answer and printing its time to first token. Ends with a table "
        "per strategy and says where the embedded 135M model fails even with full prefill.",
    )
    model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer (default: %(default)s)")
    p.add_argument("--orders", type=int, default=1, help="shuffled chunk orders per question (default: %(default)s)")
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies to compare (default: full,lazy,lazy+recover; see `lazyrag ask --help`)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the chunk shuffles (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every answer and the summary to PATH")
    return p


def check(args) -> None:
    check_model(args.model)
    if args.max_new_tokens <= 0 or args.orders <= 0:
        raise UsageError("--max-new-tokens and --orders must be positive.")
    for name in (args.strategies or "full").split(","):
        check_strategy(name)
    if args.strategies and "full" not in args.strategies.split(","):
        raise UsageError("--strategies must include full: it is the reference every answer is compared with.")


def run(args) -> int:
    from lazyrag.demo import run_demo

    kw = {"strategies": tuple(args.strategies.split(","))} if args.strategies else {}
    run_demo(args.model, args.device, args.max_new_tokens, args.orders, args.seed, json_out=args.json, **kw)
    return 0
