"""Where a GPU eval's time goes: ``lazyrag eval``'s scoring loop on random weights of the embedded model's
shape (SmolLM2-135M: 30 layers, 576 wide), so it needs no GGUF on the GPU machine, only a tokenizer.

    python benchmarks/eval_speed.py --tokenizer DIR [--n 32] [--device cuda]

Per engine setting (eager; CUDA graphs + compiled elementwise ops): a warm-up, the time for --n NQ items
with all strategies in one batch and with subsets of them, then a cProfile of the whole batch (cumulative
and own time). Random weights never stop early, so every request decodes all 32 tokens (the worst case).
Run of record: benchmarks/results/eval_speed_h200_profile.txt (H200, --n 32, fp32).
"""
import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig

from lazyrag.engine import LazyEngine, SchedulerConfig
from lazyrag.eval import DATA, load_nq, score
from lazyrag.model.loader import resolve_model_source

STRATEGIES = ["full", "position_aware", "lazy", "lazy:first=16", "lazy:blend=0.15", "lazy:blend=0.2"]


def embedded_model_shape(tokenizer: str | None = None):
    """The embedded model's config (SmolLM2-135M: 30 layers, 576 wide; for random weights) and its tokenizer,
    from a saved tokenizer folder or, without one, the embedded GGUF."""
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    else:
        src = resolve_model_source(None)
        tok = AutoTokenizer.from_pretrained(src.folder, **src.kwargs())
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0)
    return cfg, tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer folder (default: the embedded model's, from its GGUF)")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data", type=Path, default=DATA / "nq_open_oracle_2655.jsonl.gz")
    args = ap.parse_args()
    cfg, tok = embedded_model_shape(args.tokenizer)
    items = load_nq(args.data, 4 + 2 * args.n, 4, 0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    n = args.n
    for label, kw in [("eager", dict(cuda_graphs=False, compile_elementwise=False)), ("default (graphs, compile)", {})]:
        e = LazyEngine.from_config(cfg, tok, device=args.device, dtype="float32",
                                   scheduler=SchedulerConfig(max_running=max(64, n * len(STRATEGIES))), **kw)
        t = time.time()
        score(e, items[:4], STRATEGIES, 32, 4)
        sync()
        print(f"== {label}: warm-up 4 items {time.time() - t:.1f} s", flush=True)
        for sub in (STRATEGIES, ["full", "lazy"], ["lazy:blend=0.15"], ["position_aware"]):
            t = time.time()
            score(e, items[4 : 4 + n], sub, 32, n)
            sync()
            print(f"   {n} items x {sub}: {time.time() - t:.1f} s", flush=True)
        pr = cProfile.Profile()
        t = time.time()
        pr.enable()
        score(e, items[4 + n : 4 + 2 * n], STRATEGIES, 32, n)
        sync()
        pr.disable()
        print(f"== {label}: {n} items, all strategies, profiled: {time.time() - t:.1f} s; steps {dict(e.scheduler.steps)}")
        for key, lines in (("cumulative", 40), ("tottime", 25)):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(lines)
            print(s.getvalue())
        del e


if __name__ == "__main__":
    main()
