"""A LangChain RAG chain over a pre-cached corpus store: `retriever | rag`, streamed.

    python examples/langchain_rag_chain.py [--store STORE]

Builds a store of the bundled demo corpus first (chunks, FAISS index and chunk KV, see
examples/precache_corpus.py) unless --store names one. The chain retrieves chunks with FAISS and
answers with their KV loaded from the store and stitched in the retrieved order: only the
question is computed.
"""
import argparse
import json
import tempfile
from pathlib import Path

from langchain_core.output_parsers import StrOutputParser

from lazyrag.demo import load_demo_corpus
from lazyrag.integrations.langchain import ChatLazyLlama, LazyRAG, LazyRAGRetriever, rag_chain
from lazyrag import get_engine
from lazyrag.store.build import PrecacheConfig, precache


def build_demo_store(out: Path) -> None:
    """The demo corpus as a folder of .md files, pre-cached into a store with the shared engine."""
    docs = out.parent / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    for d in load_demo_corpus()["documents"]:
        (docs / f"{d['id']}.md").write_text(f"{d['title']}\n{d['text']}")
    report = precache(get_engine(), PrecacheConfig([str(docs)], str(out), progress=False))
    print(report.summary())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default=None, help="a store built by `lazyrag precache` (default: build one of the demo corpus)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory()
    store = args.store or str(Path(tmp.name) / "store")
    if args.store is None:
        build_demo_store(Path(store))

    retriever = LazyRAGRetriever(store=store, k=3)
    rag = LazyRAG(llm=ChatLazyLlama(store=store, max_tokens=args.max_tokens))  # KV served from the store
    chain = retriever | rag  # the retriever records the query in each Document's metadata

    for item in load_demo_corpus()["questions"][:2]:
        print(f"Q: {item['question']}\nA: ", end="", flush=True)
        final = None
        for chunk in chain.stream(item["question"]):
            print(chunk.content, end="", flush=True)
            final = chunk if final is None else final + chunk
        stats = final.response_metadata["lazyrag"]
        print(f"\n  stats: {json.dumps({k: stats[k] for k in ('chunks_hit', 'chunks_missed', 'tokens_prefilled', 'tokens_reused')})}")

    # The same with any retriever, and a plain-text output:
    text_chain = rag_chain(retriever, rag) | StrOutputParser()
    answers = text_chain.batch([q["question"] for q in load_demo_corpus()["questions"]])
    print(f"batch: {len(answers)} answers: {answers}")


if __name__ == "__main__":
    main()
