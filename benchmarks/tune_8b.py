"""What `lazyrag tune` costs at Llama-3.1-8B shapes (random bf16 weights, one GPU): seconds and peak memory of one
training step (teacher full prefill, tuned lazy and tuned full forwards, backward, AdamW) with a LoRA of rank 8 on
every projection, for a few prompt counts per step. Speed does not depend on the weight values.

    python benchmarks/tune_8b.py --out benchmarks/results/tune_8b_h100.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 4], help="prompts per step to time")
    ap.add_argument("--passages", type=int, default=10)
    ap.add_argument("--passage-tokens", type=int, default=150)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--keep-activations", action="store_true", help="as `lazyrag tune --keep-activations`")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tune_8b.json")
    args = ap.parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from benchmarks.e2e_gpu import llama31_8b_config
    from lazyrag.prompt import PromptLayout
    from lazyrag.tune.forward import Example, activation_checkpointing, full_logits, lazy_logits
    from lazyrag.tune.train import LORA_TARGETS, kl_to

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama31_8b_config(args.layers)).eval()
    torch.set_default_dtype(torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGETS)))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    lora_bytes = sum(p.numel() for p in params) * 2  # saved in bf16
    opt = torch.optim.AdamW(params, lr=1e-4)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 120000) for _ in range(n)]  # noqa: E731
    prefix, passage_ids = ids(32), ids(205)
    rows = []
    for n in args.prompts:
        examples = [
            Example(
                PromptLayout(prefix, [ids(args.passage_tokens) for _ in range(args.passages)], ids(32)),
                ids(args.answer_tokens),
            )
            for _ in range(n)
        ]
        torch.cuda.reset_peak_memory_stats()
        times = []
        try:
            for step in range(args.steps + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16), activation_checkpointing(not args.keep_activations):
                    with torch.no_grad(), model.disable_adapter():
                        teacher = full_logits(model, examples)
                    loss = kl_to(teacher, lazy_logits(model, examples, passage_ids)) + 0.25 * kl_to(
                        teacher, full_logits(model, examples)
                    )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                torch.cuda.synchronize()
                if step:
                    times.append(time.perf_counter() - t)
            row = {
                "prompts_per_step": n,
                "step_s": statistics.median(times),
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        except torch.OutOfMemoryError:
            row = {"prompts_per_step": n, "step_s": None, "peak_gib": None, "oom": True}
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        tokens = n * (32 + args.passages * args.passage_tokens + 32 + args.answer_tokens)
        row.update(prompt_tokens_per_step=tokens)
        rows.append(row)
        print(row, flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
        "lora": "rank 8 on q,k,v,o,gate,up,down",
        "lora_mb_bf16": lora_bytes / 1e6,
        "passages": args.passages,
        "passage_tokens": args.passage_tokens,
        "activation_checkpointing": not args.keep_activations,
        "command": "python benchmarks/tune_8b.py " + " ".join(argv or sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
