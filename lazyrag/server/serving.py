"""The engine side of ``lazyrag serve`` (vLLM's ``OpenAIServingChat`` / ``OpenAIServingCompletion``, in one class):
``OpenAIServing`` turns an OpenAI request into engine prompts, submits them, and turns the results (whole, or
streamed as server-sent events) into OpenAI responses. ``InFlight`` counts the generations admitted under
``--max-pending``.

Where a request's chunks come from, in order:
1. ``documents`` (a lazyrag field): the texts are the chunks, placed before the last user message;
2. chunks the engine already knows (cached, given before, or in the attached store) found inside the
   message text, e.g. a LangChain or LlamaIndex prompt that stuffs retrieved passages;
3. chat only, with ``--store``: the top ``k`` chunks retrieved for the last user message
   (``retrieve: false`` turns it off, ``retrieve: true`` forces it).
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from lazyrag.engine.sampling import logprob_entries, openai_chat_logprobs, openai_completion_logprobs
from lazyrag.prompt import check_text
from lazyrag.server.errors import APIError
from lazyrag.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
    error_body,
    new_id,
    now,
    usage,
)

if TYPE_CHECKING:
    from lazyrag.engine import GenerationResult, LazyEngine, RequestStream
    from lazyrag.server.config import ServerConfig
    from lazyrag.server.metrics import ServerMetrics
    from lazyrag.store.retriever import Retriever


class InFlight:
    """The generations admitted and not finished, under ``--max-pending`` (one event loop: no lock needed).
    ``reserve`` runs before a request's first ``await``, so two requests never both take the last places."""

    def __init__(self, max_pending: int):
        self.max_pending, self.count = max_pending, 0

    def reserve(self, generations: int) -> None:
        if generations > self.max_pending:  # never fits, however idle the server: retrying cannot help
            raise APIError(
                400,
                f"The request asks for {generations} generations (prompts x n) and this server's --max-pending "
                f"is {self.max_pending}: split the request, or start the server with a larger --max-pending.",
                "invalid_request_error",
                "n",
            )
        if self.count + generations > self.max_pending:
            raise APIError(
                503,
                f"The server has {self.count} generations in flight and the request asks for "
                f"{generations} (--max-pending {self.max_pending}); retry shortly.",
                "server_overloaded",
            )
        self.count += generations

    def release(self, generations: int) -> None:
        self.count -= generations


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    try:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def finish_reason(result: GenerationResult) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def total_usage(results: list[GenerationResult]) -> dict:
    s = [r.stats for r in results]
    return usage(sum(x.prompt_tokens for x in s), sum(x.new_tokens for x in s), sum(x.tokens_reused for x in s))


def lazyrag_info(results: list[GenerationResult]) -> dict:
    """What lazyrag adds to a response: per choice, the reuse stats and time to first token."""
    return {"choices": [{"ttft_s": r.ttft_s, "total_s": r.total_s, **r.stats.as_dict()} for r in results]}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def chat_chunk(head: dict, i: int, delta: str | None, reason: str | None, logprobs=None) -> dict:
    """Choice i's streamed chat event; delta None: its opening one (the role)."""
    d = {"role": "assistant", "content": ""} if delta is None else ({"content": delta} if delta else {})
    return {
        **head,
        "object": "chat.completion.chunk",
        "choices": [{"index": i, "delta": d, "finish_reason": reason, "logprobs": logprobs}],
    }


def completion_chunk(head: dict, i: int, delta: str | None, reason: str | None, logprobs=None) -> dict | None:
    """Choice i's streamed completion event; delta None: None (completions streams have no role chunk)."""
    if delta is None:
        return None
    return {
        **head,
        "object": "text_completion",
        "choices": [{"index": i, "text": delta, "finish_reason": reason, "logprobs": logprobs}],
    }


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, str | None]]:
    """(choice index, text delta) as any choice produces it; (index, None) when that choice ends."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream):
        try:
            async for delta in stream:
                await queue.put((i, delta))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            item = await queue.get()
            ended += item[1] is None
            yield item
    finally:
        for t in tasks:
            t.cancel()


class LogprobsSent:
    """A streamed choice's logprobs: each chunk carries those of the tokens generated since the last one."""

    def __init__(self, serving: OpenAIServing, stream: RequestStream, chat: bool):
        self.serving, self.request, self.chat, self.sent, self.offset = serving, stream.request, chat, 0, 0

    def next(self):
        if self.request.logprobs is None:
            return None
        new = self.request.logprobs[self.sent :]
        self.sent += len(new)
        if self.chat:
            return self.serving.chat_logprobs(new)
        out = self.serving.completion_logprobs(new, self.offset)
        self.offset += sum(map(len, out["tokens"]))
        return out


