"""The host's share of a lazy request's time to first token: each scheduler step timed with the model stubbed out.

The e2e prompt's layout (a 32-token prefix, 5 cached documents of 512 tokens, a 64-token question, Llama-3's
128,256-token vocabulary) on a tiny random Llama on the CPU; ``ModelRunner._run`` returns zero logits, so what is
left is planning, building the batch and sampling, as the GPU engine runs them before and after its graph replay.
``add_request`` includes the layout check, which runs before the request's arrival stamp (not in TTFT);
``_accept`` here includes torch's CPU argmax over the vocabulary (on the GPU: kernels/elementwise.greedy_tokens).

    python benchmarks/host_path.py --out benchmarks/results/host_path_cpu.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/host_path_cpu.json"))
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from lazyrag.engine import LazyEngine, SamplingParams
    from lazyrag.prompt import PromptLayout

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)
    engine = LazyEngine.from_hf(LlamaForCausalLM(cfg).eval(), None, device="cpu", dtype=torch.float32, kv_budget=1 << 30)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(128000) for _ in range(n)]  # noqa: E731
    prefix, docs, question = ids(32), [ids(512) for _ in range(5)], ids(64)
    one = SamplingParams(max_new_tokens=1)
    engine.submit(PromptLayout(prefix, docs, question), one).result()  # caches the documents

    engine.runner._run = lambda batch, logits, device_ids=None: torch.zeros(1, cfg.vocab_size)  # the model, stubbed out
    steps = {}
    for obj, name in [(engine, "add_request"), (engine.scheduler, "_plan"), (engine.runner, "_batch"),
                      (engine.scheduler, "_accept")]:
        def timed(*a, _f=getattr(obj, name), _n=name, **k):
            t = time.perf_counter()
            r = _f(*a, **k)
            steps.setdefault(_n, []).append(time.perf_counter() - t)
            return r
        setattr(obj, name, timed)
    total = []
    for _ in range(args.requests):
        order = docs[:]
        rng.shuffle(order)
        t = time.perf_counter()
        engine.submit(PromptLayout(prefix, order, question), one).result()
        total.append(time.perf_counter() - t)
    skip = args.requests // 6  # warm-up
    res = {name: round(statistics.median(v[skip:]) * 1e6, 1) for name, v in steps.items()}
    res["request_total"] = round(statistics.median(total[skip:]) * 1e6, 1)
    print(f"{'step (median µs)':<24}{'µs':>8}")
    for name, us in res.items():
        print(f"{name:<24}{us:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "median_us": res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
