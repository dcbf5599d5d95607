"""Pre-cache a corpus once, then answer from the store without recomputing any chunk.

    python examples/precache_corpus.py [INPUT ...] [--out STORE] [--limit N]

INPUT: folders of .txt/.md files or .jsonl(.gz) files (HotpotQA, NQ); default: the bundled demo
corpus. The same as `lazyrag precache INPUT --out STORE`, from Python. A fresh engine then
attaches the store: chunk KV is read from disk on a miss instead of being recomputed.
"""
import argparse
import json
import tempfile
from pathlib import Path

from lazyrag.demo import load_demo_corpus
from lazyrag.engine import LazyEngine
from lazyrag.store.build import PrecacheConfig, precache
from lazyrag.store.retriever import Retriever


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*")
    p.add_argument("--out", default=None, help="store folder (default: a temporary one)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N documents")
    p.add_argument("--question", default=None)
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory()
    inputs, question = args.inputs, args.question
    if not inputs:  # the bundled demo corpus, as a .jsonl file of {"id", "title", "text"}
        path = Path(tmp.name) / "demo.jsonl"
        corpus = load_demo_corpus()
        path.write_text("".join(json.dumps(d) + "\n" for d in corpus["documents"]))
        inputs, question = [str(path)], question or corpus["questions"][0]["question"]
    out = args.out or str(Path(tmp.name) / "store")

    engine = LazyEngine.from_pretrained()
    report = precache(engine, PrecacheConfig(inputs, out, limit=args.limit, progress=False))
    print("precache:", report.summary())
    again = precache(engine, PrecacheConfig(inputs, out, limit=args.limit, progress=False))
    print(f"rerun: {again.chunks_encoded} chunks encoded (the store is complete)")

    engine.cache.clear()  # forget the in-memory KV: from here on, chunk KV comes from the store
    store = engine.attach_store(out)
    retriever = Retriever(store)
    question = question or "What is this corpus about?"
    hits = retriever.retrieve(question, k=3)
    result = engine.generate(question, [h.text for h in hits], max_new_tokens=32)
    s = result.stats
    print(f"Q: {question}\nA: {result.text.strip()}")
    print(f"retrieved: {[h.doc_id for h in hits]}")
    print(f"stats: chunks_hit={s.chunks_hit} chunks_missed={s.chunks_missed} tokens_prefilled={s.tokens_prefilled} "
          f"tokens_reused={s.tokens_reused} store_hits={engine.cache.stats.tier_hits}")


if __name__ == "__main__":
    main()
