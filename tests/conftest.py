"""Shared fixtures. On a machine without CUDA, Triton kernels run in its interpreter.

TRITON_INTERPRET must be set before any module decorated with @triton.jit is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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


def tiny_llama_config(**overrides):
    """A random Llama with GQA (4 query heads over 2 KV heads) and Llama-3 RoPE frequency scaling."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


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


# -- corpus store fixtures (issue 4) ---------------------------------------------------------

TINY_DOCS = {
    "curie.md": "Marie Curie won the Nobel Prize in Physics in 1903 and the Nobel Prize in Chemistry in 1911.",
    "canal.md": "The Grand Canal of China links Beijing with Hangzhou over 1,776 kilometres and was begun in the 5th century BC.",
    "trench.txt": "The Mariana Trench in the western Pacific reaches a depth of about 10,935 metres at Challenger Deep.",
    "basalt.md": "Basalt forms when lava rich in magnesium and iron cools quickly at the surface of the Earth.",
    "paganini.txt": "The violinist Niccolo Paganini was born in Genoa in 1782 and toured Europe for decades.",
}


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


def pytest_collection_modifyitems(config, items):
    """On a GPU machine, the kernel tests written for Triton's CPU interpreter need TRITON_INTERPRET=1."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="CPU-tensor kernel test: runs in Triton's interpreter (TRITON_INTERPRET=1); the gpu-marked tests cover CUDA")
    for item in items:
        if item.path.parent.name == "kernels" and "gpu" not in item.keywords:  # tests/kernels/
            item.add_marker(skip)
