"""`lazyrag serve` as its users drive it: a real uvicorn server on loopback, the real default model, and
the stock clients (openai, LangChain's ChatOpenAI, LlamaIndex's OpenAILike) pointed at it."""

import json
import socket
import time

import httpx
import openai
import pytest

from tests.helpers import TINY_DOCS, Running, slow_body_answer

pytestmark = pytest.mark.slow

MODEL = "smollm2-test"
NOTES = [  # chunks no store holds: the first request encodes them, later ones reuse them
    "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London, from a mould.",
    "Tea became popular in Britain after Catherine of Braganza brought the habit to the court in 1662.",
    "The Danube rises in the Black Forest and empties into the Black Sea through a wide delta.",
]


@pytest.fixture(scope="module")
def server(adapter_engine, tiny_store, embedder):  # noqa: F811
    from lazyrag.server import ServerConfig, build_app
    from lazyrag.store.retriever import Retriever

    retriever = Retriever(adapter_engine.attach_store(tiny_store), embedder)
    running = Running(build_app(adapter_engine, ServerConfig(MODEL, max_tokens=24, k=2), retriever))
    running.retriever = retriever
    yield running
    running.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _engine_answer(engine, user_text: str, max_tokens: int, chat: bool = True) -> str:
    """What the engine answers from Python for the same prompt text (greedy, the server's default strategy)."""
    from lazyrag.engine import SamplingParams

    text = engine.render_chat([{"role": "user", "content": user_text}]) if chat else user_text
    return (
        engine.submit(engine.layout_from_text(text), SamplingParams(max_tokens, strategy="lazy+recover")).result().text
    )


def _reused(engine) -> int:
    """Chunk lookups served from KV computed before: the pool's, or a tier's (the store) promoted into it."""
    return engine.cache.stats.hits + engine.cache.stats.tier_hits


def _settled(engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() or engine.cache.num_pinned:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


def test_chat_with_documents_reuses_chunk_kv_from_the_second_question(client, adapter_engine):
    first = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who discovered penicillin?"}],
        extra_body={"documents": NOTES},
    )
    info = first.model_extra["lazyrag"]["choices"][0]
    assert info["chunks_missed"] == 3 and info["chunks_hit"] == 0
    second = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Into which sea does the Danube flow?"}],
        extra_body={"documents": NOTES[::-1]},
    )
    info = second.model_extra["lazyrag"]["choices"][0]
    assert info["chunks_hit"] == 3 and info["chunks_missed"] == 0  # another order: the same cached KV
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= sum(len(adapter_engine.prompts.encode_chunk(n)) for n in NOTES)
    assert second.usage.prompt_tokens > cached and second.usage.completion_tokens >= 1
    assert second.choices[0].finish_reason in ("stop", "length")
    # the server lays the prompt out as the engine does from Python: the same prompt, the same greedy answer
    same = adapter_engine.generate(
        "Into which sea does the Danube flow?", NOTES[::-1], max_new_tokens=24, strategy="lazy+recover"
    )
    assert second.choices[0].message.content == same.text and second.usage.prompt_tokens == same.stats.prompt_tokens


def test_streaming_chat_and_completions(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "When did tea become popular in Britain?"}],
            extra_body={"documents": NOTES},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5)
    assert plain.choices[0].text and plain.usage.prompt_tokens > 0
    streamed = list(
        client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text  # greedy: the same text
    two = client.completions.create(model=MODEL, prompt=["One, two,", "A, B,"], max_tokens=3)
    assert [c.index for c in two.choices] == [0, 1]


def test_chat_without_chunks_retrieves_from_the_store(server, client, adapter_engine):
    question = "How deep is the Mariana Trench?"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}])
    info = r.model_extra["lazyrag"]["choices"][0]
    assert info["chunks_hit"] == 2 and info["chunks_missed"] == 0  # --k 2, their KV read from the store
    top = [h.text for h in server.retriever.retrieve(question, 2)]
    assert any("Mariana" in t for t in top)
    same = adapter_engine.generate(question, top, max_new_tokens=24, strategy="lazy+recover")
    assert r.choices[0].message.content == same.text  # answered over exactly the retrieved chunks
    off = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], extra_body={"retrieve": False}
    )
    assert off.model_extra["lazyrag"]["choices"][0]["chunks_hit"] == 0


