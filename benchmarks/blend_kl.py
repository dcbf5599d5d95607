"""Next-token KL divergence from full prefill of lazy, first-K and blend variants: a low-noise proxy for
answer quality (NQ gold + 4 distractors, embedded SmolLM2, CPU). Variants of the deviation measure and
selection layer are tried by swapping engine/blend.py's module-level pieces.

    python benchmarks/blend_kl.py 40        # -> stdout; this session's run: benchmarks/results/blend_kl_cpu_log.txt
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lazyrag.engine.blend as blend  # noqa: E402
from lazyrag.engine import LazyEngine  # noqa: E402
from lazyrag.eval import DATA, load_nq  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("n", type=int, nargs="?", default=40, help="NQ questions (default 40)")
n = ap.parse_args().n
e = LazyEngine.from_pretrained(None, device="cpu")
items = load_nq(DATA / "nq_open_oracle_2655.jsonl.gz", n, 4, 0)
dev = {
    "kv": blend.kv_deviation,
    "v": lambda k, v, kc, vc: ((v.float() - vc) ** 2).sum((1, 2)),
    "k": lambda k, v, kc, vc: ((k.float() - kc) ** 2).sum((1, 2)),
}
variants = [  # (label, strategy, deviation, selection layer)
    ("lazy", "lazy", "kv", 1), ("first=16", "lazy:first=16", "kv", 1), ("first=32", "lazy:first=32", "kv", 1),
    ("blend=0.15 kv L1", "lazy:blend=0.15", "kv", 1), ("blend=0.15 v L1", "lazy:blend=0.15", "v", 1),
    ("blend=0.15 k L1", "lazy:blend=0.15", "k", 1), ("blend=0.15 kv L2", "lazy:blend=0.15", "kv", 2),
    ("blend=0.15 kv L4", "lazy:blend=0.15", "kv", 4), ("blend=0.15 chunk", "lazy:blend=0.15:select=chunk", "kv", 1),
    ("blend=0.1", "lazy:blend=0.1", "kv", 1), ("blend=0.2", "lazy:blend=0.2", "kv", 1), ("blend=0.3", "lazy:blend=0.3", "kv", 1),
    ("first=8:blend=0.1", "lazy:first=8:blend=0.1", "kv", 1),
]
kl = {v[0]: [] for v in variants}
top1 = {v[0]: 0 for v in variants}
t = time.time()
for it in items:
    e.precache(it["chunks"])
    lay = e.build_prompt(it["question"], it["chunks"])
    ref = e.layout_logits(lay, "full").log_softmax(-1)
    for label, s, d, layer in variants:
        blend.kv_deviation, blend.SELECTION_LAYER = dev[d], layer
        lp = e.layout_logits(lay, s).log_softmax(-1)
        kl[label].append(float((ref.exp() * (ref - lp)).sum()))
        top1[label] += int(lp.argmax() == ref.argmax())
print(f"n={n}, {time.time() - t:.0f} s")
for label, _, _, _ in variants:
    x = torch.tensor(kl[label])
    print(f"{label:<20} KL mean {x.mean():.4f} median {x.median():.4f}  top1 = full {100 * top1[label] / n:.0f}%")
