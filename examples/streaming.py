"""Streaming answers over cached chunks, three ways: the engine, LangChain and LlamaIndex.

    python examples/streaming.py

Each streams the same question over the same (pre-cached) chunks and prints the time to first token.
"""
import asyncio
import time

from lazyrag.demo import load_demo_corpus
from lazyrag import get_engine
from lazyrag.integrations.langchain import ChatLazyLlama, LazyRAG
from lazyrag.integrations.llama_index import LazyLlamaLLM


def timed_stream(label: str, deltas) -> str:
    t0, first, text = time.perf_counter(), None, ""
    print(f"[{label}] ", end="", flush=True)
    for delta in deltas:
        first = first or time.perf_counter() - t0
        text += delta
        print(delta, end="", flush=True)
    print(f"\n  time to first token {1000 * (first or 0):.0f} ms")
    return text


async def astream(rag: LazyRAG, inputs: dict) -> str:
    text = ""
    async for chunk in rag.astream(inputs):  # the engine's scheduler thread works; the loop only waits
        text += chunk.content
    return text


def main() -> None:
    corpus = load_demo_corpus()
    docs = {d["id"]: d["text"] for d in corpus["documents"]}
    item = corpus["questions"][1]
    chunks = [docs[i] for i in item["documents"]]

    engine = get_engine()  # the adapters below share this engine and its chunk cache
    engine.precache(chunks)

    engine_text = timed_stream("engine", engine.stream(item["question"], chunks, max_new_tokens=32))
    rag = LazyRAG(llm=ChatLazyLlama(max_tokens=32))
    inputs = {"question": item["question"], "documents": chunks}
    lc_text = timed_stream("langchain", (c.content for c in rag.stream(inputs)))
    llm = LazyLlamaLLM(max_new_tokens=32)
    li_text = timed_stream("llama_index", llm.stream_over_chunks(item["question"], chunks))  # the fast path
    print("async langchain:", asyncio.run(astream(rag, inputs)).strip())
    print("same answer everywhere:", engine_text == lc_text == li_text)
    print("stats of the last request:", llm.last_stats)


if __name__ == "__main__":
    main()