def test_store_trouble_is_a_clear_answer_without_server_paths(server, monkeypatch):
    """With --store: a lone surrogate in the question is the client's 400, not a 500 from the embedder; a store that
    cannot be read is a 503 whose message holds no server path (the log has it)."""
    from lazyrag.store import StoreError

    url, head = f"{server.url}/v1/chat/completions", {"content-type": "application/json"}
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "How deep \\ud800 is it?"}]}' % MODEL.encode()
    r = httpx.post(url, content=body, headers=head)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text

    def damaged(*a, **k):
        raise StoreError("/srv/secret/stores/nq/chunks.sqlite: row 7 does not match its digest")

    monkeypatch.setattr(server.retriever, "retrieve", damaged)
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "How deep is it?"}]})
    assert r.status_code == 503 and "corpus store" in r.json()["error"]["message"], r.text
    assert "/srv/secret" not in r.text


def test_models_health_and_metrics(server, client, adapter_engine, monkeypatch):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    # an engine that cannot answer (a tensor-parallel rank died: tests/distributed checks health_problem) is a 503
    monkeypatch.setattr(adapter_engine, "health_problem", lambda: "tensor-parallel rank 1 (pid 7) exited with code -9")
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 503 and r.json()["status"] == "error" and "rank 1" in r.json()["error"]
    monkeypatch.undo()
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who discovered penicillin?"}],
        extra_body={"documents": NOTES},
        max_tokens=4,
    )
    text = httpx.get(f"{server.url}/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["lazyrag_time_to_first_token_seconds_count"] >= 1
    assert values["lazyrag_chunk_hits_total"] >= 3 and values["lazyrag_cached_prompt_tokens_total"] > 0
    assert 'lazyrag_requests_total{endpoint="/v1/chat/completions",status="200"}' in values
    assert values['lazyrag_cache_bytes{tier="device"}'] > 0
    # the same numbers as engine.cache_report(): per tier (the attached store included), and the reuse split
    report = server.app.state.engine.cache_report()
    store = next(r for r in report["tiers"] if r["label"].startswith("store "))
    assert store["entries"] == len(server.retriever.store) > 0 and store["bytes"] > 0
    assert values[f'lazyrag_cache_tier_hits_total{{tier="{store["tier"]}"}}'] == store["hits"]
    assert values['lazyrag_cache_tier_hits_total{tier="device"}'] >= 1
    assert (
        values['lazyrag_cache_reused_tokens_total{kind="chunk"}'] > 0
        and 'lazyrag_cache_reused_tokens_total{kind="prefix"}' in values
    )
    assert "lazyrag_time_per_output_token_seconds_bucket" in text


def test_bad_requests_get_openai_errors(server, client):
    user = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.chat.completions.create(model="gpt-4o", messages=user)
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=user, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=MODEL, messages=user, logit_bias={"1": 5})
    with pytest.raises(openai.UnprocessableEntityError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=user, top_logprobs=3)
    with pytest.raises(openai.UnprocessableEntityError, match="presence_penalty"):
        client.chat.completions.create(model=MODEL, messages=user, presence_penalty=3)
    with pytest.raises(openai.UnprocessableEntityError, match="repetition_penalty"):
        client.chat.completions.create(model=MODEL, messages=user, extra_body={"repetition_penalty": 0})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=MODEL, messages=user, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=user, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="no user message"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}])
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=user, extra_body={"strategy": "nonsense"})
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=user, extra_body={"k": 10**9})
    for body in (
        b"{not json",
        b"[]",
        json.dumps({"messages": "hi"}).encode(),
        json.dumps({"messages": [{"role": "x"}]}).encode(),
    ):
        r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and set(r.json()["error"]) >= {"message", "type"}, r.text
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"prompt": "\\ud800 lone"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_overload_and_api_key_answer_400_and_401(adapter_engine):
    from lazyrag.server import ServerConfig, build_app

    running = Running(
        build_app(adapter_engine, ServerConfig(MODEL, max_pending=1, api_key="sesame", max_request_bytes=4096))
    )
    try:
        denied = openai.OpenAI(base_url=f"{running.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            denied.models.list()
        ok = openai.OpenAI(base_url=f"{running.url}/v1", api_key="sesame", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:  # 400: n=2 can never fit --max-pending 1
            ok.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
        assert e.value.status_code == 400
        assert ok.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        ).choices
        # a completions batch counts each prompt's choices: two prompts are two generations, over the limit of 1
        with pytest.raises(openai.BadRequestError) as e:
            ok.completions.create(model=MODEL, prompt=["Say hi.", "Say ho."], max_tokens=2)
        assert e.value.status_code == 400 and "asks for 2 generations" in e.value.message
        assert ok.completions.create(
            model=MODEL, prompt=["Say hi."], max_tokens=2
        ).choices  # the refusal reserved nothing
        # bodies over --max-request-mb: 413 from the declared length, and from a chunked body as it arrives
        auth = {"authorization": "Bearer sesame", "content-type": "application/json"}
        big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
        r = httpx.post(f"{running.url}/v1/completions", content=big, headers=auth)
        assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"]
        r = httpx.post(f"{running.url}/v1/completions", content=iter([big[:3000], big[3000:]]), headers=auth)
        assert r.status_code == 413
        assert httpx.get(f"{running.url}/health").json()["requests_in_flight"] == 0
        metrics = httpx.get(f"{running.url}/metrics").text
        assert 'lazyrag_requests_total{endpoint="/v1/completions",status="413"} 2.0' in metrics
    finally:
        running.stop()


def test_a_request_that_can_never_fit_is_400_and_one_that_fits_a_busy_server_503(adapter_engine):
    """More generations (prompts x n) than --max-pending is the client's error (400: split it or raise the limit);
    a request that would fit is 503 only while others hold the slots. The busy state is an open stream holding the
    one slot (reserved before the response starts), and the test waits on /health, not on a clock."""
    from lazyrag.server import ServerConfig, build_app

    running = Running(build_app(adapter_engine, ServerConfig(MODEL, max_pending=2)))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = httpx.post(
            f"{running.url}/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2}
        )
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == "n", r.text
        assert "asks for 4 generations" in error["message"] and "--max-pending is 2" in error["message"]
        assert "split the request" in error["message"] and "retry" not in error["message"]
        with pytest.raises(openai.BadRequestError, match="asks for 3 generations"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=2)
        assert httpx.get(f"{running.url}/health").json()["requests_in_flight"] == 0  # the refusals reserved nothing

        body = {
            "model": MODEL,
            "prompt": "Count to a thousand:",
            "n": 2,
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=120) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iter_lines() closes the response, which aborts the stream
            assert next(lines).startswith("data: ")  # both slots are held while the stream runs
            assert httpx.get(f"{running.url}/health").json()["requests_in_flight"] == 2
            with pytest.raises(openai.InternalServerError) as e:  # fits the limit, but not now
                client.completions.create(model=MODEL, prompt="Say hi.", max_tokens=2)
            assert e.value.status_code == 503 and "retry shortly" in e.value.message
        deadline = time.monotonic() + 120  # a hang guard only: the hang-up aborts the stream and frees its slots
        while httpx.get(f"{running.url}/health").json()["requests_in_flight"]:
            assert time.monotonic() < deadline, "the closed stream never released its slots"
            time.sleep(0.05)
        assert client.completions.create(model=MODEL, prompt=["Say hi.", "Say ho."], max_tokens=2).choices
    finally:
        running.stop()


def test_a_body_that_stops_arriving_gets_408_and_its_connection_closed(adapter_engine):
    """A slow client (headers, then part of the body, then nothing) is answered 408 once --body-timeout passes, and
    the connection ends; the test waits for that answer (the server's own deadline), not on a clock of its own."""
    from lazyrag.server import ServerConfig, build_app

    running = Running(build_app(adapter_engine, ServerConfig(MODEL, body_timeout_s=0.5)))
    try:
        answer = slow_body_answer(running.url)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer[:300]
        assert httpx.get(f"{running.url}/health").json()["requests_in_flight"] == 0
    finally:
        running.stop()


def test_the_api_key_can_guard_every_route_but_the_probes(adapter_engine):
    from lazyrag.server import ServerConfig, build_app

    running = Running(build_app(adapter_engine, ServerConfig(MODEL, api_key="sesame", api_key_covers="all")))
    try:
        key = {"authorization": "Bearer sesame"}
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert httpx.get(f"{running.url}{path}").status_code == 401, path
            assert httpx.get(f"{running.url}{path}", headers={"authorization": "Bearer sesam"}).status_code == 401
            assert httpx.get(f"{running.url}{path}", headers=key).status_code == 200, path
        assert httpx.post(f"{running.url}/tokenize", json={"model": MODEL, "prompt": "Hi"}).status_code == 401
        for path in ("/health", "/version"):  # probes and load balancers ask without a key
            assert httpx.get(f"{running.url}{path}").status_code == 200, path
    finally:
        running.stop()
    with pytest.raises(ValueError, match="api_key_covers"):
        build_app(adapter_engine, ServerConfig(MODEL, api_key="k", api_key_covers="some"))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(server, adapter_engine, stream):
    engine = adapter_engine
    engine.precache(NOTES)
    _settled(engine)
    free_before = engine.cache.pool.num_free
    aborted_before = _metric(server, "lazyrag_requests_aborted_total")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me everything about penicillin."}],
        "documents": NOTES,
        "max_tokens": 400,
        "stream": stream,
    }
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert engine.has_unfinished_requests()
    else:  # a client that sends its request, then hangs up before the (long) answer: a raw socket, no timeout race
        body.update(max_tokens=2000, ignore_eos=True)  # the answer cannot end before the hang-up is seen
        payload = json.dumps(body).encode()
        host, port = server.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload)
        )
        deadline = time.monotonic() + 60
        while not engine.has_unfinished_requests():  # the generation is running
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.05)
        sock.close()
    _settled(engine, timeout_s=120)  # 2,000 tokens would take minutes: settling means the hang-up stopped it
    assert engine.cache.pool.num_free == free_before  # the request's own blocks went back; chunk KV stays cached
    assert _metric(server, "lazyrag_requests_aborted_total") == aborted_before + 1


