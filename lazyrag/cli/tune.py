"""``lazyrag tune``: adapt a model so that its answers over cached chunks (lazy) match a full prefill's."""

from __future__ import annotations

import argparse
from pathlib import Path

from lazyrag.cli.common import MODEL_HELP, HelpFormatter, UsageError, check_model, passage_arg, passage_kwargs, require

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


def add_parser(subparsers) -> argparse.ArgumentParser:
    from lazyrag import eval as quality

    p = subparsers.add_parser(
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
        "--keep-activations",
        action="store_true",
        help="keep every layer's activations for the backward instead of recomputing them: one forward less a "
        "step, several times the memory (a small model on a large GPU)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long: checkpoint and write the adapter as far as it got (rerun to go on)",
    )
    passage_arg(p)
    return p


def tune_config(args):
    """The TuneConfig the command's arguments ask for."""
    from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE
    from lazyrag.tune import TuneConfig

    passage = passage_kwargs(args).get("encoding_passage", DEFAULT_ENCODING_PASSAGE)
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
        activation_checkpointing=not args.keep_activations,
    )


def check(args) -> None:
    check_model(args.model)
    if any("=" not in item for item in args.data):
        raise UsageError("--data takes SET=FILE, e.g. --data squad=squad_dev.jsonl.gz")
    try:
        if any(int(x) < 1 for x in args.passages.split(",")):
            raise ValueError
    except ValueError:
        raise UsageError(
            f"--passages takes positive whole numbers separated by commas; got {args.passages!r}"
        ) from None
    require("lazyrag tune", "peft")
    tune_config(args)  # the config's own checks (sets, steps, method) before the model loads


def run(args) -> int:
    from lazyrag.tune import tune

    print(tune(tune_config(args)).summary())
    return 0
