"""LlamaIndex adapters on the real default model, real faiss and sentence-transformers: a stock
VectorStoreIndex query engine with LazyLlamaLLM reuses chunk KV from the second question on in every
response mode; the fast path; pre-caching an index; clear errors."""

import asyncio

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent
from llama_index.core.llms import ChatMessage
from llama_index.core.schema import TextNode

from lazyrag.integrations.llama_index import (
    LazyEmbedding,
    LazyLlamaLLM,
    LazyRAGQueryEngine,
    LazyRAGRetriever,
    node_chunk_text,
    precache_index,
    precache_store,
)
from lazyrag.store import StoreError
from lazyrag.store.corpus import CorpusStore
from tests.helpers import MANY, TINY_DOCS, kwargs_id

pytestmark = pytest.mark.slow
MAX_NEW = 12
QUESTION = "Where was the violinist Paganini born?"


class _Prompts(BaseEventHandler):
    """Records the chat messages every LLM call receives, to recompute what its prompt held."""

    calls: list = []

    def handle(self, event, **kwargs):
        if isinstance(event, LLMChatStartEvent):
            self.calls.append(list(event.messages))


@pytest.fixture(scope="module")
def prompts():
    handler = _Prompts(calls=[])
    get_dispatcher().add_event_handler(handler)
    yield handler
    get_dispatcher().event_handlers.remove(handler)


@pytest.fixture(scope="module")
def index():
    # metadata as SimpleDirectoryReader sets it: the synthesizers print it above each chunk
    docs = [Document(text=text, metadata={"file_name": name}) for name, text in TINY_DOCS.items()]
    return VectorStoreIndex.from_documents(docs, embed_model=LazyEmbedding())


@pytest.fixture
def llm(adapter_engine):
    adapter_engine.cache.clear()
    return LazyLlamaLLM(engine=adapter_engine, max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize", "simple_summarize"])
def test_stock_query_engine_hits_from_the_second_question(index, llm, prompts, mode):
    engine = llm.engine
    qe = index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=3)
    first = qe.query(QUESTION)
    n, calls0 = len(llm.stats_log), len(prompts.calls)
    second = qe.query("When was Paganini born?")
    stats = llm.stats_log[n:]
    assert stats and len(stats) == len(prompts.calls) - calls0
    for s, messages in zip(stats, prompts.calls[calls0:]):
        layout = engine.layout_from_text(llm.messages_to_prompt(messages))
        assert s["chunks_missed"] == 0 and s["chunks_hit"] == len(layout.chunk_ids) >= 1
        # only the text after the last chunk (question, template tail) went through the model
        assert s["tokens_prefilled"] == len(layout.question_ids)
        assert s["tokens_reused"] == layout.num_tokens - len(layout.question_ids)
    assert str(first) and str(second)
    assert {n.node.metadata["file_name"] for n in second.source_nodes} >= {"paganini.txt"}


def test_answers_equal_position_aware(index, llm, adapter_engine):
    lazy = index.as_query_engine(llm=llm, similarity_top_k=3).query(QUESTION)
    aware_llm = LazyLlamaLLM(engine=adapter_engine, max_new_tokens=MAX_NEW, strategy="position_aware")
    aware = index.as_query_engine(llm=aware_llm, similarity_top_k=3).query(QUESTION)
    # both found the three retrieved chunks in LlamaIndex's prompt (the cache was cleared: lazy encoded them)
    assert aware_llm.last_stats["strategy"] == "position_aware" and llm.last_stats["chunks_missed"] == 3
    assert str(lazy) == str(aware)


def test_precached_index_hits_on_the_first_question(index, llm):
    nodes = list(index.docstore.docs.values())
    assert precache_index(llm, index) == len(nodes)
    assert precache_index(llm, index) == 0  # already cached
    index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    assert llm.last_stats["chunks_hit"] == 2 and llm.last_stats["chunks_missed"] == 0


def test_chat_complete_stream_and_async(llm):
    msgs = [ChatMessage(role="user", content="Name a colour.")]
    chat = llm.chat(msgs)
    streamed = list(llm.stream_chat(msgs))
    assert chat.message.content and streamed[-1].message.content == chat.message.content
    assert "".join(r.delta or "" for r in streamed) == chat.message.content
    assert streamed[-1].raw["stats"]["new_tokens"] == chat.raw["stats"]["new_tokens"] > 0
    done = llm.complete("Name a colour.")
    assert done.text == chat.message.content  # complete() renders the prompt as a user turn

    async def run():
        a = await llm.acomplete("Name a colour.")
        parts = [r.delta async for r in await llm.astream_chat(msgs)]
        return a.text, "".join(p or "" for p in parts)

    assert asyncio.run(run()) == (done.text, chat.message.content)


