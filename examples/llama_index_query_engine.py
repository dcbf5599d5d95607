"""A stock LlamaIndex query engine with LazyLlamaLLM: from the second question over the same chunks
on, their KV is reused (nothing but the question is computed).

    python examples/llama_index_query_engine.py [--mode compact|refine|tree_summarize|simple_summarize]

Runs offline on CPU: the embedded SmolLM2-135M-Instruct and all-MiniLM-L6-v2, the bundled demo corpus.
"""
import argparse

from llama_index.core import Document, VectorStoreIndex

from lazyrag.demo import load_demo_corpus
from lazyrag.integrations.llama_index import LazyEmbedding, LazyLlamaLLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="compact", choices=["compact", "refine", "tree_summarize", "simple_summarize"])
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()

    corpus = load_demo_corpus()
    docs = [Document(text=d["text"], metadata={"title": d["title"]}) for d in corpus["documents"]]
    # Pass the embedding explicitly: LlamaIndex's Settings default to OpenAI.
    index = VectorStoreIndex.from_documents(docs, embed_model=LazyEmbedding())
    llm = LazyLlamaLLM(max_new_tokens=args.max_new_tokens)
    query_engine = index.as_query_engine(llm=llm, response_mode=args.mode, similarity_top_k=3)

    question = corpus["questions"][0]["question"]
    for attempt in ("first", "second"):
        n = len(llm.stats_log)
        response = query_engine.query(question)
        calls = llm.stats_log[n:]
        hit = sum(s["chunks_hit"] for s in calls)
        missed = sum(s["chunks_missed"] for s in calls)
        prefilled = sum(s["tokens_prefilled"] for s in calls)
        reused = sum(s["tokens_reused"] for s in calls)
        print(f"[{attempt} question] {question}")
        print(f"  answer: {str(response).strip()}")
        print(f"  sources: {[n.node.metadata['title'] for n in response.source_nodes]}")
        print(f"  llm calls={len(calls)} chunks_hit={hit} chunks_missed={missed} tokens_prefilled={prefilled} tokens_reused={reused}")


if __name__ == "__main__":
    main()
