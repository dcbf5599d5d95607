"""Do two sets of `lazyrag eval` reports give full prefill the same answers, question by question?

Full prefill reads no cached chunk, so reports of another device or encoding pair with each other only if their full
answers agree; issue 30 paired an H100's reports with an H200's this way (benchmarks/NOTES.md). Failed requests are
left out. Prints, per set, the questions both answered and how many answers are identical.

    python benchmarks/full_answers_agree.py --a 'benchmarks/results/quality30/quality_{set}_report_gpu_h100*.json' \\
        --b 'benchmarks/results/quality30/quality_{set}_report_gpu_call*.json' \\
        --b 'benchmarks/results/quality30/quality_{set}_report_gpu_rest.json'
"""

import argparse
import glob
import json

from lazyrag.eval import failed_requests


def full_answers(patterns: list[str], name: str) -> dict[str, str]:
    """question -> full prefill's answer over the reports matching ``patterns`` ({set} = ``name``), first one wins."""
    out = {}
    for path in sorted(p for pattern in patterns for p in glob.glob(pattern.format(set=name))):
        with open(path) as f:
            run = json.load(f)
        failed = failed_requests(run, "full")
        for i, (q, a) in enumerate(zip(run["questions"], run["answers"]["full"])):
            if i not in failed:
                out.setdefault(q, a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", action="append", required=True, help="glob of one side's reports; {set} is each set's name")
    ap.add_argument("--b", action="append", required=True, help="glob of the other side's reports")
    ap.add_argument("--sets", default="nq,hotpotqa,squad,2wiki,musique")
    args = ap.parse_args()
    total = same = 0
    for name in args.sets.split(","):
        a, b = full_answers(args.a, name), full_answers(args.b, name)
        both = [q for q in a if q in b]
        agree = sum(a[q] == b[q] for q in both)
        print(f"{name:<10} {len(both):5d} answered by both, {agree:5d} identical")
        total, same = total + len(both), same + agree
    print(f"{'all':<10} {total:5d} answered by both, {same:5d} identical")


if __name__ == "__main__":
    main()
