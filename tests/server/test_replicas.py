"""`lazyrag serve --replicas 2` as users run it, on CPU with the embedded model: two replica processes on Ray
Serve behind one OpenAI endpoint (loopback only, behind an API key), routed by chunk affinity; a replica killed
under load fails only its own requests, and a request nothing was sent for yet is answered by the other replica."""

import threading
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from tests.helpers import free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "sesame"  # the endpoint's --api-key
FLEMING = [
    "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London.",
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
]
CURIE = [
    "Marie Curie was the first person to win Nobel Prizes in two sciences.",
    "Mount Kilimanjaro, in Tanzania, is the highest mountain in Africa.",
]


@pytest.fixture(scope="module")
def endpoint():
    from ray import serve

    from lazyrag.server.replicas import ReplicaSpec, run

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run(
            ReplicaSpec(kv_budget=256 << 20, server={"max_tokens": 8}),
            2,
            "chunk_affinity",
            "127.0.0.1",
            port,
            blocking=False,
            api_key=KEY,
        )
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=120, headers={"Authorization": f"Bearer {KEY}"}
        )
        yield client
        client.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(client, question, documents, **kw):
    return client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": question}], "documents": documents, **kw},
    )


def routing(client) -> dict:
    return client.get("/routing").json()


def wait_for(predicate, timeout=120.0):  # a hang guard: the state is what is waited on
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_one_endpoint_answers_and_a_request_goes_where_its_documents_are(endpoint):
    from openai import OpenAI

    first = ask(endpoint, "Who discovered penicillin?", FLEMING)
    assert first.status_code == 200, first.text
    home = first.headers["x-lazyrag-replica"]
    # the replica's KV events reach the router: it now holds the prefix and both documents
    assert wait_for(lambda: routing(endpoint)[home]["held"] >= 3)
    again = ask(endpoint, "When was the Eiffel Tower completed?", FLEMING)
    assert again.status_code == 200 and again.headers["x-lazyrag-replica"] == home
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # the front speaks the OpenAI API: the official client, streaming included
    client = OpenAI(base_url=str(endpoint.base_url) + "/v1", api_key=KEY)
    assert client.models.list().data[0].id == MODEL
    pieces = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Who?"}],
            stream=True,
            max_tokens=6,
            extra_body={"documents": FLEMING},
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices).strip()


def test_a_request_without_the_api_key_is_refused(endpoint):
    with httpx.Client(base_url=endpoint.base_url, timeout=120) as stranger:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = stranger.post(
                "/v1/chat/completions",
                headers=headers,
                json={"model": MODEL, "messages": [{"role": "user", "content": "Who?"}], "documents": CURIE},
            )
            assert r.status_code == 401, r.text
            assert r.json()["error"]["type"] == "authentication_error" and "x-lazyrag-replica" not in r.headers
            assert stranger.get("/v1/models", headers=headers).status_code == 401
        assert stranger.get("/health").status_code == 200  # probes need no key, as with `lazyrag serve`


def test_busy_replica_sends_new_documents_to_the_other(endpoint):
    """While one replica is busy with a long answer, a request whose documents no replica holds goes to the idle one."""
    results = {}

    def long_answer():
        results["long"] = ask(endpoint, "Tell me all about penicillin.", FLEMING, max_tokens=48)

    home = ask(endpoint, "Who discovered penicillin?", FLEMING).headers["x-lazyrag-replica"]
    t = threading.Thread(target=long_answer)
    t.start()
    assert wait_for(lambda: routing(endpoint)[home]["in_flight"] >= 1, timeout=120)  # a hang guard
    other = ask(endpoint, "Who won two Nobel Prizes?", CURIE)
    t.join()
    assert other.status_code == 200 and results["long"].status_code == 200
    assert other.headers["x-lazyrag-replica"] != home


def test_a_killed_replica_fails_only_its_requests_and_the_router_stops_sending_to_it(endpoint):
    home = ask(endpoint, "Who discovered penicillin?", FLEMING).headers["x-lazyrag-replica"]
    survivor = next(n for n in routing(endpoint) if n != home)
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{home}#" in a["name"])
    # a long answer streaming from the replica about to die
    with endpoint.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about penicillin."}],
            "documents": FLEMING,
            "max_tokens": 200,
            "stream": True,
        },
    ) as streaming:
        assert streaming.headers["x-lazyrag-replica"] == home
        lines = streaming.iter_lines()
        assert next(lines).startswith("data: ")
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
        rest = "\n".join(lines)
    assert "failed mid-answer" in rest, rest[-500:]  # that client alone gets the error, as the stream's last event
    # a request for the same documents, nothing sent yet: retried, and answered by the survivor
    retried = ask(endpoint, "When was penicillin discovered?", FLEMING)
    assert retried.status_code == 200, retried.text
    assert retried.headers["x-lazyrag-replica"] == survivor
    assert not routing(endpoint)[home]["alive"] or routing(endpoint)[home]["held"] == 0
    # unrelated requests go on meanwhile
    assert ask(endpoint, "Who won two Nobel Prizes?", CURIE).status_code == 200
