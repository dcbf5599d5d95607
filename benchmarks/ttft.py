"""Time to first token over HotpotQA prompts: each strategy side by side, chunks already cached.

Each item's 10 paragraphs are the chunks (in a new shuffled order for every timed run, so
only position-free reuse can hit), plus the question. Prints a table, writes JSON.

    python benchmarks/ttft.py --items 5 --repeats 5             # CPU, embedded default model
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "hotpotqa_dev_500.jsonl"


def load_items(path: Path, n: int) -> list[dict]:
    items = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if len(row["contexts"]) == 10:
                items.append(
                    {"question": row["question_text"], "chunks": [c["paragraph_text"] for c in row["contexts"]]}
                )
            if len(items) == n:
                break
    return items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--items", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--strategies", default="full,prefix,position_aware,lazy")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ttft_cpu.json")
    args = ap.parse_args()
    if not args.data.is_file():
        print(f"skipped: {args.data} not found (the shared evaluation data sits beside the repository)")
        return 0

    from lazyrag.engine import LazyEngine

    engine = LazyEngine.from_pretrained(args.model, device=args.device)
    items = load_items(args.data, args.items)
    strategies = args.strategies.split(",")
    rng = random.Random(0)
    runs = {s: [] for s in strategies}
    rows = []
    for item in items:
        engine.precache(item["chunks"])
        # warm-up: one request per strategy so position-aware copies and prefix blocks exist for *some* order
        for s in strategies:
            engine.generate(item["question"], item["chunks"], max_new_tokens=1, strategy=s)
        per = {s: [] for s in strategies}
        for _ in range(args.repeats):
            chunks = item["chunks"][:]
            rng.shuffle(chunks)
            for s in strategies:
                r = engine.generate(item["question"], chunks, max_new_tokens=1, strategy=s)
                per[s].append({"ttft_s": r.ttft_s, **r.stats.as_dict()})
        for s in strategies:
            runs[s] += per[s]
        rows.append(
            {
                "question": item["question"],
                "prompt_tokens": per[strategies[0]][0]["prompt_tokens"],
                **{f"{s}_ms": 1e3 * statistics.median(x["ttft_s"] for x in per[s]) for s in strategies},
            }
        )

    summary = {
        s: {
            "median_ttft_ms": 1e3 * statistics.median(x["ttft_s"] for x in runs[s]),
            "median_tokens_prefilled": statistics.median(x["tokens_prefilled"] for x in runs[s]),
        }
        for s in strategies
    }
    if "full" in summary:
        for s in strategies:
            summary[s]["speedup_vs_full"] = summary["full"]["median_ttft_ms"] / summary[s]["median_ttft_ms"]

    print(
        f"\nTTFT (ms), median of {args.repeats} shuffled orders per item; model {engine.model_name} on {engine.device}"
    )
    print(f"{'item':>4} {'tokens':>6} " + " ".join(f"{s:>15}" for s in strategies))
    for i, r in enumerate(rows):
        print(f"{i:>4} {r['prompt_tokens']:>6} " + " ".join(f"{r[s + '_ms']:>15.1f}" for s in strategies))
    print(f"{'all':>4} {'':>6} " + " ".join(f"{summary[s]['median_ttft_ms']:>15.1f}" for s in strategies))
    if "full" in summary:
        print(f"{'x':>4} {'':>6} " + " ".join(f"{summary[s]['speedup_vs_full']:>14.1f}x" for s in strategies))

    result = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": f"{engine.device} / {platform.processor() or platform.machine()} / {torch.get_num_threads()} threads",
        "model": engine.model_name,
        "dtype": str(engine.dtype),
        "attention": engine.attention_backend,
        "items": len(items),
        "repeats": args.repeats,
        "summary": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