def test_concurrent_async_calls_share_decode_steps(llm, decode_batches):
    prompts = [f"Write a sentence about colour number {i}." for i in range(MANY)]
    alone = [llm.complete(p, max_new_tokens=6).text for p in (prompts[0], prompts[-1])]
    decode_batches.clear()

    async def run():
        return await asyncio.gather(*(llm.acomplete(p, max_new_tokens=6) for p in prompts))

    answers = asyncio.run(run())
    assert [answers[0].text, answers[-1].text] == alone
    assert all(a.raw["stats"]["new_tokens"] > 0 for a in answers)
    assert max(decode_batches) == MANY  # every call in one batch: none waited for a free thread


def test_system_prompt_and_unknown_text(adapter_engine, llm):
    chunk = TINY_DOCS["paganini.txt"]
    adapter_engine.precache([chunk])
    prompt = f"Some notes nobody cached.\n\n{chunk}\n\nAnother unknown line.\n\nQuestion: {QUESTION}"
    first = llm.complete(prompt)
    assert llm.last_stats["chunks_hit"] == 1 and first.text
    pirate = LazyLlamaLLM(engine=adapter_engine, max_new_tokens=MAX_NEW, system_prompt="Answer like a pirate.")
    assert "Answer like a pirate." in pirate.messages_to_prompt([ChatMessage(role="user", content="hi")])
    assert pirate.complete(prompt).text != first.text


def test_fast_path_query_engine_streams_with_sources_and_stats(llm, tiny_store, adapter_engine):
    qe = LazyRAGQueryEngine.from_store(str(tiny_store), llm=llm, similarity_top_k=2, streaming=True)
    response = qe.query(QUESTION)
    text = "".join(response.response_gen)
    assert text and response.source_nodes[0].node.metadata["doc_id"] == "paganini.txt"
    stats = response.metadata["stats"]
    layout = adapter_engine.build_prompt(QUESTION, [node_chunk_text(n) for n in response.source_nodes])
    # the store is attached: chunk KV comes from disk (or memory), never recomputed
    assert stats["chunks_hit"] == 2 and stats["tokens_prefilled"] == len(layout.question_ids)
    plain = LazyRAGQueryEngine.from_store(str(tiny_store), llm=llm, similarity_top_k=2).query(QUESTION)
    assert str(plain) == text and plain.metadata["stats"]["chunks_hit"] == 2

    async def run():
        r = await LazyRAGQueryEngine.from_store(str(tiny_store), llm=llm, similarity_top_k=2, streaming=True).aquery(
            QUESTION
        )
        return "".join([d async for d in r.async_response_gen()])

    assert asyncio.run(run()) == text


def test_retriever_nodes_show_the_stored_text_to_the_llm(tiny_store):
    hits = LazyRAGRetriever(str(tiny_store), similarity_top_k=3).retrieve(QUESTION)
    assert len(hits) == 3 and hits[0].score >= hits[1].score
    assert node_chunk_text(hits[0]) == hits[0].node.text  # metadata kept, but not printed into prompts
    assert hits[0].node.metadata["doc_id"] == "paganini.txt"


def test_clear_errors(llm, tmp_path):
    with pytest.raises(StoreError, match="not a lazyrag store"):
        LazyRAGRetriever(str(tmp_path / "missing"))
    with pytest.raises(StoreError, match="not a lazyrag store"):
        LazyLlamaLLM(engine=llm.engine, store=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="8192-token context"):
        llm.complete("lorem ipsum " * 5000)
    with pytest.raises(ValueError, match="holds no nodes"):
        precache_index(llm, VectorStoreIndex([], embed_model=LazyEmbedding()))


def test_token_counting_handler_counts_each_answer_once_with_the_model_s_tokens(index, adapter_engine, monkeypatch):
    counter = TokenCountingHandler(tokenizer=adapter_engine.prompts.encode)
    monkeypatch.setattr(Settings, "callback_manager", CallbackManager([counter]))  # as the LlamaIndex docs set it up
    llm = LazyLlamaLLM(engine=adapter_engine, max_new_tokens=MAX_NEW)
    index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    stats = llm.stats_log[-1]
    assert len(counter.llm_token_counts) == 1  # one LLM event per answer, not chat + complete
    assert counter.prompt_llm_token_count == stats["prompt_tokens"]
    assert counter.completion_llm_token_count == stats["new_tokens"]
    counter.reset_counts()
    chat = llm.chat([ChatMessage(role="user", content="Name a colour.")])
    list(llm.stream_chat([ChatMessage(role="user", content="Name a colour.")]))
    assert len(counter.llm_token_counts) == 2 and chat.raw["usage"]["prompt_tokens"] == llm.last_stats["prompt_tokens"]


