"""Answer quality across evaluation sets, paired with full prefill, and the choice of the recovery.

Reads ``lazyrag eval`` reports (one per set and split; every strategy of a report answered the same
questions) and prints, per set, each strategy's accuracy and F1 minus full prefill's on the same
questions with the standard error of that mean difference, the share of chunk tokens recomputed,
and the mean over the sets. Writes OUT.json and OUT.png (one group of bars per strategy, one bar
per set).

    python benchmarks/quality_sets.py RUN.json [RUN.json ...] --out OUT.json [--select FILE]
        [--reference NAME] [--strategies A,B,...] [--common]

Several reports of one set and split (e.g. a later run with the chosen strategy added) are merged by
question; a strategy is paired with full on the questions both answered (a failed request is none). A report
whose engine encoded chunks other than after the default encoding passage names its strategies
``NAME@ENCODING``, full excepted (the passage changes no full prefill), so encodings are told apart when reports
of several are merged: ``@none`` without a passage (``"encoding_passage": "none"``, and every report written
before issue 30 added it), ``@one`` after the one-document passage that was the default at 8693e4f, ``@custom-...``
after a passage of the user's.

``--select FILE``: the selection rule, fixed before any report split was run (issue 30): among the
strategies other than full and lazy whose recomputed share is at most ``--max-recompute`` (15%) on
every set, the one with the highest mean over the sets of its paired accuracy difference; a tie
(within 0.1 point) goes to the higher mean F1 difference. Its name is written to FILE. Use it on the
tune splits only: the report splits are what the README quotes.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from lazyrag.eval import failed_requests


def paired(scores: dict[str, dict[str, list[float]]], reference: str = "full") -> dict[str, dict]:
    """Per strategy: mean accuracy and F1 (points) and their paired difference from ``reference``, with its
    standard error, over the questions both answered (``scores``: strategy -> metric -> one value a question,
    the questions in the same order for every strategy)."""
    ref = scores[reference]
    out = {}
    for s, mine in scores.items():
        row = {"n": len(mine["acc"])}
        for key, name in (("acc", "accuracy"), ("f1", "f1")):
            a = [100 * x for x in mine[key]]
            diff = [x - 100 * y for x, y in zip(a, ref[key])]
            row[name] = statistics.fmean(a)
            row[f"{name}_minus_{reference}"] = statistics.fmean(diff)
            row[f"{name}_minus_{reference}_se"] = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else 0.0
        out[s] = row
    return out


def print_paired(rows: dict[str, dict], reference: str = "full", width: int | None = None) -> None:
    """One table: each strategy's n, accuracy, F1, paired differences to ``reference`` (+- se) and recompute share."""
    width = width or max(len(s) for s in rows) + 2
    print(
        f"{'strategy':<{width}}{'n':>5}{'acc':>7}{'F1':>7}{'acc - ' + reference:>18}{'F1 - ' + reference:>18}"
        f"{'recomp%':>9}"
    )
    for s, r in rows.items():
        print(
            f"{s:<{width}}{r['n']:>5}{r['accuracy']:>7.1f}{r['f1']:>7.2f}"
            f"{r[f'accuracy_minus_{reference}']:>+11.2f} ± {r[f'accuracy_minus_{reference}_se']:.2f}"
            f"{r[f'f1_minus_{reference}']:>+11.2f} ± {r[f'f1_minus_{reference}_se']:.2f}"
            f"{r['recomputed_pct_of_chunk_tokens']:>9.1f}"
        )


