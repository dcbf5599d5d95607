"""The standard LangChain RAG chain over a stock vector store, with ChatLazyLlama: chunk KV reused.

    python examples/langchain_stock_vector_store.py

    retriever | format_docs -> ChatPromptTemplate -> ChatLazyLlama

Nothing here is lazyrag's but the chat model (and the offline embeddings): importing
lazyrag.integrations.langchain installs a callback handler that registers every retrieved
Document's text with the engine, so the model finds those chunks inside the formatted prompt and
reuses their KV, at whatever position they land, from the second question on.
"""
import argparse

from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from lazyrag.demo import load_demo_corpus
from lazyrag.integrations.langchain import ChatLazyLlama, LazyRAGEmbeddings


def format_docs(docs) -> str:
    return "\n\n".join(d.page_content for d in docs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    corpus = load_demo_corpus()
    store = InMemoryVectorStore(LazyRAGEmbeddings())
    store.add_texts([f"{d['title']}\n{d['text']}" for d in corpus["documents"]])
    prompt = ChatPromptTemplate.from_template("Answer from the context.\n\n{context}\n\nQuestion: {question}")
    chain = ({"context": store.as_retriever(search_kwargs={"k": 3}) | format_docs, "question": RunnablePassthrough()}
             | prompt | ChatLazyLlama(max_tokens=args.max_tokens))

    for question in [q["question"] for q in corpus["questions"]] * 2:  # asked twice: the second round hits
        answer = chain.invoke(question)
        s = answer.response_metadata["lazyrag"]
        print(f"Q: {question}\nA: {answer.content.strip()}\n  chunks_hit={s['chunks_hit']} chunks_missed={s['chunks_missed']} "
              f"tokens_prefilled={s['tokens_prefilled']} cache_read={answer.usage_metadata['input_token_details']['cache_read']}")


if __name__ == "__main__":
    main()
