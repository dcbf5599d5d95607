"""``lazyrag eval``: answer quality of the strategies side by side on QA sets (lazyrag.eval does the work)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lazyrag import eval as quality  # no torch: the command's description is the module's docstring
from lazyrag.cli.common import (
    MODEL_HELP,
    HelpFormatter,
    UsageError,
    adapter_arg,
    check_embedder,
    check_k,
    check_model,
    check_store,
    model_cache_arg,
    passage_arg,
    passage_kwargs,
    size_arg,
    store_embedder_arg,
)
from lazyrag.eval import EvalConfig
from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE
from lazyrag.strategy_names import check_strategy


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
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
    passage_arg(p)
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
    _strategy_args(p)
    _engine_args(p)
    _run_args(p)
    return p


def _strategy_args(p: argparse.ArgumentParser) -> None:
    """Retrieval mode, and what is scored."""
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="nq retrieval mode: chunks are the top --k of this corpus store (lazyrag precache), not gold + "
        "distractors",
    )
    p.add_argument("--k", type=int, default=5, help="retrieval mode: chunks per question")
    store_embedder_arg(p)
    p.add_argument(
        "--strategies",
        default=",".join(quality.DEFAULT_STRATEGIES),
        help="comma-separated: full, prefix, position_aware, lazy, lazy+recover (the named recovery, "
        "= lazy:blend=0.15:select=attn_dev), lazy:first=K (each chunk's first K tokens "
        "recomputed in context), lazy:blend=R (CacheBlend: the fraction R of chunk tokens whose KV deviates "
        "most; add :select=S to choose otherwise: chunk = R of each chunk, attn = by the question's attention, "
        "attn_dev = deviation x attention, gradual = CacheBlend's 2-stage filter; :budget=chunk = R of each chunk; "
        ":attn_from=F = the question's attention from depth F of the layers on), or both, "
        "e.g. lazy:first=4:blend=0.12:select=attn_dev",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer")


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Batches, workers and the engine each one loads."""
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
        type=size_arg("--kv-budget"),
        default=None,
        metavar="SIZE",
        help="each worker's paged KV pool: 4GiB, 512MB, or a bare number of GiB (default: 8GiB on cuda, 1GiB on "
        "cpu); lower it to run more workers",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the question sample and the distractors")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    adapter_arg(p)
    model_cache_arg(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _run_args(p: argparse.ArgumentParser) -> None:
    """Time limits, resuming, the dtype and the report."""
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


def check(args) -> None:
    check_model(args.model)
    if args.n <= 0 or args.batch <= 0 or args.workers <= 0 or args.max_new_tokens <= 0 or (args.kv_budget or 1) <= 0:
        raise UsageError("--n, --batch, --workers, --max-new-tokens and --kv-budget must be positive.")
    if args.passages is not None and (args.passages < 1 or args.store is not None):
        raise UsageError("--passages must be at least 1, and takes no --store (retrieval chooses the passages there).")
    check_k(args.k)
    for name in args.strategies.split(","):
        check_strategy(name)
    if args.store is not None:
        args.store = check_store(args.store)  # opened once: the command attaches and searches this one
    check_embedder(args)
    for report in args.skip_answered or ():
        if not report.is_file():
            raise UsageError(f"--skip-answered: {report} does not exist; pass lazyrag eval reports (JSON).")


def eval_config(args) -> EvalConfig:
    """The EvalConfig the command's arguments ask for (``--encoding-passage`` read: the store's, a file's text)."""
    return EvalConfig(
        dataset=args.dataset,
        data=args.data,
        split=args.split,
        n=args.n,
        seed=args.seed,
        distractors=args.distractors,
        passages=args.passages,
        shuffle=args.shuffle,
        skip_answered=tuple(args.skip_answered or ()),
        store=args.store,
        k=args.k,
        embedder=args.embedder,
        strategies=tuple(args.strategies.split(",")),
        max_new_tokens=args.max_new_tokens,
        model=args.model,
        adapter=args.adapter,
        device=args.device,
        dtype=args.dtype,
        kv_budget=args.kv_budget,
        encoding_passage=passage_kwargs(args).get("encoding_passage", DEFAULT_ENCODING_PASSAGE),
        eager=args.eager,
        batch=args.batch,
        workers=args.workers,
        time_limit=args.time_limit,
        resume=args.resume,
        out=args.out,
    )


def run(args) -> int:
    config = eval_config(args)
    config.out.parent.mkdir(parents=True, exist_ok=True)  # the checkpoint is written there from the first batch
    return quality.run_eval(config)
