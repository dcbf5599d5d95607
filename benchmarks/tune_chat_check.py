"""Did tuning for `lazy` change how the model chats? Plain prompts without documents, base model against the tuned
one (issue 42: "a few plain chat prompts without documents"), both reading the prompt by full prefill.

    python benchmarks/tune_chat_check.py --adapter embedded --out benchmarks/results/tune42/chat_check_cpu.json

Per prompt: the KL of the tuned model's first-token distribution to the base model's, and the greedy answers
(``--max-new-tokens``): identical or not, and how many tokens they share before they part. Prints both answers of
each prompt; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

PROMPTS = [
    "Hi! How are you today?",
    "Write a haiku about autumn leaves.",
    "What is the capital of Australia?",
    "Explain what a prime number is to a ten-year-old.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into French and Spanish.",
    "What is 17 times 23?",
    "Write a Python function that reverses a string.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What causes the seasons on Earth?",
    "Suggest a name for a bakery that sells only croissants.",
    "Is a tomato a fruit or a vegetable? Explain briefly.",
    "List the planets of the solar system in order from the Sun.",
    "Write a short, polite email declining a meeting invitation.",
    "What is the difference between weather and climate?",
    "Tell me a joke about computers.",
    "How do I boil an egg?",
    "Who wrote 'Pride and Prejudice'?",
    "What does HTTP stand for?",
    "Give me a motivational quote and explain it in one sentence.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local Llama folder or .gguf (default: the embedded model)")
    ap.add_argument("--adapter", default="embedded", help="the tuned adapter: a folder, or embedded")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tune42" / "chat_check_cpu.json")
    args = ap.parse_args()
    import torch

    from lazyrag.engine import LazyEngine

    runs = {}
    for name, adapter in (("base", None), ("tuned", args.adapter)):
        engine = LazyEngine.from_pretrained(args.model, adapter=adapter)
        rows = []
        for prompt in PROMPTS:
            logits = engine.next_token_logits(prompt, [], strategy="full")
            r = engine.generate(prompt, [], max_new_tokens=args.max_new_tokens, strategy="full")
            rows.append({"logprobs": torch.log_softmax(logits.float(), -1), "ids": list(r.token_ids), "text": r.text})
        runs[name] = rows
        del engine
    out = []
    for i, prompt in enumerate(PROMPTS):
        base, tuned = runs["base"][i], runs["tuned"][i]
        kl = float((base["logprobs"].exp() * (base["logprobs"] - tuned["logprobs"])).sum())
        shared = next(
            (j for j, (a, b) in enumerate(zip(base["ids"], tuned["ids"])) if a != b),
            min(len(base["ids"]), len(tuned["ids"])),
        )
        out.append(
            {
                "prompt": prompt,
                "first_token_kl": kl,
                "identical": base["ids"] == tuned["ids"],
                "shared_prefix_tokens": shared,
                "base": base["text"],
                "tuned": tuned["text"],
            }
        )
        print(
            f"[{i + 1}] {prompt}\n  base : {base['text']!r}\n  tuned: {tuned['text']!r}\n  KL {kl:.4f}, "
            f"{'identical' if out[-1]['identical'] else f'part after {shared} tokens'}"
        )
    summary = {
        "prompts": len(out),
        "identical": sum(r["identical"] for r in out),
        "first_token_kl_mean": statistics.mean(r["first_token_kl"] for r in out),
        "shared_prefix_tokens_median": statistics.median(r["shared_prefix_tokens"] for r in out),
    }
    print(
        f"\n{summary['identical']} of {summary['prompts']} greedy answers identical; first-token KL mean "
        f"{summary['first_token_kl_mean']:.4f}; answers share {summary['shared_prefix_tokens_median']} tokens "
        f"(median) before they part"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "adapter": args.adapter,
                "max_new_tokens": args.max_new_tokens,
                "summary": summary,
                "prompts": out,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