def test_langchain_chat_openai_chain_reuses_the_store_chunks(server, adapter_engine):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=16, max_retries=0
    )
    prompt = ChatPromptTemplate.from_messages([("user", "Documents:\n\n{context}\n\nQuestion: {question}")])
    context = "\n\n".join(TINY_DOCS.values())  # the store's chunks, as a stuffing chain pastes them
    for _i, question in enumerate(["Where was Paganini born?", "When did Marie Curie win the Nobel Prize in Physics?"]):
        hits = _reused(adapter_engine)
        message = (prompt | llm).invoke({"context": context, "question": question})
        # each chunk found in the text and reused
        assert _reused(adapter_engine) - hits >= len(TINY_DOCS), adapter_engine.cache.stats
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
    user_text = prompt.invoke({"context": context, "question": question}).messages[0].content
    assert message.content == _engine_answer(adapter_engine, user_text, 16)
    assert (prompt | llm | StrOutputParser()).invoke({"context": context, "question": "Where was Paganini born?"})
    streamed = "".join(c.content for c in llm.stream("Count: one, two,"))
    assert streamed


def test_llama_index_openai_like_reuses_chunks_found_in_the_prompt(server, adapter_engine):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    # temperature=0: greedy, as the engine's answer below (OpenAILike samples at 0.1 unless told)
    common = dict(
        model=MODEL,
        api_base=f"{server.url}/v1",
        api_key="unused",
        context_window=8192,
        max_tokens=16,
        max_retries=0,
        timeout=120,
        temperature=0.0,
    )
    context = "\n\n".join(TINY_DOCS.values())
    llm = OpenAILike(is_chat_model=False, **common)
    for question in ["Which city does the Grand Canal link with Hangzhou?", "Where was Paganini born?"]:
        hits = _reused(adapter_engine)
        text = f"Context:\n{context}\n\nQuestion: {question}\nAnswer:"
        r = llm.complete(text)  # /v1/completions: the raw prompt, chunks found inside it
        assert _reused(adapter_engine) - hits >= len(TINY_DOCS)
        assert r.raw.usage.prompt_tokens_details.cached_tokens > 0
    assert r.text == _engine_answer(adapter_engine, text, 16, chat=False)
    chat = OpenAILike(is_chat_model=True, **common)
    user_text = f"Documents:\n\n{context}\n\nQuestion: Where was Paganini born?"
    reply = chat.chat([ChatMessage(role="user", content=user_text)])
    assert reply.message.content == _engine_answer(adapter_engine, user_text, 16)
    assert "".join(d.delta for d in chat.stream_chat([ChatMessage(role="user", content="Say hi.")]))


