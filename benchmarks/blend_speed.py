"""Time to plan one recovery request (``lazy:blend=...``: the dense recompute in engine/blend.py), per request,
for this tree's blend code and, side by side, an older blend.py (e.g. from git history), on random weights of
the embedded model's shape (SmolLM2-135M: 30 layers, 576 wide) with real NQ prompts.

    git show fab734e:lazyrag/engine/blend.py > /tmp/blend_old.py
    python benchmarks/blend_speed.py --tokenizer DIR --old /tmp/blend_old.py [--n 32] [--device cuda] --out OUT.json

Each variant plans the same requests (gold passage + 4 distractors, chunks cached beforehand), eagerly (the
eval's --eager), with a device sync around each plan; the table gives the median and mean ms a request and
old / new. Both variants must pick the same tokens: the script checks it. Prints a table, writes JSON.
"""
import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as the other benchmarks: the repository before benchmarks/

import torch

import lazyrag.engine.blend as blend
from benchmarks.eval_speed import embedded_model_shape
from lazyrag.engine import LazyEngine
from lazyrag.eval import DATA, load_nq

STRATEGIES = ["lazy:blend=0.15", "lazy+recover"]


def load_old(path: Path):
    spec = importlib.util.spec_from_file_location("blend_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["blend_old"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.selective_recompute


def recording(selective_recompute, picks: list):
    """``selective_recompute`` that also appends each request's recomputed tokens to ``picks``."""
    def run(*args, **kwargs):
        b = selective_recompute(*args, **kwargs)
        picks.append(b.selected.tolist())
        return b
    return run


def time_plan(engine, layout, strategy: str, sync) -> float:
    """ms to plan ``layout`` with ``strategy`` (its blocks given back after)."""
    planner = engine.scheduler.planner[strategy]
    sync()
    t = time.perf_counter()
    plan = planner.plan(layout)
    sync()
    ms = 1e3 * (time.perf_counter() - t)
    planner.release(plan)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer folder (default: the embedded model's, from its GGUF)")
    ap.add_argument("--old", type=Path, default=None, help="an older engine/blend.py to time side by side")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data", type=Path, default=DATA / "nq_open_oracle_2655.jsonl.gz")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/blend_speed.json"))
    args = ap.parse_args()
    cfg, tok = embedded_model_shape(args.tokenizer)
    engine = LazyEngine.from_config(cfg, tok, device=args.device, dtype="float32", cuda_graphs=False, compile_elementwise=False)
    sync = torch.cuda.synchronize if engine.config.device.type == "cuda" else (lambda: None)
    items = load_nq(args.data, args.n + 2, 4, 0)
    layouts = [engine.build_prompt(it["question"], it["chunks"]) for it in items]
    for layout in layouts:
        engine.encode_chunks(layout.chunk_ids, layout.encoding_prefix)
    variants = {"new": blend.selective_recompute}
    if args.old is not None:
        variants["old"] = load_old(args.old)
    rows, picks = [], {}
    for strategy in STRATEGIES:
        times = {name: [] for name in variants}
        for name, fn in variants.items():  # warm-up: kernels compiled, caches filled
            blend.selective_recompute = fn  # reuse.py imports it from the module at each call
            for layout in layouts[:2]:
                time_plan(engine, layout, strategy, sync)
        for i, layout in enumerate(layouts[2:]):  # the variants take turns, first one then the other
            for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
                blend.selective_recompute = recording(variants[name], picks.setdefault((strategy, name), []))
                times[name].append(time_plan(engine, layout, strategy, sync))
        for name, ts in times.items():
            rows.append({"strategy": strategy, "variant": name, "median_ms": statistics.median(ts),
                         "mean_ms": statistics.fmean(ts), "n": len(ts)})
    blend.selective_recompute = variants["new"]
    same = all(picks[(s, "new")] == picks[(s, "old")] for s in STRATEGIES) if "old" in variants else None
    device = torch.cuda.get_device_name() if engine.config.device.type == "cuda" else "cpu"
    print(f"{device}, eager, fp32, {args.n} NQ prompts (median context {statistics.median(l.num_tokens for l in layouts)} tokens)")
    print(f"{'strategy':<18}{'variant':>8}{'median ms':>11}{'mean ms':>9}{'old / new':>11}")
    for r in rows:
        new = next(x for x in rows if x["strategy"] == r["strategy"] and x["variant"] == "new")
        ratio = r["median_ms"] / new["median_ms"]
        print(f"{r['strategy']:<18}{r['variant']:>8}{r['median_ms']:>11.1f}{r['mean_ms']:>9.1f}{ratio:>11.2f}")
    if same is not None:
        print(f"same tokens recomputed by both variants: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device, "n": args.n, "rows": rows, "same_selection": same,
                                    "command": "python " + " ".join(sys.argv)}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
