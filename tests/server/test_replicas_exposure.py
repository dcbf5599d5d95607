"""What `lazyrag serve --replicas N` exposes, checked without starting Ray (tests/server/test_replicas.py starts it):
the front checks `lazyrag serve`'s API key before routing, the Ray it starts has no dashboard, and the HTTP proxy
listens on --host (loopback by default)."""
import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from lazyrag.server.replicas import KeyGate, ray_init_options  # noqa: E402

KEY = "sesame"


def _front(api_key, covers="v1"):
    """A front app as build_app makes it (KeyGate added the same way), whose routes answer who reached them."""
    app = FastAPI()
    app.add_middleware(KeyGate, api_key=api_key, covers=covers)

    @app.get("/routing")
    async def routing():
        return {"reached": "routing"}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def relay(path: str):
        return {"reached": path}

    return TestClient(app)


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
    assert _front(None).get("/v1/models").json() == {"reached": "v1/models"}


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
    assert main(["serve", "--replicas", "2", "--host", "0.0.0.0", "--api-key-file", str(key), "--api-key-covers", "all"]) == 0
    assert calls["start"]["http_options"]["host"] == "0.0.0.0" and calls["app"]["api_key_covers"] == "all"
