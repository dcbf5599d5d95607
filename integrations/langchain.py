"""LangChain adapters: a chat model, a retriever over a lazyrag store, and a RAG runnable that
answers with the retrieved chunks' cached KV stitched together.

    from lazyrag.integrations.langchain import ChatLazyLlama, LazyRAG, LazyRAGRetriever
    retriever = LazyRAGRetriever(store="stores/docs", k=4)
    rag = LazyRAG(llm=ChatLazyLlama(store="stores/docs"))
    chain = retriever | rag                      # the retriever records the query in each Document
    for chunk in chain.stream("Who discovered penicillin?"):
        print(chunk.content, end="")

``ChatLazyLlama`` renders messages with the model's chat template; known chunks pasted into a
message (pre-cached, in an attached store, seen by ``LazyRAG`` before, or returned by any LangChain
retriever: ``LazyRAGCallbackHandler``, installed for every run on import) reuse their KV, so the
standard ``retriever | format_docs | prompt | ChatLazyLlama()`` chain over a stock vector store
hits from the second question on. ``LazyRAG`` hands the documents' texts straight to the engine
(no string search). Both report the reuse stats in ``response_metadata["lazyrag"]`` and token
counts in ``usage_metadata`` (``cache_read``: prompt tokens whose KV was already cached, the shared
prefix's included: ``response_metadata["lazyrag"]`` splits it into ``prefix_tokens_reused`` and
``chunk_tokens_reused``), and fire the LLM callbacks. ``logprobs=True`` (``top_logprobs=n``) puts
ChatOpenAI-style logprobs in ``response_metadata["logprobs"]``. ``with_structured_output`` validates and retries JSON;
no tool calling.

``precache_store(docs_or_vector_store, "stores/docs")`` writes the Documents' KV to a corpus store: a chain
with ``ChatLazyLlama(store="stores/docs")`` in any later process hits them from its first question.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, AsyncIterator, ClassVar, Iterator, Optional, Sequence, Union, cast
from uuid import UUID

from lazyrag.extras import require

require("lazyrag's LangChain adapters", "langchain_core")

from langchain_core.callbacks import (  # noqa: E402 (after the check)
    AsyncCallbackManagerForLLMRun,
    AsyncCallbackManagerForRetrieverRun,
    BaseCallbackHandler,
    CallbackManagerForLLMRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.load import dumpd
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, Generation, LLMResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnablePassthrough, RunnableSerializable
from langchain_core.runnables.config import get_async_callback_manager_for_config, get_callback_manager_for_config
from langchain_core.tracers.context import register_configure_hook
from langchain_core.vectorstores import VectorStore, VectorStoreRetriever
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from lazyrag.integrations import _common
from lazyrag.integrations._adapter import AdapterFields, limited_field

if TYPE_CHECKING:
    from lazyrag.store.build import PrecacheReport

__all__ = [
    "ChatLazyLlama",
    "LazyRAGRetriever",
    "LazyRAG",
    "LazyRAGCallbackHandler",
    "LazyRAGEmbeddings",
    "rag_chain",
    "precache_store",
]


class LazyRAGCallbackHandler(BaseCallbackHandler):
    """Makes any LangChain retriever's Documents reusable chunks: on retriever end, each Document's
    ``page_content`` is registered with the engines of the ChatLazyLlama models in this process (so a
    prompt that pastes it, e.g. through ``format_docs``, reuses its KV from the 2nd time on), and the
    query is recorded in ``metadata["query"]`` where absent (so ``any_retriever | LazyRAG()`` knows the
    question). Importing this module installs one for every run (a LangChain configure hook), as the
    LlamaIndex adapter's instrumentation handler does; pass another in ``callbacks`` only if you
    removed it."""

    run_inline = True  # the query must be in the Documents before the retriever returns them

    def __init__(self) -> None:
        self._queries: dict[UUID, str] = {}

    def on_retriever_start(self, serialized: dict, query: str, *, run_id: UUID, **kwargs: Any) -> None:
        self._queries[run_id] = query

    def on_retriever_end(self, documents: Sequence[Document], *, run_id: UUID, **kwargs: Any) -> None:
        query = self._queries.pop(run_id, None)
        _common.learn_chunks(d.page_content for d in documents)
        if query is not None:
            for d in documents:
                d.metadata.setdefault("query", query)

    def on_retriever_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._queries.pop(run_id, None)


# The configure hook adds the handler held by this variable to every callback manager, in every
# thread (the default value is seen by contexts that never set it).
_retrieval_handler: ContextVar[Optional[LazyRAGCallbackHandler]] = ContextVar(
    "lazyrag_retrieval_handler",
    default=LazyRAGCallbackHandler(),  # noqa: B039 (one handler for every context, on purpose)
)
register_configure_hook(_retrieval_handler, inheritable=True)

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "chat": None}


def _whole_message(chunks: list[AIMessageChunk]) -> AIMessage:
    """A whole answer from its streamed chunks (the last one carries usage, stats and finish reason)."""
    full = sum(chunks[1:], chunks[0])
    return AIMessage(content=full.content, usage_metadata=full.usage_metadata, response_metadata=full.response_metadata)


def _ai_chunk(chunk: ChatGenerationChunk) -> AIMessageChunk:
    """The message of a chunk ``ChatLazyLlama.generation_chunks`` made: always an AIMessageChunk (LangChain types
    ``ChatGenerationChunk.message`` as any BaseMessageChunk)."""
    return cast(AIMessageChunk, chunk.message)


def _chat_result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    message = _whole_message([_ai_chunk(c) for c in chunks])
    return ChatResult(
        generations=[
            ChatGeneration(
                message=message, generation_info={"finish_reason": message.response_metadata["finish_reason"]}
            )
        ]
    )


def _to_chat_dicts(messages: list[BaseMessage]) -> list[dict]:
    out = []
    for m in messages:
        role = _ROLES.get(m.type, "")
        if role is None:  # ChatMessage with a free role
            role = getattr(m, "role", "user")
        if not role:
            raise ValueError(
                f"ChatLazyLlama cannot take {type(m).__name__} messages (no tool calling); "
                "use human, ai and system messages."
            )
        if isinstance(m.content, list) and any(
            isinstance(b, dict) and b.get("type") not in ("text", None) for b in m.content
        ):
            raise ValueError(
                "ChatLazyLlama takes text only; this message has non-text content blocks (images, audio, files)."
            )
        out.append({"role": role, "content": m.text})
    return out


_NO_TOOLS = (
    "ChatLazyLlama has no tool calling: the small local models it runs do not emit tool calls reliably, and "
    "it has no tool-call parser. For JSON answers use llm.with_structured_output(PydanticModel or JSON schema) "
    "(validated and retried); for agents, use a text (ReAct-style) prompt."
)


class _NoToolCalling:
    """``ChatLazyLlama.bind_tools``: on the class, BaseChatModel.bind_tools itself (nothing overridden: no tool
    calling, as capability checks read it); on an instance, a method that says why there is none."""

    def __get__(self, instance, owner=None):
        if instance is None:
            return BaseChatModel.bind_tools

        def bind_tools(tools: Sequence, *, tool_choice: Optional[str] = None, **kwargs: Any) -> Runnable:
            raise NotImplementedError(_NO_TOOLS)

        return bind_tools


# names users bring from other local-model adapters, and ours
_RENAMES = {"model_id": "model", "model_name": "model", "max_new_tokens": "max_tokens", "stop_sequences": "stop"}


class ChatLazyLlama(AdapterFields, BaseChatModel):
    """A lazyrag engine as a LangChain chat model (local, offline; one engine per model is shared).

    Unknown arguments are refused. Names from ChatHuggingFace / HuggingFacePipeline are accepted:
    ``model_id`` and ``model_name`` (= ``model``), ``max_new_tokens`` (= ``max_tokens``),
    ``stop_sequences`` (= ``stop``) and ``generate_kwargs`` (temperature, top_p, seed, do_sample, ...).
    The fields it shares with ``LazyLlamaLLM`` (model, device, dtype, the sampling knobs, strategy, store,
    kv_budget), their checks and the lazy ``engine`` are ``lazyrag.integrations._adapter.AdapterFields``."""

    model_config = ConfigDict(extra="forbid")
    _renames: ClassVar[dict[str, str]] = _RENAMES

    max_tokens: int = Field(default=256, gt=0, description="Most new tokens per call.")
    stop: Optional[list[str]] = None
    logprobs: Optional[bool] = Field(
        default=None,
        description="Report each generated token's logprob in response_metadata['logprobs'] (ChatOpenAI's format).",
    )
    system_prompt: Optional[str] = Field(
        default=None, description="A system message put first when the messages have none."
    )
    streaming: bool = False
    # Accepted because callers pass them to every chat model; a local engine has no network to time out or retry.
    timeout: Optional[float] = Field(default=None, ge=0.0)
    max_retries: int = Field(default=0, ge=0)

    # -- token counting with the model's own tokenizer (LangChain's default downloads GPT-2's) --

    def get_token_ids(self, text: str) -> list[int]:
        return self.engine.prompts.encode(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Optional[Sequence] = None) -> int:
        """The prompt tokens of ``messages`` as this model sees them (chat template applied): what
        ``usage_metadata["input_tokens"]`` reports for them."""
        if tools:
            raise ValueError("ChatLazyLlama has no tool calling; count messages without tools.")
        return len(self.get_token_ids(self.engine.render_chat(self._chat_dicts(messages))))

    def _chat_dicts(self, messages: list[BaseMessage]) -> list[dict]:
        msgs = _to_chat_dicts(messages)
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    @property
    def model_name(self) -> str:
        return self._engine.model_name if self._engine is not None else _common.model_name(self.model)

    @property
    def _llm_type(self) -> str:
        return "lazyrag-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "strategy": self.strategy,
            "store": self.store,
        }

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="lazyrag",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        stops = stop or self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    def sampling_params(self, stop: Optional[list[str]] = None, **kwargs: Any):
        """The SamplingParams of a call: its keywords (``max_tokens``, ``temperature``, ...) win over the fields."""
        stop = list(stop if stop is not None else (self.stop or []))
        return self._sampling_params(kwargs.get("max_tokens", self.max_tokens), stop, kwargs)

    # -- generation --

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt = self.engine.render_chat(self._chat_dicts(messages))
        stream = _common.stream_prompt(self.engine, prompt, self.sampling_params(stop, **kwargs))
        yield from self.generation_chunks(stream, run_manager)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _chat_result(list(self._stream(messages, stop, run_manager, **kwargs)))

    def generation_chunks(
        self, stream, run_manager: Optional[CallbackManagerForLLMRun] = None
    ) -> Iterator[ChatGenerationChunk]:
        """An engine RequestStream (see _common.stream_prompt) as chat chunks; the last one (empty text,
        ``chunk_position="last"``) carries the token usage and the reuse stats."""
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self.last_chunk(stream.result())

    async def ageneration_chunks(
        self, stream, run_manager: Optional[AsyncCallbackManagerForLLMRun] = None
    ) -> AsyncIterator[ChatGenerationChunk]:
        """``generation_chunks`` for asyncio: the event loop waits on the engine's scheduler thread."""
        async for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self.last_chunk(await stream.aresult())

    def last_chunk(self, result) -> ChatGenerationChunk:
        """The stream's last chunk: empty text, the token usage and the reuse stats of ``result``."""
        s = result.stats
        # cache_read: prompt tokens whose KV came from the cache, the shared prefix's included
        # (response_metadata["lazyrag"] splits it: prefix_tokens_reused + chunk_tokens_reused).
        # The ignore: langchain-core 1.x (Python 3.11+) imports NotRequired from typing, which mypy at our
        # python_version 3.10 cannot resolve, so it reads the optional output_token_details as required.
        usage = UsageMetadata(  # type: ignore[typeddict-item]  # optional key misread as required (see above)
            input_tokens=s.prompt_tokens,
            output_tokens=s.new_tokens,
            total_tokens=s.prompt_tokens + s.new_tokens,
            input_token_details={"cache_read": s.tokens_reused},
        )
        info = _common.result_info(result)
        meta = {
            "model_name": self.model_name,
            "model_provider": "lazyrag",
            "finish_reason": info["finish_reason"],
            "ttft_s": info["ttft_s"],
            "lazyrag": info["stats"],
        }
        if result.logprobs is not None:
            meta["logprobs"] = _common.openai_logprobs(self.engine, result.logprobs)
        return ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=usage, response_metadata=meta, chunk_position="last")
        )

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # the engine's scheduler batches concurrent calls; the event loop only waits for tokens
        engine = await _common.aload_engine(self)
        prompt = engine.render_chat(self._chat_dicts(messages))
        stream = _common.stream_prompt(engine, prompt, self.sampling_params(stop, **kwargs))
        async for chunk in self.ageneration_chunks(stream, run_manager):
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _chat_result([chunk async for chunk in self._astream(messages, stop, run_manager, **kwargs)])

    # -- structured output --

    # No tool calling. ``bind_tools`` is BaseChatModel's own when read from the class, so capability checks
    # (langchain-tests' has_tool_calling: "is bind_tools overridden?") say no, and raises a clear error when called.
    bind_tools: ClassVar[_NoToolCalling] = _NoToolCalling()

    def with_structured_output(
        self, schema: Any, *, include_raw: bool = False, max_attempts: int = 3, **kwargs: Any
    ) -> Runnable:
        """Answers as ``schema`` (a Pydantic model, a TypedDict or a JSON schema dict): the schema is put in
        the prompt, the first JSON object of the answer is parsed and validated (Pydantic), and a failed
        attempt is retried with the error shown to the model, up to ``max_attempts`` times; then
        OutputParserException. An answer with no JSON object at all (the model ignores the format, as small
        models do) fails at once, not retried, with a message that says so. ``method`` (json_schema, json_mode,
        function_calling) is accepted and means the same here. ``include_raw=True`` returns ``{"raw", "parsed",
        "parsing_error"}``."""
        from lazyrag.integrations.structured import StructuredOutput

        kwargs.pop("method", None)
        kwargs.pop("strict", None)
        if kwargs:
            raise ValueError(f"with_structured_output got unsupported arguments {sorted(kwargs)}.")
        return StructuredOutput(self, schema, include_raw=include_raw, max_attempts=max_attempts).runnable()


