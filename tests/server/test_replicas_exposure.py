"""What `lazyrag serve --replicas N` exposes, checked without starting Ray (tests/server/test_replicas.py starts it):
the front checks `lazyrag serve`'s API key and body limits before routing, the Ray it starts has no dashboard, and
the HTTP proxy listens on --host (loopback by default)."""

import json

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from lazyrag.server.replicas import add_front_gates, ray_init_options  # noqa: E402
from tests.helpers import Running, slow_body_answer  # noqa: E402

KEY = "sesame"


def _front_app(api_key, covers="v1", server=None):
    """A front app with build_app's gates (``add_front_gates``), whose relay reads the body as the real one does
    and answers who it reached."""
    from fastapi import Request

    app = FastAPI()
    add_front_gates(app, server or {}, api_key, covers)

    @app.get("/routing")
    async def routing():
        return {"reached": "routing"}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def relay(path: str, request: Request):
        return {"reached": path, "bytes": len(await request.body())}

    return app


def _front(api_key, covers="v1", server=None):
    return TestClient(_front_app(api_key, covers, server))


@pytest.mark.parametrize("covers", ["v1", "all"])
def test_the_front_refuses_a_request_without_the_key_before_routing_it(covers):
    client = _front(KEY, covers)
    for path in ("/v1/models", "/v1/chat/completions"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = client.post(path, json={}, headers=headers) if "chat" in path else client.get(path, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error" and "--api-key" in r.json()["error"]["message"]
        assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).json()["reached"] == path.lstrip("/")
    for path in ("/health", "/version"):  # probes and load balancers: open, as in `lazyrag serve`
        assert client.get(path).status_code == 200
    for path in ("/routing", "/metrics", "/docs"):  # open with --api-key-covers v1 (vLLM's), keyed with all
        assert client.get(path).status_code == (401 if covers == "all" else 200), path


def test_a_front_without_a_key_routes_everything():
    assert _front(None).get("/v1/models").json() == {"reached": "v1/models", "bytes": 0}


def test_the_front_holds_the_replicas_body_limits_before_reading_a_body():
    """`--max-request-mb` at the front: 413 from the declared length (before the body is read) and from a chunked
    body as it arrives, in OpenAI's error shape; the key is checked first. Without the settings, ServerConfig's."""
    client = _front(KEY, server={"max_request_bytes": 4000})
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({"model": "m", "prompt": "x" * 5000}).encode()
    assert client.post("/v1/completions", content=big).status_code == 401
    r = client.post("/v1/completions", content=big, headers=auth)
    assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", content=iter([big[:3000], big[3000:]]), headers=auth)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert client.post("/v1/completions", content=big[:3000], headers=auth).json()["bytes"] == 3000
    assert _front(None).post("/v1/completions", content=big).json()["bytes"] == len(big)  # 8 MiB by default


def test_a_body_that_stops_arriving_at_the_front_gets_408():
    """`--body-timeout` at the front: headers, part of the body, then nothing is answered 408 and the connection
    closed; the test waits for that answer (the front's own deadline), not on a clock of its own."""
    running = Running(_front_app(None, server={"body_timeout_s": 0.5}))
    try:
        answer = slow_body_answer(running.url)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer[:300]
    finally:
        running.stop()


def test_ray_started_here_has_no_dashboard_and_a_joined_cluster_keeps_its_settings():
    assert ray_init_options(None) == {"include_dashboard": False, "log_to_driver": False}
    assert ray_init_options("auto") == {"address": "auto", "log_to_driver": False}


def test_serve_replicas_passes_the_key_and_listens_on_loopback_by_default(monkeypatch, tmp_path):
    """`lazyrag serve --replicas 2 --api-key-file K`: accepted (it was refused before), and Ray is started and
    Ray Serve's proxy bound as run() says: ray.init's options, --host (127.0.0.1 unless given), the key."""
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    import lazyrag.server.replicas as replicas
    from lazyrag.cli import main

    calls = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.setdefault("start", kw))
    monkeypatch.setattr(serve, "run", lambda app, **kw: calls.setdefault("run", kw))
    monkeypatch.setattr(replicas, "build_app", lambda *a, **kw: calls.setdefault("app", kw))
    monkeypatch.setattr(replicas, "_serve_until_interrupted", lambda: None)
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    assert main(["serve", "--replicas", "2", "--api-key-file", str(key)]) == 0
    assert calls["init"] == {"include_dashboard": False, "log_to_driver": False}
    assert calls["start"]["http_options"]["host"] == "127.0.0.1"
    assert calls["app"]["api_key"] == KEY and calls["app"]["api_key_covers"] == "v1"
    calls.clear()
    assert (
        main(["serve", "--replicas", "2", "--host", "0.0.0.0", "--api-key-file", str(key), "--api-key-covers", "all"])
        == 0
    )
    assert calls["start"]["http_options"]["host"] == "0.0.0.0" and calls["app"]["api_key_covers"] == "all"