class OpenAIServing:
    """OpenAI's chat and completion requests (and vLLM's /tokenize, /detokenize) over one engine. ``retriever``
    (over the store attached to ``engine``) serves chat requests that bring no chunks."""

    def __init__(
        self,
        engine: LazyEngine,
        config: ServerConfig,
        metrics: ServerMetrics,
        in_flight: InFlight,
        retriever: Retriever | None = None,
    ):
        self.engine, self.config, self.metrics, self.in_flight = engine, config, metrics, in_flight
        self.retriever = retriever
        self.max_model_len = config.max_model_len or engine.max_context  # prompt plus answer, in tokens
        self._flag = " (lazyrag serve --max-model-len)" if config.max_model_len else ""

    # -- checks, before any work -------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.config.model_name, *self.config.aliases):
            raise APIError(
                404,
                f"The model {model!r} does not exist here; this server serves {self.config.model_name!r} "
                "(GET /v1/models).",
                "invalid_request_error",
                "model",
            )

    def admit(self, body: _Common, generations: int) -> None:
        """Refuse what is wrong with the request before any work; else reserve its generations under
        --max-pending (released by ``done``, or by ``in_flight.release`` when the request fails before it is
        submitted)."""
        self.check_model(body.model)
        bad = body.unsupported()
        if bad:
            raise APIError(
                400,
                f"Not supported by lazyrag serve: {', '.join(bad)}. Leave them out.",
                "invalid_request_error",
                bad[0].split()[0],
            )
        self.in_flight.reserve(generations)

    def _room(self, max_tokens: int | None, num_prompt_tokens: int) -> int:
        """The answer tokens left after the prompt under --max-model-len; a 400 worded as vLLM and OpenAI word
        it (clients, LiteLLM, ..., recognise a context overflow by it) when the request does not fit."""
        room = self.max_model_len - num_prompt_tokens
        limit = f"This model's maximum context length is {self.max_model_len} tokens{self._flag}."
        if room < 1:
            raise APIError(
                400,
                f"{limit} However, your request has {num_prompt_tokens} input tokens: send fewer or "
                "shorter documents or messages.",
                param="messages",
            )
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"{limit} However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} in max_tokens): ask for at most {room}.",
                param="max_tokens",
            )
        return room

    def sampling_params(self, body: _Common, max_tokens: int | None, num_prompt_tokens: int, choice: int):
        from lazyrag.engine import SamplingParams

        room = self._room(max_tokens, num_prompt_tokens)
        seed = None if body.seed is None else (body.seed + choice) % 2**63
        try:
            return SamplingParams(
                max_new_tokens=min(max_tokens or self.config.max_tokens, room),
                temperature=self.config.temperature if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
                seed=seed,
                strategy=body.strategy or self.config.strategy,
                top_k=-1 if body.top_k is None else body.top_k,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                logprobs=body.engine_logprobs(),
                ignore_eos=bool(body.ignore_eos),
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # -- prompts: where the chunks come from, laid out as the engine lays them out ------------------

    async def retrieved(self, question: str, k: int) -> list[str]:
        if self.retriever is None:
            raise APIError(
                400, "retrieve: true needs a corpus store: start the server with --store STORE.", param="retrieve"
            )
        try:
            check_text(question, "the question")
        except ValueError as e:
            raise APIError(400, str(e)) from None
        hits = await asyncio.to_thread(self.retriever.retrieve, question, k)  # k is clamped to the store's size there
        return [h.text for h in hits]

    def with_documents(self, content: str, documents: list[str]) -> str:
        """The user's content with the documents before it, laid out as ``engine.build_prompt`` lays them
        out, so a request through the server reuses the same chunk KV as one from Python."""
        self.engine.register_chunks(documents)
        assert self.engine.prompts is not None  # a served engine has a tokenizer
        return self.engine.prompts.user_content(content, documents)

    def _rendered_chat(self, messages: list[dict], documents: list[str] | None) -> tuple[str, bool]:
        """The chat's text, and whether it holds a chunk the engine knows (tokenizer and chunk-finder work:
        called off the event loop, as every layout step below)."""
        if documents is None and self.config.pasted_context:
            self.engine.register_pasted(messages)
        text = self.engine.render_chat(messages)
        return text, self.retriever is not None and bool(self.engine.chunk_finder.find(text))

    def _chat_laid_out(self, text: str, messages: list[dict], last: int, documents: list[str] | None):
        if not documents:
            return self.engine.layout_from_text(text)
        messages[last] = {"role": "user", "content": self.with_documents(messages[last]["content"], documents)}
        return self.engine.layout_from_text(self.engine.render_chat(messages))

    async def chat_layout(self, body: ChatCompletionRequest):
        messages = chat_messages(body.messages)
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise APIError(400, "messages hold no user message: nothing to answer.", param="messages")
        last = users[-1]
        documents = body.document_texts()
        text, holds_known = await asyncio.to_thread(self._rendered_chat, messages, documents)
        # retrieve when asked to, or by default when a store is attached and the text holds no known chunk
        if documents is None and (
            body.retrieve or (body.retrieve is None and self.retriever is not None and not holds_known)
        ):
            documents = await self.retrieved(messages[last]["content"], body.k or self.config.k)
        return await asyncio.to_thread(self._chat_laid_out, text, messages, last, documents)

    def _completion_laid_out(self, prompt: str, documents: list[str] | None):
        if documents:  # the prompt is the question of the engine's RAG prompt, as engine.generate(prompt, documents)
            return self.engine.layout_from_text(
                self.engine.render_chat([{"role": "user", "content": self.with_documents(prompt, documents)}])
            )
        if self.config.pasted_context:
            self.engine.register_pasted(prompt)
        return self.engine.layout_from_text(prompt)  # raw text: known chunks inside it are still reused

    async def completion_layout(self, prompt: str, body: CompletionRequest):
        documents = body.document_texts()
        if documents is None and body.retrieve:
            documents = await self.retrieved(prompt, body.k or self.config.k)
        return await asyncio.to_thread(self._completion_laid_out, prompt, documents)

    # -- the engine: submit, wait or stream, release ---------------------------------------------

    async def submit(self, layouts: list, body: _Common, max_tokens: int | None) -> list[RequestStream]:
        """One engine request per choice (a prompt's ``n`` choices, or one per prompt of a completion batch)."""
        streams = []
        try:
            for i, layout in enumerate(layouts):
                streams.append(self.engine.submit(layout, self.sampling_params(body, max_tokens, layout.num_tokens, i)))
        except BaseException as e:
            for s in streams:  # the choices already queued do not run without the others
                s.close(wait=False)
            self.in_flight.release(len(layouts))
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            raise
        return streams

    def done(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.request.done:
                self.metrics.aborted.inc()
                s.close(wait=False)  # the client went away: the driver frees its blocks at its next step
        self.in_flight.release(len(streams))

    async def results(self, streams: list[RequestStream], http: Request) -> list[GenerationResult]:
        """Every stream's result; the client hanging up aborts them all (their blocks are freed)."""
        tasks = [asyncio.ensure_future(s.aresult()) for s in streams]
        try:
            while True:
                done, _ = await asyncio.wait(tasks, timeout=0.5)
                if len(done) == len(tasks):
                    break
                if await http.is_disconnected():
                    raise asyncio.CancelledError("client disconnected")
            results = [t.result() for t in tasks]  # a request's own error is raised here
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(500, f"The request failed inside the engine: {e}", "server_error") from None
        finally:
            for t in tasks:
                t.cancel()
            self.done(streams)
        for r in results:
            self.metrics.finished(r)
        return results

    def chat_logprobs(self, logprobs) -> dict:
        return {**openai_chat_logprobs(logprob_entries(self.engine.tokenizer, logprobs)), "refusal": None}

    def completion_logprobs(self, logprobs, offset: int = 0) -> dict:
        return openai_completion_logprobs(logprob_entries(self.engine.tokenizer, logprobs), offset)

    async def _events(self, streams: list[RequestStream], chunk_of: Callable, head: dict, include_usage: bool, sent):
        try:
            for i in range(len(streams)):
                opening = chunk_of(i, None, None)
                if opening is not None:
                    yield sse(opening)
            async for i, delta in merged(streams):
                if delta is not None:
                    yield sse(chunk_of(i, delta, None, sent[i].next()))
                    continue
                try:
                    result = streams[i].request.result()
                except Exception as e:  # the request's own fault: reported in the stream, others go on
                    yield sse(error_body(f"The request failed inside the engine: {e}", "server_error", 500))
                    continue
                self.metrics.finished(result)
                yield sse(chunk_of(i, "", finish_reason(result), sent[i].next()))
            if include_usage:
                results = [s.request.result() for s in streams if s.request.error is None]
                yield sse({**head, "choices": [], "usage": total_usage(results), "lazyrag": lazyrag_info(results)})
            yield sse("[DONE]")
        finally:
            self.done(streams)  # also on a client that hung up: Starlette cancels this generator

    def streaming(self, streams, chunk_of: Callable, head: dict, include_usage: bool, chat: bool) -> StreamingResponse:
        """``chunk_of(i, delta, finish_reason, logprobs)``: choice i's event (delta None: its opening one, or None)."""
        sent = [LogprobsSent(self, s, chat) for s in streams]
        return StreamingResponse(
            self._events(streams, chunk_of, head, include_usage, sent),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- the endpoints' work -----------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, http: Request):
        self.admit(body, body.n)
        try:
            layout = await self.chat_layout(body)
        except BaseException as e:
            self.in_flight.release(body.n)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="messages") from None
            raise
        streams = await self.submit([layout] * body.n, body, body.max_completion_tokens or body.max_tokens)
        head = {"id": new_id("chatcmpl"), "created": now(), "model": self.config.model_name}
        if body.stream:
            chunk_of = partial(chat_chunk, head)
            return self.streaming(
                streams, chunk_of, {**head, "object": "chat.completion.chunk"}, body.include_usage(), chat=True
            )
        results = await self.results(streams, http)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": r.text},
                "finish_reason": finish_reason(r),
                "logprobs": None if r.logprobs is None else self.chat_logprobs(r.logprobs),
            }
            for i, r in enumerate(results)
        ]
        return {
            **head,
            "object": "chat.completion",
            "choices": choices,
            "usage": total_usage(results),
            "lazyrag": lazyrag_info(results),
        }

    async def completion(self, body: CompletionRequest, http: Request):
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is an empty list: send a string or a list of strings.", param="prompt")
        self.admit(body, len(prompts) * body.n)
        try:
            layouts = [await self.completion_layout(p, body) for p in prompts]
        except BaseException as e:
            self.in_flight.release(len(prompts) * body.n)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="prompt") from None
            raise
        streams = await self.submit([lay for lay in layouts for _ in range(body.n)], body, body.max_tokens)
        head = {"id": new_id("cmpl"), "created": now(), "model": self.config.model_name}
        if body.stream:
            chunk_of = partial(completion_chunk, head)
            return self.streaming(
                streams, chunk_of, {**head, "object": "text_completion"}, body.include_usage(), chat=False
            )
        results = await self.results(streams, http)
        choices = [
            {
                "index": i,
                "text": r.text,
                "finish_reason": finish_reason(r),
                "logprobs": None if r.logprobs is None else self.completion_logprobs(r.logprobs),
            }
            for i, r in enumerate(results)
        ]
        return {
            **head,
            "object": "text_completion",
            "choices": choices,
            "usage": total_usage(results),
            "lazyrag": lazyrag_info(results),
        }

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template (with lazyrag's default system
        turn when they bring none, as /v1/chat/completions renders them), as token ids."""
        self.check_model(body.model)
        tokenizer = self.engine.tokenizer
        chat = body.messages is not None
        messages = chat_messages(body.messages) if body.messages is not None else None

        def run() -> list[int]:
            text = body.prompt
            if messages is not None:
                assert self.engine.prompts is not None  # a served engine has a tokenizer
                text = self.engine.prompts.render(messages, body.add_generation_prompt)
            special = (not chat) if body.add_special_tokens is None else body.add_special_tokens
            return list(tokenizer(text, add_special_tokens=special).input_ids)

        ids = await asyncio.to_thread(run)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab = len(self.engine.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the tokenizer's vocabulary [0, {vocab}).", param="tokens")
        return {"prompt": await asyncio.to_thread(self.engine.tokenizer.decode, body.tokens)}

    def models(self) -> dict:
        card = {"object": "model", "created": now(), "owned_by": "lazyrag", "max_model_len": self.max_model_len}
        return {"object": "list", "data": [{"id": name, **card} for name in (self.config.model_name,)]}
