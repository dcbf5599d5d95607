"""The offline demo: cache a small bundled corpus once, then answer questions over its chunks in shuffled orders."""
from __future__ import annotations

import json
import random
import statistics
from importlib import resources

from rich.console import Console
from rich.table import Table


def load_demo_corpus() -> dict:
    return json.loads(resources.files("lazyrag").joinpath("data/demo_corpus.json").read_text())


def run_demo(model: str | None = None, device: str | None = None, max_new_tokens: int = 48, repeats: int = 3, seed: int = 0) -> list[dict]:
    from tqdm import tqdm

    from lazyrag.engine import LazyEngine

    console = Console()
    corpus = load_demo_corpus()
    docs = {d["id"]: d["text"] for d in corpus["documents"]}
    with console.status("Loading the model (the embedded SmolLM2-135M-Instruct unless --model is given)..."):
        engine = LazyEngine.from_pretrained(model, device=device)
    console.print(f"[bold]Model[/] {engine.model_name} on {engine.device} ({engine.dtype}), attention backend: {engine.attention_backend}")

    for text in tqdm(docs.values(), desc="Pre-caching chunk KV", unit="chunk"):
        engine.precache([text])
    console.print(f"Cached {len(engine.cache) - 1} chunks once each (+ the shared system prefix).\n")

    rng = random.Random(seed)
    rows = []
    for n, item in enumerate(corpus["questions"], 1):
        chunks = [docs[d] for d in item["documents"]]
        rng.shuffle(chunks)
        console.print(f"[bold cyan]Q{n}:[/] {item['question']}")
        console.print("[bold green]A:[/] ", end="")
        for delta in engine.stream(item["question"], chunks, max_new_tokens=max_new_tokens):
            console.print(delta, end="", markup=False, highlight=False)
        console.print(f"\n[dim](expected: {item['answer']})[/]")

        # Time to first token, cached chunks stitched lazily vs. a plain full prefill, each in a new order.
        ttft = {"full": [], "lazy": []}
        for _ in range(repeats):
            rng.shuffle(chunks)
            for strategy in ttft:
                r = engine.generate(item["question"], chunks, max_new_tokens=1, strategy=strategy)
                ttft[strategy].append(r.ttft_s)
                if strategy == "lazy":
                    stats = r.stats
        full, lazy = statistics.median(ttft["full"]), statistics.median(ttft["lazy"])
        rows.append({
            "question": f"Q{n}", "ttft_full_ms": 1e3 * full, "ttft_lazy_ms": 1e3 * lazy,
            "speedup": full / lazy, "chunks_hit": stats.chunks_hit, "prompt_tokens": stats.prompt_tokens,
            "tokens_prefilled": stats.tokens_prefilled,
        })
        console.print()

    table = Table(title=f"Time to first token, median of {repeats} shuffled orders")
    for col in ("question", "prompt tokens", "full (ms)", "lazy (ms)", "speedup", "chunks hit", "tokens prefilled"):
        table.add_column(col, justify="left" if col == "question" else "right")
    for r in rows:
        table.add_row(r["question"], str(r["prompt_tokens"]), f"{r['ttft_full_ms']:.0f}", f"{r['ttft_lazy_ms']:.0f}",
                      f"{r['speedup']:.1f}x", f"{r['chunks_hit']}", f"{r['tokens_prefilled']}")
    console.print(table)
    return rows