def test_unknown_arguments_are_refused_and_hugging_face_names_accepted():
    for bad, hint in [
        ({"device_map": "auto"}, "device="),
        ({"tokenizer_name": "x"}, "tokenizer"),
        ({"max_new_tokns": 5}, "did you mean max_new_tokens"),
        ({"strategy": "lazzy"}, "Unknown strategy"),
    ]:
        with pytest.raises(ValueError, match=hint):
            LazyLlamaLLM(**bad)
    llm = LazyLlamaLLM(
        model_name="/models/x",
        context_window=2048,
        max_new_tokens=9,
        system_prompt="Be brief.",
        device="cpu",
        generate_kwargs={"temperature": 0.7, "top_p": 0.8},
    )
    assert (llm.model, llm.context_window, llm.max_new_tokens, llm.system_prompt, llm.device) == (
        "/models/x",
        2048,
        9,
        "Be brief.",
        "cpu",
    )
    assert (llm.temperature, llm.top_p) == (0.7, 0.8)
    # greedy, as transformers
    assert LazyLlamaLLM(generate_kwargs={"do_sample": False, "temperature": 0.9}).temperature == 0.0


def test_a_shared_engine_asked_for_another_kv_budget_raises(adapter_engine):
    """One process shares one engine (and chunk cache) per model: a different pool size is refused, not ignored."""
    from lazyrag.integrations._common import shared_engine

    budget = adapter_engine.config.kv_budget
    assert shared_engine(device="cpu", kv_budget=budget) is adapter_engine
    with pytest.raises(ValueError, match=f"already loaded with kv_budget={budget}"):
        shared_engine(device="cpu", kv_budget=budget // 2)
    with pytest.raises(ValueError, match="kv_budget"):
        LazyLlamaLLM(device="cpu", kv_budget=budget // 2).complete("hi")


# -- issue 29: the doors checked before any work ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(context_window=-5),
        dict(context_window=0),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(temperature=1e-320),
        dict(top_p=1e-300),
        dict(top_p=1.5),
        dict(seed=2**70),
        dict(seed=-1),
        dict(kv_budget=0),
        dict(max_new_tokens=0),
    ],
    ids=kwargs_id,
)
def test_constructor_numbers_are_checked(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LazyLlamaLLM(**kwargs)
    LazyLlamaLLM(temperature=1e-5, top_p=1e-6, seed=2**63 - 1, context_window=1)  # the edges are accepted


def test_non_string_prompts_are_refused_not_answered(llm):
    for prompt in (None, b"abc", 5, ["a"]):
        for call in (llm.complete, llm.stream_complete):
            with pytest.raises(TypeError, match="takes the prompt as a str"):
                call(prompt)
        for acall in (llm.acomplete, llm.astream_complete):
            with pytest.raises(TypeError, match="takes the prompt as a str"):
                asyncio.run(acall(prompt))
    assert llm.last_stats is None  # nothing reached the engine


def test_retriever_top_k_is_checked_and_clamped(tiny_store):
    for k in (0, -1, 2**31, True, 2.0):
        with pytest.raises(ValueError, match="similarity_top_k"):
            LazyRAGRetriever(str(tiny_store), similarity_top_k=k)
    assert len(LazyRAGRetriever(str(tiny_store), similarity_top_k=64).retrieve(QUESTION)) == 5  # all the store has


def test_sampling_knobs_and_logprobs(adapter_engine):
    """top_k, penalties and logprobs reach SamplingParams; logprobs come back per token, the chosen one first."""
    llm = LazyLlamaLLM(
        device="cpu",
        max_new_tokens=5,
        logprobs=True,
        top_logprobs=2,
        top_k=40,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        generate_kwargs={"top_k": 7},
    )
    params = llm._params({})
    assert (
        params.top_k,
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
        params.logprobs,
    ) == (40, 1.1, 0.5, -0.5, 2)  # the explicit argument wins over generate_kwargs
    assert llm._params({"logprobs": False}).logprobs is None and llm._params({"top_k": 3}).top_k == 3
    for bad in (dict(top_k=-5), dict(repetition_penalty=-1.0), dict(frequency_penalty=2.5), dict(top_logprobs=50)):
        with pytest.raises(ValueError):
            LazyLlamaLLM(**bad)
    r = llm.complete("Say hello.")
    assert len(r.logprobs) == llm.last_stats["new_tokens"] and all(len(per) == 3 for per in r.logprobs)
    for chosen, *top in r.logprobs:
        assert chosen.logprob <= 0 and top[0].logprob >= top[1].logprob and chosen.token == top[0].token  # greedy
    chat = llm.chat([ChatMessage(role="user", content="Say hello.")])
    assert [[p.token for p in per] for per in chat.logprobs] == [[p.token for p in per] for per in r.logprobs]
    *_, last = llm.stream_complete("Say hello.")
    assert last.logprobs is not None and len(last.logprobs) == len(r.logprobs)
    assert LazyLlamaLLM(device="cpu", max_new_tokens=2).complete("Hi").logprobs is None
    stats = llm.last_stats
    assert stats["tokens_reused"] == stats["prefix_tokens_reused"] + stats["chunk_tokens_reused"]


# -- issue 34: corpus stores from an index (a new process hitting them: test_precache.py) ---------------


def _stored(out):
    return [(row.doc_id, row.text) for row in CorpusStore.open(out).rows()]


def test_precache_store_keeps_each_node_whole_as_the_synthesizers_format_it(index, store_engine, tmp_path):
    nodes = list(index.docstore.docs.values())
    out = tmp_path / "store"
    report = precache_store(index, out, store_engine, progress=False)
    assert (report.documents, report.chunks, report.chunks_encoded) == (5, 5, 5)
    assert _stored(out) == [(n.node_id, node_chunk_text(n)) for n in nodes]  # metadata lines included, node ids kept
    assert CorpusStore.open(out).rows()[0].meta["file_name"] == nodes[0].metadata["file_name"]
    # the same nodes in the same order, through every door: the build is done already
    for same in (index.docstore, index.storage_context, nodes):
        assert precache_store(same, out, store_engine, progress=False).chunks_encoded == 0
    rhine = TextNode(text="The Rhine rises in the Swiss Alps and reaches the North Sea in the Netherlands.")
    # appended: the store grows
    assert precache_store([*nodes, rhine], out, store_engine, progress=False).chunks_encoded == 1
    assert CorpusStore.open(out).manifest.sources == ["llama_index:docstore", "llama_index:nodes"]
    with pytest.raises(StoreError, match="built from other input"):
        precache_store(nodes[::-1], out, store_engine, progress=False)
    with pytest.raises(StoreError, match="No documents found in llama_index:docstore"):
        precache_store(VectorStoreIndex([], embed_model=LazyEmbedding()), tmp_path / "empty", store_engine)
    with pytest.raises(TypeError, match="did you mean chunk_tokens"):
        precache_store(index, out, store_engine, chunk_size=64)


def test_a_node_longer_than_a_chunk_size_given_is_split_into_windows_a_prompt_still_finds(
    store_engine, tmp_path, caplog
):
    node = TextNode(id_="long", text=" ".join(f"Sentence number {i} talks about topic {i % 7}." for i in range(28)))
    with caplog.at_level("WARNING", logger="lazyrag.store"):
        report = precache_store([node], tmp_path / "split", store_engine, chunk_tokens=64, overlap=0, progress=False)
    assert "1 document(s) are longer than chunk_tokens=64" in caplog.text
    rows = CorpusStore.open(tmp_path / "split").rows()
    assert len(rows) == report.chunks > 2 and {r.doc_id for r in rows} == {"long"}
    assert [r.meta["part"] for r in rows] == list(range(len(rows)))
    # without overlap the windows tile the node: a prompt holding it whole reuses every window (the store is attached)
    layout = store_engine.layout_from_text(f"Context:\n{node_chunk_text(node)}\n\nQuestion: Which topic comes first?")
    assert layout.chunk_texts == [r.text for r in rows]
    # the default chunk size holds every node whole
    assert precache_store([node], tmp_path / "whole", store_engine, progress=False).chunks == 1
    whole = CorpusStore.open(tmp_path / "whole")
    assert whole.manifest.chunk_tokens % 16 == 0 and whole.manifest.chunk_tokens >= len(
        store_engine.prompts.encode_chunk(node.text)
    )
    assert _stored(tmp_path / "whole") == [("long", node.text)]