def test_fuzzed_requests_get_an_answer_or_a_json_error_never_a_crash(server, adapter_engine):
    """Seeded random bodies through both endpoints: every reply is a success or an OpenAI-style error
    with a 4xx/503 status (no 500, no traceback), and nothing stays in flight afterwards."""
    import random

    rng = random.Random(29)
    values = [None, 0, -1, 1, 2**70, 1e-320, float("nan"), "x", "", [], {}, [1], {"a": 1}, True, "\ud800"[:0], 10**9]
    fields = [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "stream",
        "documents",
        "strategy",
        "k",
        "retrieve",
        "logprobs",
        "presence_penalty",
        "stream_options",
        "top_k",
        "repetition_penalty",
        "top_logprobs",
        "frequency_penalty",
    ]
    statuses = []
    for _i in range(60):
        endpoint = rng.choice(["chat/completions", "completions"])
        body = {"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat/completions" else {"prompt": "Hi"}
        body["max_tokens"] = 2
        for name in rng.sample(fields, rng.randint(1, 4)):
            body[name] = rng.choice(values)
        payload = json.dumps(body, allow_nan=True).encode()
        r = httpx.post(
            f"{server.url}/v1/{endpoint}", content=payload, headers={"content-type": "application/json"}, timeout=120
        )
        statuses.append(r.status_code)
        assert r.status_code in (200, 400, 404, 422, 503), (body, r.status_code, r.text[:300])
        if r.status_code != 200:
            assert set(r.json()["error"]) >= {"message", "type", "code"}, r.text[:300]
        elif body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    assert 200 in statuses and {400, 422} & set(statuses)
    _settled(adapter_engine)


def test_logprobs_and_penalties_in_openai_format(client, adapter_engine):
    """Chat logprobs (content[].token/logprob/bytes/top_logprobs) and completions logprobs (tokens, token_logprobs,
    top_logprobs, text_offset), whole and streamed, equal the engine's; penalties and top_k reach the sampler."""
    from lazyrag.engine import SamplingParams

    question = [{"role": "user", "content": "Who discovered penicillin?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=6, logprobs=True, top_logprobs=3, extra_body={"documents": NOTES}
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and "".join(t.token for t in content).startswith(
        r.choices[0].message.content[:3]
    )
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # greedy: the best one
        assert t.bytes == list(t.token.encode())
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=question,
            max_tokens=6,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body={"documents": NOTES},
        )
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in tokens] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=4, extra_body={"documents": NOTES}
    )
    assert plain.choices[0].logprobs is None

    prompt = "The capital of France is"
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=2)
    lp = c.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
        == c.usage.completion_tokens
    )
    assert "".join(lp.tokens).startswith(c.choices[0].text) and lp.text_offset[0] == 0
    assert all(len(top) <= 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    mine = adapter_engine.submit(
        adapter_engine.layout_from_text(prompt), SamplingParams(5, strategy="lazy+recover", logprobs=2)
    ).result()
    assert lp.token_logprobs == pytest.approx([x.logprob for x in mine.logprobs], abs=1e-5)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, stream=True))
    parts = [ch.choices[0].logprobs for ch in streamed if ch.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens and [
        o for p in parts for o in p.text_offset
    ] == lp.text_offset

    repeat = [{"role": "user", "content": "List the numbers from one to ten, separated by commas."}]
    off = {"retrieve": False}
    greedy = client.chat.completions.create(model=MODEL, messages=repeat, max_tokens=16, logprobs=True, extra_body=off)
    ids = [t.token for t in greedy.choices[0].logprobs.content]
    assert len(set(ids)) < len(ids)
    penalized = client.chat.completions.create(
        model=MODEL, messages=repeat, max_tokens=16, logprobs=True, extra_body={"repetition_penalty": 50.0, **off}
    )
    ids = [t.token for t in penalized.choices[0].logprobs.content]
    assert len(set(ids)) == len(ids)
    top1 = client.chat.completions.create(
        model=MODEL, messages=repeat, max_tokens=16, temperature=1.0, seed=5, extra_body={"top_k": 1, **off}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    freq = client.chat.completions.create(
        model=MODEL, messages=repeat, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0, extra_body=off
    )
    assert freq.choices[0].message.content != greedy.choices[0].message.content


def test_a_gguf_served_under_its_file_name_also_answers_to_the_model_s_name():
    from lazyrag.server.app import model_aliases

    # the README's snippet sends this
    assert "SmolLM2-135M-Instruct" in model_aliases("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert model_aliases("Llama-3.1-8B-Instruct") == ()
    assert model_aliases("x.Q4_K_M.gguf") == ("x.Q4_K_M", "x")


# Texts no store or earlier test holds: a RAG app's retrieved passages, pasted into its prompts
PASTED = [
    "The Velmar Observatory stands on a basalt ridge above the town of Ostrava Nova and houses a 2.4 metre telescope.",
    "Keldon Bridge, a stone arch over the river Imbe, was rebuilt in 1794 after a spring flood carried off its "
    "centre span.",
    "The Sorrel Company of weavers kept its guild hall in Market Lane until 1911, when the hall became a public "
    "library.",
    "Lake Ormund freezes most winters; its ice road links the fishing villages of Hesk and Varo for about six weeks.",
    "The painter Ilse Carrow spent her last twenty years in Tarn Hollow, painting the same orchard in every season.",
]
PASTED_QUESTIONS = [
    "Where does the Velmar Observatory stand?",
    "When was Keldon Bridge rebuilt?",
    "Where was the Sorrel Company's guild hall?",
    "Which villages does the ice road link?",
    "Where did Ilse Carrow spend her last years?",
]


@pytest.fixture
def own_chunk_finder(adapter_engine):
    """The passages these tests paste (and LlamaIndex's template paragraphs) stay out of the shared engine's
    chunk finder after them: other modules' tests count the chunks of the same templates."""
    from lazyrag.prompt import ChunkFinder

    saved, adapter_engine.chunk_finder = adapter_engine.chunk_finder, ChunkFinder()
    yield
    adapter_engine.chunk_finder = saved


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def _cached_prompt_tokens(server) -> float:
    return _metric(server, "lazyrag_cached_prompt_tokens_total")


def _context_tokens(engine, passages) -> int:
    return sum(len(engine.prompts.encode_chunk(p)) for p in passages)


def test_a_stock_langchain_stuffing_chain_reuses_pasted_passages_in_any_order(server, adapter_engine, own_chunk_finder):
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    # LangChain's RAG tutorial as written: the context in the system message, documents joined by blank lines
    llm = ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=12, max_retries=0
    )
    prompt = ChatPromptTemplate.from_messages(
        [
            (
                "system",
                "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
                "to answer the question. If you don't know the answer, say that you don't know.\n\n{context}",
            ),
            ("human", "{question}"),
        ]
    )
    chain = prompt | llm | StrOutputParser()
    context_tokens = _context_tokens(adapter_engine, PASTED)
    for i, question in enumerate(PASTED_QUESTIONS):
        docs = [Document(page_content=p) for p in PASTED[i:] + PASTED[:i]]  # every question its own order
        context = "\n\n".join(d.page_content for d in docs)
        before = _cached_prompt_tokens(server)
        answer = chain.invoke({"context": context, "question": question})
        reused = _cached_prompt_tokens(server) - before
        if i:
            assert reused >= 0.8 * context_tokens, (i, reused, context_tokens)
        # the same text from Python, its passages known as chunks: the same greedy answer
        messages = [
            {"role": m.type.replace("human", "user"), "content": m.content}
            for m in prompt.invoke({"context": context, "question": question}).messages
        ]
        text = adapter_engine.render_chat(messages)
        from lazyrag.engine import SamplingParams

        same = adapter_engine.submit(
            adapter_engine.layout_from_text(text), SamplingParams(12, strategy="lazy+recover")
        ).result()
        assert answer == same.text


def test_a_llama_index_query_engine_over_openai_like_reuses_pasted_passages(server, adapter_engine, own_chunk_finder):
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.llms.openai_like import OpenAILike

    class Shuffled(BaseRetriever):  # what a vector store would return: the same passages, ranked anew per question
        turn = 0

        def _retrieve(self, query_bundle):
            i, Shuffled.turn = Shuffled.turn, Shuffled.turn + 1
            order = PASTED[::-1][i:] + PASTED[::-1][:i]
            return [NodeWithScore(node=TextNode(text=t), score=1.0 - k / 10) for k, t in enumerate(order)]

    llm = OpenAILike(
        model=MODEL,
        api_base=f"{server.url}/v1",
        api_key="unused",
        context_window=8192,
        max_tokens=12,
        max_retries=0,
        timeout=120,
        temperature=0.0,
        is_chat_model=True,
    )
    engine = RetrieverQueryEngine.from_args(Shuffled(), llm=llm)
    context_tokens = _context_tokens(adapter_engine, PASTED)
    for i, question in enumerate(PASTED_QUESTIONS):
        before = _cached_prompt_tokens(server)
        response = engine.query(question)
        assert str(response).strip()
        if i:
            assert _cached_prompt_tokens(server) - before >= 0.8 * context_tokens


def test_pasted_passages_split_where_rag_prompts_split():
    from lazyrag.prompt import pasted_passages

    llama_index = (
        "Context information is below.\n---------------------\n"
        + "\n\n".join(PASTED[:3])
        + "\n---------------------\nGiven the context information and not prior knowledge, answer the query.\n"
        "Query: Where does the Velmar Observatory stand, and what does it house?\nAnswer: "
    )
    assert pasted_passages(llama_index, keep_last=False) == PASTED[:3]  # the query's paragraph stays the question
    assert pasted_passages("Short line.\n\n" + PASTED[0] + "\n\n***\n" + PASTED[1]) == PASTED[:2]
    assert pasted_passages(PASTED[0], keep_last=False) == []
    assert pasted_passages("Context:\n" + PASTED[0] + "\n\nQuestion: where?") == [PASTED[0]]
