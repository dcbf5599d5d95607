"""Paired comparison of ``lazyrag eval`` runs on the same questions: each strategy's accuracy and F1
minus the reference's (full prefill), question by question, with the standard error of that mean
difference (what "within 1 point of full" needs: the strategies' own +-1.7-point sampling noise
at n = 500 mostly cancels in the difference).

    python benchmarks/quality_paired.py --dataset nq --n 500 RUN.json [RUN.json ...] --out OUT.json

A run made with ``--adapter`` (JSON field ``adapter``) shows as "tuned STRATEGY", so base and tuned runs of
the same questions pair up. Runs are matched by question (JSON written since the runs list their questions) or, for
older JSON, by position in the item list that --dataset/--n/--seed rebuild. A failed request (the report's
``errors``) has no answer: each strategy is paired with the reference on the questions both answered, so ``n``
may differ between rows. A run cut short by its time limit pairs on what it answered: pass its RUN.partial.jsonl
(a tuned run's checkpoint names its adapter; ``--tuned`` marks the runs of an eval that did not record it yet).
Writes OUT.json and OUT.png.
"""

import argparse
import json
import sys
from pathlib import Path

from quality_sets import paired, print_paired  # noqa: E402  (benchmarks/ is on the path when run as a script)

from lazyrag.eval import (
    DATASETS,
    SPLITS,
    Checkpoint,
    accuracy,
    default_data,
    f1,
    failed_requests,
    load_dataset,
    summarize,
)


def load_run(path: Path, tuned: bool) -> dict:
    """An eval report, or what a stopped eval's checkpoint (``.partial.jsonl``) holds, in the report's form."""
    if not path.name.endswith(".partial.jsonl"):
        run = json.loads(path.read_text())
    else:
        header = json.loads(path.read_text().splitlines()[0])
        saved = Checkpoint(path, header, resume=True)
        run = summarize(saved.per_strategy(header["strategies"]))
        run.update(n=len(saved.rows), adapter=header.get("adapter_sha256"))
    if tuned:
        run["adapter"] = run.get("adapter") or "tuned"
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--dataset", choices=DATASETS, default="nq")
    ap.add_argument("--split", choices=SPLITS, default="all")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shuffle", action="store_true", help="the runs shuffled the paragraphs")
    ap.add_argument("--reference", default="full")
    ap.add_argument("--tuned", type=Path, nargs="*", default=[], help="runs of a tuned model whose files do not say so")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    items = load_dataset(
        args.dataset, default_data(args.dataset), args.n, split=args.split, seed=args.seed, shuffle=args.shuffle
    )
    golds = {it["question"]: it["answers"] for it in items}
    answers: dict[str, dict[str, str]] = {}  # strategy -> question -> answer
    recomputed: dict[str, float] = {}
    for path in args.runs:
        run = load_run(path, path in args.tuned)
        questions = run.get("questions") or [it["question"] for it in items[: run["n"]]]
        for s, texts in run["answers"].items():
            label = f"tuned {s}" if run.get("adapter") else s  # a tuned model's run beside the base model's
            failed = failed_requests(run, s)  # no answer: left out of every pair, not scored as wrong
            answers[label] = {q: t for i, (q, t) in enumerate(zip(questions, texts)) if i not in failed}
            recomputed[label] = run["summary"][s]["recomputed_pct_of_chunk_tokens"]
    rows = {}
    for s, by_q in answers.items():  # each strategy against the reference on the questions both answered
        common = [q for q in answers[args.reference] if q in golds and q in by_q]
        if not common:
            print(f"{s}: no question that it and {args.reference} both answered", file=sys.stderr)
            continue
        pair = {args.reference: answers[args.reference], s: by_q}
        scores = {
            name: {"acc": [accuracy(a[q], golds[q]) for q in common], "f1": [f1(a[q], golds[q]) for q in common]}
            for name, a in pair.items()
        }
        rows[s] = paired(scores, args.reference)[s]
    for s, row in rows.items():
        row["recomputed_pct_of_chunk_tokens"] = recomputed[s]
    print_paired(rows, args.reference)
    args.out.write_text(
        json.dumps(
            {
                "dataset": args.dataset,
                "split": args.split,
                "n": args.n,
                "seed": args.seed,
                "reference": args.reference,
                "runs": [str(p) for p in args.runs],
                "paired": rows,
            },
            indent=2,
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s in rows if s != args.reference]
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 3.6))
    for off, key in ((-0.2, "accuracy"), (0.2, "f1")):
        ax.bar(
            [i + off for i in range(len(names))],
            [rows[s][f"{key}_minus_{args.reference}"] for s in names],
            width=0.4,
            yerr=[rows[s][f"{key}_minus_{args.reference}_se"] for s in names],
            capsize=3,
            label=f"{key} - {args.reference}",
        )
    ax.axhline(-1, color="grey", linestyle="--", linewidth=0.8, label="-1 point")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(
        range(len(names)),
        [f"{s}\n{rows[s]['recomputed_pct_of_chunk_tokens']:.0f}% recomputed" for s in names],
        fontsize=7,
    )
    ax.set_ylabel("points (paired, +- 1 se)")
    ax.set_title(f"{args.dataset}, paired with {args.reference}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
