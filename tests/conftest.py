"""Shared fixtures. On a machine without CUDA, Triton kernels run in its interpreter.

TRITON_INTERPRET must be set before any module decorated with @triton.jit is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.helpers import TINY_DOCS  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def model_cache_dir(tmp_path_factory):
    """Every test, and every process a test starts, keeps converted models in one session folder, never in the
    real ~/.cache (the first load of the default GGUF in a session converts it; later ones read the folder)."""
    from lazyrag.defaults import CACHE_DIR_ENV

    folder = tmp_path_factory.mktemp("lazyrag-cache")
    before = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(folder)
    yield folder
    if before is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = before


@pytest.fixture(scope="session")
def default_hf():
    """The embedded default model (SmolLM2-135M-Instruct, fp32) as transformers loads it, and its tokenizer."""
    from lazyrag.model.loader import default_model_source, load_checkpoint

    return load_checkpoint(default_model_source(), torch.float32)


@pytest.fixture(scope="session")
def default_engine(default_hf):
    from lazyrag.engine import LazyEngine

    hf, tokenizer = default_hf
    return LazyEngine.from_hf(hf, tokenizer, device="cpu", kv_budget=256 << 20)


# every tiny test model's size: the embedded tokenizer's vocabulary, GQA of 4 query heads over 2 KV heads
TINY_DIMS = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def tiny_llama_config(**overrides):
    """A random Llama with GQA (4 query heads over 2 KV heads) and Llama-3 RoPE frequency scaling."""
    from transformers import LlamaConfig

    kw = dict(
        **TINY_DIMS,
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


FAMILIES = ("qwen2", "qwen3", "mistral")


def tiny_family_model(family: str, seed: int = 1234, **overrides):
    """A small random model of another Llama-family architecture, built through transformers (no hub): Qwen2 with
    q/k/v biases, tied embeddings and rope theta 1e6; Qwen3 with per-head q/k norms and a head_dim that is not
    hidden / heads; Mistral with full attention. Biases and norm weights are random too, so each one counts."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

    kw = dict(**TINY_DIMS, rms_norm_eps=1e-6)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    own = {
        "qwen2": dict(tie_word_embeddings=True, rope_parameters=rope),
        "qwen3": dict(head_dim=32, rope_parameters=rope),
        "mistral": dict(head_dim=16, sliding_window=None),
    }[family]
    kw.update(own)
    kw.update(overrides)
    config = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family](**kw)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.normal_(1, 0.2)
    return hf


@pytest.fixture(scope="session")
def tiny_hf():
    from transformers import LlamaForCausalLM

    torch.manual_seed(1234)
    hf = LlamaForCausalLM(tiny_llama_config()).eval()
    # Random init keeps attention near uniform; larger weights make positions matter.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.normal_(0, 0.2)
    return hf


@pytest.fixture(scope="session")
def tiny_engine(tiny_hf, default_hf):
    from lazyrag.engine import LazyEngine

    return LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=64 << 20)


@pytest.fixture(params=["default", "tiny"])
def engine_and_hf(request):
    """Each equivalence test runs on the real default model and on a tiny random GQA/Llama-3-rope model."""
    hf = request.getfixturevalue("default_hf")[0] if request.param == "default" else request.getfixturevalue("tiny_hf")
    return request.getfixturevalue(f"{request.param}_engine"), hf


@pytest.fixture
def engine(engine_and_hf):
    return engine_and_hf[0]


@pytest.fixture(scope="session")
def plain_default_engine(default_hf):
    """The default model with chunks encoded after the prompt's prefix alone (``encoding_passage=None``): a chunk's
    cached KV is then exactly what a full prefill computes for it when it comes first."""
    from lazyrag.engine import LazyEngine

    hf, tokenizer = default_hf
    return LazyEngine.from_hf(hf, tokenizer, device="cpu", kv_budget=128 << 20, encoding_passage=None)


@pytest.fixture(scope="session")
def plain_tiny_engine(tiny_hf, default_hf):
    from lazyrag.engine import LazyEngine

    return LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=64 << 20, encoding_passage=None)


@pytest.fixture(params=["default", "tiny"])
def plain_engine(request):
    """``engine``'s two models without the encoding passage."""
    return request.getfixturevalue(f"plain_{request.param}_engine")


# -- corpus store fixtures (issue 4) ---------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A folder of five one-paragraph documents."""
    folder = tmp_path_factory.mktemp("corpus")
    for name, text in TINY_DOCS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="session")
def embedder():
    from lazyrag.store.retriever import load_embedder

    return load_embedder()


# -- stores and engines shared by the adapter, CLI, server and precache tests ----------------


@pytest.fixture(scope="session")
def tiny_store(default_engine, tiny_corpus, embedder, tmp_path_factory):
    """A finished corpus store of the five tiny documents, built on the session engine."""
    from lazyrag.store.build import PrecacheConfig, precache

    out = tmp_path_factory.mktemp("adapter-stores") / "tiny"
    precache(default_engine, PrecacheConfig([str(tiny_corpus)], str(out), progress=False), embedder)
    return out


@pytest.fixture(scope="module")
def adapter_engine(default_engine):
    """The session engine as the adapters' shared engine for the default model; stores the adapters
    attach are detached afterwards, so other test modules see the engine as they left it."""
    from lazyrag.integrations._common import register_engine

    register_engine(default_engine)
    tiers = list(default_engine.cache.tiers)
    yield default_engine
    default_engine.cache.tiers[:] = tiers
    default_engine.cache.clear()


@pytest.fixture
def detaches_stores(default_engine, tiny_engine, embedder, monkeypatch):
    """precache_store attaches the store it builds to the engine it is given: detached again after the test,
    since other tests count hits and misses on these session engines. The adapters use the session embedder."""
    from lazyrag.integrations import _common
    from lazyrag.store.retriever import DEFAULT_EMBEDDER

    monkeypatch.setitem(_common._embedders, DEFAULT_EMBEDDER, embedder)
    tiers = [(engine, list(engine.cache.tiers)) for engine in (default_engine, tiny_engine)]
    yield
    for engine, before in tiers:
        engine.cache.tiers[:] = before


def pytest_collection_modifyitems(config, items):
    """On a GPU machine, the kernel tests written for Triton's CPU interpreter need TRITON_INTERPRET=1."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(
        reason="CPU-tensor kernel test: runs in Triton's interpreter (TRITON_INTERPRET=1); "
        "the gpu-marked tests cover CUDA"
    )
    for item in items:
        if item.path.parent.name == "kernels" and "gpu" not in item.keywords:  # tests/kernels/
            item.add_marker(skip)