def choose(table: dict[str, dict[str, dict]], max_recompute: float, reference: str = "full") -> tuple[str | None, dict]:
    """The selection rule of the module docstring over ``table`` (set -> strategy -> paired row with
    ``recomputed_pct_of_chunk_tokens``); returns the winner (None if no strategy qualifies) and each
    candidate's mean differences."""
    sets = list(table)
    common = set.intersection(*(set(rows) for rows in table.values())) - {reference, "lazy", "lazy@none"}
    means = {}
    for s in sorted(common):
        if all(table[d][s]["recomputed_pct_of_chunk_tokens"] <= max_recompute for d in sets):
            means[s] = {
                "accuracy": statistics.fmean(table[d][s][f"accuracy_minus_{reference}"] for d in sets),
                "f1": statistics.fmean(table[d][s][f"f1_minus_{reference}"] for d in sets),
                "worst_accuracy": min(table[d][s][f"accuracy_minus_{reference}"] for d in sets),
            }
    if not means:
        return None, means
    best = max(m["accuracy"] for m in means.values())
    tied = [s for s, m in means.items() if m["accuracy"] >= best - 0.1]
    return max(tied, key=lambda s: means[s]["f1"]), means


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="lazyrag eval reports (JSON with per-question scores)")
    ap.add_argument("--reference", default="full")
    ap.add_argument("--strategies", help="comma-separated: only these (and the reference) are tabled")
    ap.add_argument(
        "--common",
        action="store_true",
        help="pair every strategy on the same questions: those that "
        "all of them and the reference answered (e.g. to compare two encodings where one run lost some)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--select", type=Path, default=None, help="write the chosen recovery's name here")
    ap.add_argument("--max-recompute", type=float, default=15.0, help="percent of chunk tokens, on every set")
    args = ap.parse_args()

    # per set: strategy -> question -> (acc, f1), from every run of that set (runs of one set and split share
    # their question order, so a later run of more strategies or more questions adds to an earlier one); a
    # request that failed (scored 0, e.g. out of memory) is no answer: that question leaves that strategy's pairs
    answers, recomputed, failed, meta = {}, {}, {}, {}
    for path in args.runs:
        run = json.loads(path.read_text())
        if "scores" not in run:
            raise SystemExit(f"{path} has no per-question scores (written by an older lazyrag eval)")
        name = f"{run['dataset']} ({run.get('split', 'all')})"
        by_s, lost = answers.setdefault(name, {}), failed.setdefault(name, {})
        encoding = run.get("encoding_passage", "none")
        for s0, m in run["scores"].items():
            errors = failed_requests(run, s0)
            # full prefill reads no cached chunk
            s = f"{s0}@{encoding}" if encoding != "default" and s0 != "full" else s0
            mine = by_s.setdefault(s, {})
            for i, q in enumerate(run["questions"]):
                if i in errors:
                    lost.setdefault(s, set()).add(q)
                elif q not in mine:
                    mine[q] = (m["acc"][i], m["f1"][i])
            recomputed.setdefault(name, {}).setdefault(s, run["summary"][s0]["recomputed_pct_of_chunk_tokens"])
        meta.setdefault(name, {"files": [], "commands": []})
        meta[name]["files"].append(str(path))
        meta[name]["commands"].append(run.get("command"))
        meta[name]["device"] = run.get("device")
    table = {}
    for name, every in answers.items():
        by_s = every
        if args.strategies:
            keep = [args.reference] + [s for s in args.strategies.split(",") if s != args.reference]
            missing = [s for s in keep if s not in by_s]
            if missing:
                raise SystemExit(f"{name}: no answers of {', '.join(missing)} (there: {', '.join(by_s)})")
            by_s = {s: by_s[s] for s in keep}
        if args.common:
            both = set.intersection(*(set(m) for m in by_s.values()))
            by_s = {s: {q: a for q, a in m.items() if q in both} for s, m in by_s.items()}
        ref = by_s[args.reference]
        rows = {}
        for s, mine in by_s.items():
            common = [q for q in mine if q in ref]
            rows[s] = paired(
                {
                    s: {"acc": [mine[q][0] for q in common], "f1": [mine[q][1] for q in common]},
                    args.reference: {"acc": [ref[q][0] for q in common], "f1": [ref[q][1] for q in common]},
                },
                args.reference,
            )[s]
            rows[s]["recomputed_pct_of_chunk_tokens"] = recomputed[name][s]
        table[name] = rows
        unanswered = {q for s, qs in failed[name].items() for q in qs if q not in every[s]}  # failed in every run
        asked = set().union(*every.values()) | unanswered
        meta[name].update(
            n=len(set.intersection(*(set(m) for m in by_s.values()))), asked=len(asked), failed_left_out=len(unanswered)
        )
        if unanswered:
            print(
                f"warning: {name}: {len(unanswered)} of {len(asked)} questions had a failed request; each strategy "
                "is paired with full on the questions both answered",
                file=sys.stderr,
            )

    strategies = list(dict.fromkeys(s for rows in table.values() for s in rows))
    width = max(len(s) for s in strategies) + 2  # one width for every set's table
    for name, rows in table.items():
        print(f"\n{name}, {meta[name]['n']} questions answered by every strategy")
        print_paired(rows, args.reference, width)
    winner, means = choose(table, args.max_recompute, args.reference)
    spoiled = [name for name, m in meta.items() if m["failed_left_out"] > 0.05 * m["asked"]]
    if spoiled and args.select is not None:
        print(f"no choice written: over 5% of the questions failed in {', '.join(spoiled)}", file=sys.stderr)
        args.select = None
    print(f"\nmean over {len(table)} sets (strategies at <= {args.max_recompute:g}% recomputed on every set):")
    for s, m in sorted(means.items(), key=lambda kv: -kv[1]["accuracy"]):
        print(f"  {s:<{width}} acc {m['accuracy']:+.2f}  F1 {m['f1']:+.2f}  worst set acc {m['worst_accuracy']:+.2f}")
    print(f"chosen: {winner}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "reference": args.reference,
                "sets": meta,
                "paired": table,
                "means": means,
                "max_recompute_pct": args.max_recompute,
                "chosen": winner,
            },
            indent=2,
        )
    )
    if args.select is not None and winner is not None:
        args.select.write_text(winner + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s in strategies if s != args.reference]
    sets = list(table)
    w = 0.8 / len(sets)
    fig, axes = plt.subplots(1, 2, figsize=(2.2 * len(names) + 3, 4), sharey=False)
    for ax, key in zip(axes, ("accuracy", "f1")):
        for j, d in enumerate(sets):
            xs = [i + (j - (len(sets) - 1) / 2) * w for i in range(len(names))]
            rows = table[d]
            ax.bar(
                xs,
                [rows[s][f"{key}_minus_{args.reference}"] if s in rows else 0 for s in names],
                width=w,
                yerr=[rows[s][f"{key}_minus_{args.reference}_se"] if s in rows else 0 for s in names],
                capsize=2,
                label=d,
            )
        ax.axhline(-1 if key == "accuracy" else -0.5, color="grey", linestyle="--", linewidth=0.8, label="target")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)), [s.replace(":", ":\n", 2) for s in names], fontsize=6)
        ax.set_title(f"{key} - {args.reference} (paired, +- 1 se)", fontsize=9)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
