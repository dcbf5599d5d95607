"""How long an abort can wait: one long prompt (``full``, no cached chunks) prefilled whole or in pieces of
``--pieces`` tokens (``SchedulerConfig.long_prefill_tokens``), the scheduler stepped by hand; each step's time is
how long an abort (or a newly arrived request) waits at most. Variants alternate, ``--reps`` each.

    python benchmarks/long_prefill.py                        # embedded model, CPU, ~7.5k tokens, 2048 vs whole
Prints a table and writes JSON (``--out``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one(engine, layout, piece: int) -> list[float]:
    from dataclasses import replace

    from lazyrag.engine import SamplingParams

    sched = engine.scheduler
    sched.config = replace(sched.config, long_prefill_tokens=piece)
    steps = []
    req = engine.add_request(layout, SamplingParams(max_new_tokens=1, strategy="full"))
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    assert req.done and req.error is None, req.error
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chars", type=int, default=14400, help="characters of filler text (~0.52 tokens each)")
    ap.add_argument("--pieces", type=int, nargs="+", default=[2048, 1 << 30], help="piece sizes (1<<30: whole)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/long_prefill_cpu.json"))
    args = ap.parse_args()

    from lazyrag.engine import LazyEngine

    engine = LazyEngine.from_pretrained(None)
    filler = " ".join(f"word{i}" for i in range(args.chars))[: args.chars]
    layout = engine.build_prompt(filler + " What is this?", [])
    runs: dict[int, list[list[float]]] = {p: [] for p in args.pieces}
    for _ in range(args.reps):
        for p in args.pieces:
            runs[p].append(one(engine, layout, p))
    rows = []
    for p, reps in runs.items():
        totals, longest = [sum(r) for r in reps], [max(r) for r in reps]
        rows.append(
            {
                "piece_tokens": p if p < 1 << 30 else None,
                "steps": len(reps[0]),
                "total_s_median": statistics.median(totals),
                "longest_step_s_median": statistics.median(longest),
                "step_s": reps,
            }
        )
    print(f"{layout.num_tokens}-token prompt, {engine.device}, {args.reps} reps (alternated)")
    print(f"{'piece':>8} {'steps':>6} {'total s':>9} {'longest step s':>15}")
    for r in rows:
        print(
            f"{r['piece_tokens'] or 'whole':>8} {r['steps']:>6} {r['total_s_median']:>9.1f} "
            f"{r['longest_step_s_median']:>15.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "prompt_tokens": layout.num_tokens,
                "device": str(engine.device),
                "command": "python " + " ".join(sys.argv),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