class LazyRAGRetriever(BaseRetriever):
    """The k chunks of a lazyrag corpus store most similar to the query (FAISS + sentence-transformers).

    Each Document's text is the stored chunk text (whose KV the store holds); its metadata holds
    chunk_id, doc_id, score, num_tokens, the chunk's own metadata, and ``query``, so a
    ``retriever | LazyRAG(...)`` chain knows the question."""

    store: str
    k: int = limited_field("top_k", default=4)
    embedder: Optional[str] = None

    _retriever: Any = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        self._retriever = _common.open_retriever(self.store, self.embedder)  # StoreError for missing/empty stores

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        hits = self._retriever.retrieve(query, _common.check_top_k(kwargs.get("k", self.k), "k"))
        return [
            Document(
                page_content=h.text,
                id=str(h.id),
                metadata={
                    **h.metadata,
                    "chunk_id": h.id,
                    "doc_id": h.doc_id,
                    "score": h.score,
                    "num_tokens": h.num_tokens,
                    "query": query,
                },
            )
            for h in hits
        ]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        import asyncio

        return await asyncio.to_thread(
            self._get_relevant_documents, query, run_manager=run_manager.get_sync(), **kwargs
        )


class LazyRAGEmbeddings(BaseModel, Embeddings):
    """sentence-transformers embeddings for LangChain's stock vector stores, offline: the embedded
    all-MiniLM-L6-v2 by default (the model lazyrag stores index with)."""

    model_config = ConfigDict(extra="forbid")

    model_name: Optional[str] = Field(
        default=None, description="A local sentence-transformers folder; None = the embedded all-MiniLM-L6-v2."
    )

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        from lazyrag.store.retriever import embed

        return embed(_common.load_embedder(self.model_name), list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


RAGInput = Union[str, dict, list]


class LazyRAG(RunnableSerializable[RAGInput, AIMessage]):
    """Answer a question over documents with their chunk KV stitched from the cache.

    Input: a question (str; needs ``retriever``), ``{"question": ..., "documents": [...]}`` (documents:
    LangChain Documents or strings; without them ``retriever`` is used), or the list of Documents a
    LazyRAGRetriever returns (their metadata carries the query), so ``retriever | rag`` works.
    Output: an AIMessage (``response_metadata["lazyrag"]``: reuse stats; ``["sources"]``: document ids);
    streams AIMessageChunks. Compose with StrOutputParser for plain text."""

    model_config = ConfigDict(arbitrary_types_allowed=True)  # the retriever may be any Runnable

    llm: ChatLazyLlama = Field(default_factory=ChatLazyLlama)
    retriever: Optional[Runnable] = None

    def _parse(self, input: RAGInput) -> tuple[str, Optional[list]]:
        """The question and the documents (None: the retriever has to find them)."""
        docs = None
        if isinstance(input, str):
            question = input
        elif isinstance(input, dict):
            asked = input.get("question") or input.get("input") or input.get("query")
            docs = input.get("documents", input.get("context"))
            if not isinstance(asked, str):
                raise ValueError(
                    "LazyRAG needs {'question': str, 'documents': [...]}; got keys " + ", ".join(map(str, input))
                )
            question = asked
            key = "documents" if "documents" in input else "context"
            if isinstance(docs, (str, bytes, Document)):  # iterating it would make one chunk per character
                raise ValueError(
                    f"LazyRAG's {key!r} must be a list of Documents or strings, not one "
                    f"{type(docs).__name__}; wrap it: {{'question': ..., {key!r}: [text]}} (or split it)."
                )
            if isinstance(docs, (set, frozenset)):  # the documents' order is the prompt's
                raise ValueError(
                    f"LazyRAG's {key!r} must be a list of Documents or strings, not a {type(docs).__name__}: "
                    "its order can change between runs, and with it the prompt and the answer; pass a list "
                    "(sorted(...) if any order will do)."
                )
            if isinstance(docs, Mapping):
                raise ValueError(
                    f"LazyRAG's {key!r} must be a list of Documents or strings, not a {type(docs).__name__} "
                    "(iterating it gives its keys); pass the texts as a list: list(d.values())."
                )
        elif isinstance(input, list):
            queries: set[Any] = {d.metadata.get("query") for d in input if isinstance(d, Document)}
            if len(queries) != 1 or None in queries:
                raise ValueError(
                    "LazyRAG got a list of documents without the question (Documents a retriever returns carry "
                    "it in metadata['query']): pipe a retriever into LazyRAG, use rag_chain(retriever, rag), "
                    "or pass {'question', 'documents'}."
                )
            question, docs = queries.pop(), input
        else:
            raise TypeError(
                f"LazyRAG takes a question (str), a dict or a list of Documents, not {type(input).__name__}."
            )
        if docs is None and self.retriever is None:
            raise ValueError(
                "LazyRAG got only a question and has no retriever: pass LazyRAG(retriever=...), "
                "or {'question': ..., 'documents': [...]}."
            )
        return question, docs

    @staticmethod
    def _with_sources(chunk: ChatGenerationChunk, docs: list) -> AIMessageChunk:
        msg = _ai_chunk(chunk)
        if msg.chunk_position == "last":
            msg.response_metadata["sources"] = [d.id if isinstance(d, Document) else None for d in docs]
        return msg

    @staticmethod
    def _texts(docs: list) -> list[str]:
        return [d.page_content if isinstance(d, Document) else str(d) for d in docs]

    def _llm_start(self, question: str, texts: list[str]) -> tuple:
        """on_chat_model_start's arguments for the answer LazyRAG generates, so callback handlers
        (tracing, UsageMetadataCallbackHandler, token counters) see an LLM run as for ChatLazyLlama."""
        llm = self.llm
        messages = [HumanMessage(content="\n\n".join([*texts, f"Question: {question}"]))]
        return (dumpd(llm), [messages]), {
            "invocation_params": llm._get_invocation_params(),
            "name": llm.get_name(),
            "batch_size": 1,
        }

    @staticmethod
    def _llm_result(chunks: list[ChatGenerationChunk]) -> LLMResult:
        generations: list[Generation] = list(_chat_result(chunks).generations)
        return LLMResult(generations=[generations])

    def _chunks_stream(self, input: RAGInput, config: Optional[RunnableConfig]) -> Iterator[AIMessageChunk]:
        question, docs = self._parse(input)
        if docs is None:
            assert self.retriever is not None  # _parse raises without documents and without a retriever
            docs = self.retriever.invoke(question, config)
        docs = list(docs)
        llm, texts = self.llm, self._texts(docs)
        args, kw = self._llm_start(question, texts)
        (run,) = get_callback_manager_for_config(config or {}).on_chat_model_start(*args, **kw)
        chunks: list[ChatGenerationChunk] = []
        try:
            stream = _common.stream_chunks(llm.engine, question, texts, llm.sampling_params(), llm.system_prompt)
            for chunk in llm.generation_chunks(stream, run):
                chunks.append(chunk)
                yield self._with_sources(chunk, docs)
        except BaseException as e:
            run.on_llm_error(e)
            raise
        run.on_llm_end(self._llm_result(chunks))

    async def _achunks_stream(self, input: RAGInput, config: Optional[RunnableConfig]) -> AsyncIterator[AIMessageChunk]:
        question, docs = self._parse(input)
        if docs is None:
            assert self.retriever is not None  # _parse raises without documents and without a retriever
            docs = await self.retriever.ainvoke(question, config)
        docs = list(docs)
        llm, texts = self.llm, self._texts(docs)
        args, kw = self._llm_start(question, texts)
        (run,) = await get_async_callback_manager_for_config(config or {}).on_chat_model_start(*args, **kw)
        chunks: list[ChatGenerationChunk] = []
        try:
            engine = await _common.aload_engine(llm)
            stream = _common.stream_chunks(engine, question, texts, llm.sampling_params(), llm.system_prompt)
            async for chunk in llm.ageneration_chunks(stream, run):
                chunks.append(chunk)
                yield self._with_sources(chunk, docs)
        except BaseException as e:
            await run.on_llm_error(e)
            raise
        await run.on_llm_end(self._llm_result(chunks))

    @staticmethod
    def _add_up(final: Any, x: Any) -> Any:
        """The whole input of a streamed step: partial outputs (a RunnableParallel's AddableDicts) added up."""
        try:
            return x if final is None else final + x
        except TypeError:
            return x

    def _transform(
        self, inputs: Iterator, run_manager=None, config: Optional[RunnableConfig] = None
    ) -> Iterator[AIMessageChunk]:
        final: Any = None  # checked by _parse
        for x in inputs:
            final = self._add_up(final, x)
        yield from self._chunks_stream(final, config)

    async def _atransform(
        self, inputs: AsyncIterator, run_manager=None, config: Optional[RunnableConfig] = None
    ) -> AsyncIterator[AIMessageChunk]:
        final: Any = None  # checked by _parse
        async for x in inputs:
            final = self._add_up(final, x)
        async for chunk in self._achunks_stream(final, config):
            yield chunk

    def invoke(self, input: RAGInput, config: Optional[RunnableConfig] = None, **kwargs: Any) -> AIMessage:
        return _whole_message(list(self.stream(input, config)))

    def stream(
        self, input: RAGInput, config: Optional[RunnableConfig] = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        yield from self.transform(iter([input]), config)

    def transform(
        self, input: Iterator, config: Optional[RunnableConfig] = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        # LangChain types the items as the class's output (AIMessage); they are _transform's AIMessageChunks
        chunks = self._transform_stream_with_config(input, self._transform, config, run_type="chain")
        yield from cast(Iterator[AIMessageChunk], chunks)

    # asyncio: the engine's scheduler batches concurrent calls (abatch, gather), no thread per request

    async def ainvoke(self, input: RAGInput, config: Optional[RunnableConfig] = None, **kwargs: Any) -> AIMessage:
        return _whole_message([chunk async for chunk in self.astream(input, config)])

    async def astream(
        self, input: RAGInput, config: Optional[RunnableConfig] = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        async def one():
            yield input

        async for chunk in self.atransform(one(), config):
            yield chunk

    async def atransform(
        self, input: AsyncIterator, config: Optional[RunnableConfig] = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        # LangChain types the items as the class's output (AIMessage); they are _atransform's AIMessageChunks
        chunks = self._atransform_stream_with_config(input, self._atransform, config, run_type="chain")
        async for chunk in cast(AsyncIterator[AIMessageChunk], chunks):
            yield chunk


def rag_chain(retriever: Runnable, rag: Optional[LazyRAG] = None) -> Runnable:
    """``{"documents": retriever, "question": RunnablePassthrough()} | rag``: works with any retriever
    (LazyRAGRetriever alone can also be piped straight into ``rag``)."""
    return {"documents": retriever, "question": RunnablePassthrough()} | (rag or LazyRAG())


# -- corpus stores --------------------------------------------------------------------------------


def precache_store(documents, out, chat_model_or_engine=None, **options) -> PrecacheReport:
    """Build a corpus store at ``out`` (as ``lazyrag precache`` does: chunk KV in files, a FAISS index) from
    LangChain Documents, so that the stock ``{"context": retriever | format_docs, ...} | prompt |
    ChatLazyLlama(store=out)`` chain in any later process answers from stored KV from its first question.
    Returns the PrecacheReport.

    ``documents``: Documents (a loader's or a text splitter's output) or strings, an InMemoryVectorStore, a
    vector store with a ``docstore`` and ``index_to_docstore_id`` (langchain_community's FAISS), or a
    VectorStoreRetriever over one (``store.as_retriever()``). Each Document is one chunk: its text is its
    ``page_content``, what ``format_docs`` (``"\\n\\n".join(d.page_content ...)``) pastes into the prompt, its
    ``doc_id`` the Document's id (else ``langchain:documents:<position>``), its metadata the Document's (values
    JSON cannot hold as their str()). The same Documents in the same order resume an interrupted build (or find
    it done), Documents appended extend the store, changed ones raise StoreError (``overwrite=True`` rebuilds).
    Another vector store: pass the Documents you added to it.

    ``options``: PrecacheConfig's fields (``_common.precache_documents``); ``chunk_tokens`` defaults to None, which
    no Document exceeds. A Document longer than a ``chunk_tokens`` you pass is split into token windows (with a
    warning) and then only partly reused: see ``lazyrag.integrations.llama_index.precache_store``.

    ``chat_model_or_engine``: the ChatLazyLlama or LazyEngine whose model computes the KV (default: the shared
    engine of the default model); it has the store attached afterwards. Readers need the same model and dtype."""
    from lazyrag.store.build import Document as StoreDocument

    found, source = _documents_of(documents)
    docs = [StoreDocument(d.id or f"{source}:{i}", d.page_content, dict(d.metadata)) for i, d in enumerate(found)]
    return _common.precache_documents(docs, source, out, chat_model_or_engine, options, "precache_store")


_WHAT_TO_PASS = (
    "precache_store takes LangChain Documents (a loader's or text splitter's output) or strings, an "
    "InMemoryVectorStore, a vector store with a docstore (FAISS), or a retriever over one; got {}. For "
    "another vector store, pass the Documents you added to it, in the same order."
)


def _documents_of(source) -> tuple[list[Document], str]:
    """The Documents of what ``precache_store`` takes, and the name of where they came from (the store's sources)."""
    if isinstance(source, VectorStoreRetriever):
        source = source.vectorstore
    if isinstance(source, VectorStore):
        return _vector_store_documents(source), f"langchain:{type(source).__name__}"
    if isinstance(source, (str, bytes, Document, Mapping)) or not hasattr(source, "__iter__"):
        raise TypeError(_WHAT_TO_PASS.format(type(source).__name__))
    found = [Document(page_content=d) if isinstance(d, str) else d for d in source]
    bad = next((d for d in found if not isinstance(d, Document)), None)
    if bad is not None:
        raise TypeError(_WHAT_TO_PASS.format(f"a list holding {type(bad).__name__}"))
    return found, "langchain:documents"


def _vector_store_documents(store: VectorStore) -> list[Document]:
    """Every Document of a vector store that can list them, in the order they were added."""
    table = getattr(store, "store", None)
    if isinstance(table, dict):  # InMemoryVectorStore: id -> {"id", "vector", "text", "metadata"}
        return store.get_by_ids(list(table))
    docstore: Any = getattr(store, "docstore", None)  # duck-typed: any docstore with search()
    order = getattr(store, "index_to_docstore_id", None)
    if hasattr(docstore, "search") and isinstance(order, dict):  # FAISS: index position -> docstore id
        found = [docstore.search(order[i]) for i in sorted(order)]
        missing = next((order[i] for i, d in zip(sorted(order), found) if not isinstance(d, Document)), None)
        if missing is not None:
            raise ValueError(f"{type(store).__name__}'s docstore has no Document {missing!r}, which its index lists.")
        return found
    raise TypeError(_WHAT_TO_PASS.format(f"a {type(store).__name__}, which does not list its Documents"))
