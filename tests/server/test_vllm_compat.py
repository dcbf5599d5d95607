"""`lazyrag serve` shaped like `vllm serve`: /version, /tokenize and /detokenize, --max-model-len, CORS,
--root-path, and a model named by its Hugging Face id, found in the local Hugging Face cache."""

import pytest
from fastapi.testclient import TestClient

import lazyrag

pytestmark = pytest.mark.slow

MODEL = "smollm2-test"
ORIGIN = "http://ui.example"


def _app(engine, **config):
    from lazyrag.server import ServerConfig, build_app

    return build_app(engine, ServerConfig(MODEL, max_tokens=4, **config))


@pytest.fixture(scope="module")
def http(adapter_engine):
    """The app with an API key, a 64-token --max-model-len and one allowed CORS origin."""
    return TestClient(_app(adapter_engine, api_key="sesame", max_model_len=64, allowed_origins=(ORIGIN,)))


KEY = {"authorization": "Bearer sesame"}


def test_version_is_at_the_root_without_the_api_key(http):
    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": lazyrag.__version__}
    assert http.get("/v1/models").status_code == 401  # /v1 routes keep the key, as vLLM's
    assert http.get("/v1/models", headers=KEY).json()["data"][0]["max_model_len"] == 64


def test_tokenize_round_trips_through_detokenize(http, adapter_engine):
    text = "The Danube rises in the Black Forest."
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) > 3 and out["max_model_len"] == 64
    assert out["tokens"] == adapter_engine.tokenizer(text).input_ids and len(out["token_strs"]) == out["count"]
    back = http.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # no model field: the served one, as for the /v1 routes
    assert http.post("/detokenize", json={"tokens": out["tokens"][:2]}).json()[
        "prompt"
    ] == adapter_engine.tokenizer.decode(out["tokens"][:2])


def test_tokenize_chat_messages_counts_what_a_chat_request_prefills(http, adapter_engine):
    messages = [{"role": "user", "content": "Say hi."}]
    out = http.post("/tokenize", json={"messages": messages}).json()
    # the same text the chat route renders (lazyrag's default system turn added), the same tokens the engine reads
    layout = adapter_engine.layout_from_text(adapter_engine.render_chat(messages))
    assert out["tokens"] == layout.full_ids() and out["count"] == layout.num_tokens
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert 0 < bare["count"] < out["count"] and out["tokens"][: bare["count"]] == bare["tokens"]


def test_tokenize_and_detokenize_refuse_bad_bodies(http):
    assert http.post("/tokenize", json={"model": "gpt-4o", "prompt": "x"}).status_code == 404
    for body in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        r = http.post("/tokenize", json=body)
        assert r.status_code == 422 and "either prompt" in r.json()["error"]["message"]
    r = http.post("/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": ["a"]}).status_code == 422


def test_max_model_len_refuses_longer_prompts_with_a_400(http):
    long_prompt = "Rivers carry water to the sea. " * 20  # about 140 tokens, over 64
    assert http.post("/tokenize", json={"prompt": long_prompt}).json()["count"] > 64
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}, headers=KEY)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "maximum context length is 64 tokens" in message and "--max-model-len" in message
    r = http.post(
        "/v1/chat/completions",
        headers=KEY,
        json={"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]},
    )
    assert r.status_code == 400 and "maximum context length is 64" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "One, two,", "max_tokens": 100}, headers=KEY)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "One, two,", "max_tokens": 2}, headers=KEY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_max_model_len_cannot_exceed_the_model_context(adapter_engine):
    with pytest.raises(ValueError, match="max_model_len"):
        _app(adapter_engine, max_model_len=adapter_engine.max_context + 1)
    plain = TestClient(_app(adapter_engine))  # default: the model's own context
    assert plain.post("/tokenize", json={"prompt": "x y"}).json()["max_model_len"] == adapter_engine.max_context


def test_cors_preflight_is_answered_before_the_api_key(http, adapter_engine):
    preflight = {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    r = http.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    r = http.options("/v1/chat/completions", headers={**preflight, "origin": "http://elsewhere.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={**KEY, "origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert http.get("/version", headers={"origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
    # without --allowed-origins: no CORS headers at all (vLLM allows every origin unless told otherwise)
    plain = TestClient(_app(adapter_engine))
    assert "access-control-allow-origin" not in plain.get("/version", headers={"origin": ORIGIN}).headers


def test_root_path_keeps_the_api_key_on_v1_routes(adapter_engine):
    # uvicorn --root-path /api: the path the app sees starts with the prefix (uvicorn adds it)
    client = TestClient(_app(adapter_engine, api_key="sesame"), root_path="/api")
    assert client.get("/api/v1/models").status_code == 401
    assert client.get("/api/v1/models", headers=KEY).json()["data"][0]["id"] == MODEL
    assert client.get("/api/version").json() == {"version": lazyrag.__version__}


# -- a model named by its Hugging Face id, from the local cache -------------------------------


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_hf, default_hf):
    """A Hugging Face cache holding org/tiny-llama (the tiny random Llama) as the hub client lays it out."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    snapshot = repo / "snapshots" / commit
    tiny_hf.save_pretrained(snapshot)
    default_hf[1].save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


def test_a_hub_id_in_the_local_cache_loads_and_is_served_under_it(hub_cache):
    import argparse

    from lazyrag.cli import _served_names
    from lazyrag.engine import LazyEngine
    from lazyrag.model.loader import ModelLoadError, resolve_model_source
    from lazyrag.server import ServerConfig, build_app

    source = resolve_model_source("org/tiny-llama")
    assert source.folder == hub_cache and source.hub_id == "org/tiny-llama"
    assert source.name == "tiny-llama"  # named after the repository (a snapshot folder is named by its commit)
    engine = LazyEngine.from_pretrained("org/tiny-llama", device="cpu", kv_budget=8 << 20, warmup=False)
    assert engine.model_name == "tiny-llama"
    # vLLM serves a model under the name it was given; lazyrag also answers to the repository's name
    args = argparse.Namespace(served_model_name=None, model="org/tiny-llama")
    assert _served_names(args, engine.model_name) == ("org/tiny-llama", ("tiny-llama",))
    name, aliases = _served_names(args, engine.model_name)
    client = TestClient(build_app(engine, ServerConfig(name, max_tokens=2, aliases=aliases)))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["org/tiny-llama"]
    for model in ("org/tiny-llama", "tiny-llama"):
        assert client.post("/tokenize", json={"model": model, "prompt": "a b"}).status_code == 200
    assert client.post("/tokenize", json={"model": "org/other", "prompt": "a b"}).status_code == 404
    with pytest.raises(ModelLoadError, match=r"not a model in the local Hugging Face cache.*hf download org/other"):
        resolve_model_source("org/other")
