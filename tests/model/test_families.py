"""The Llama family beyond Llama (issue 46): Qwen2 / Qwen2.5 (q/k/v bias, tied embeddings), Qwen3 (per-head q/k
RMSNorm before RoPE, head_dim != hidden / heads) and Mistral (full attention), as tiny random models built through
transformers. Each answers as transformers does, whether handed over in memory (``from_hf``) or loaded from a
``save_pretrained`` folder; cached chunk KV read at new positions equals KV computed there; and what the forward
cannot run exactly (sliding windows, experts, other architectures) is refused with what is supported."""

import json

import pytest
import torch

from lazyrag.engine import LazyEngine, SamplingParams
from lazyrag.model.loader import ModelLoadError, check_llama_config
from tests.conftest import FAMILIES, tiny_family_model
from tests.helpers import CHUNKS, QUESTION, rel_err

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, default_hf, tmp_path_factory):
    """(name, transformers model, its engine from_hf, its save_pretrained folder with a tokenizer). The tokenizer is
    read back from the folder, as from_pretrained reads it (transformers picks its class by the folder's model_type)."""
    from transformers import AutoTokenizer

    hf = tiny_family_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    default_hf[1].save_pretrained(folder)
    engine = LazyEngine.from_hf(hf, AutoTokenizer.from_pretrained(folder), device="cpu", kv_budget=32 << 20)
    return request.param, hf, engine, folder


def test_full_prefill_and_greedy_answers_equal_transformers(family):
    name, hf, engine, _ = family
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    ids = torch.tensor([layout.full_ids()])
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
    assert rel_err(engine.layout_logits(layout, "full"), expected) < 1e-4, name
    answer = engine.submit(layout, SamplingParams(max_new_tokens=8, ignore_eos=True, strategy="full")).result()
    with torch.no_grad():
        reference = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, ids.shape[1] :]
    assert answer.token_ids == reference.tolist(), name


def test_cached_chunks_at_new_positions_equal_position_aware_prefill(family):
    """lazy reads each chunk's KV computed once, rotated to where it lands; position_aware computes it there.
    Two chunk orders, so the second request reads cached KV at positions it was not computed at."""
    name, _, engine, _ = family
    for order in (CHUNKS[:3], CHUNKS[2::-1]):
        lazy = engine.next_token_logits(QUESTION, order, strategy="lazy")
        aware = engine.next_token_logits(QUESTION, order, strategy="position_aware")
        assert rel_err(lazy, aware) < 1e-4, name
    recovered = engine.next_token_logits(QUESTION, CHUNKS[:3], strategy="lazy+recover")
    assert torch.isfinite(recovered).all()


def test_a_saved_folder_loads_with_the_same_answers_and_its_own_fingerprint(family, tiny_engine):
    name, _, engine, folder = family
    loaded = LazyEngine.from_pretrained(folder, device="cpu", kv_budget=32 << 20)
    layout = engine.build_prompt(QUESTION, CHUNKS[:2])
    assert rel_err(loaded.layout_logits(layout, "lazy"), engine.layout_logits(layout, "lazy")) < 1e-5, name
    assert loaded.fingerprint == engine.fingerprint != tiny_engine.fingerprint  # stores of one never serve another


def test_each_family_builds_the_layers_it_needs():
    from lazyrag.model.llama import LlamaArgs

    args = {f: LlamaArgs.from_hf(tiny_family_model(f).config) for f in FAMILIES}
    assert (args["qwen2"].qkv_bias, args["qwen2"].o_bias, args["qwen2"].qk_norm) == (True, False, False)
    assert (args["qwen3"].qkv_bias, args["qwen3"].o_bias, args["qwen3"].qk_norm) == (False, False, True)
    assert args["qwen3"].head_dim == 32 and args["qwen2"].tie_word_embeddings
    assert not any((args["mistral"].qkv_bias, args["mistral"].o_bias, args["mistral"].qk_norm))


def test_what_the_forward_cannot_run_exactly_is_refused_with_what_is_supported(tmp_path):
    from transformers import MistralConfig, MixtralConfig, Qwen2Config

    windowed = MistralConfig(num_hidden_layers=2, sliding_window=4096, max_position_embeddings=32768)
    with pytest.raises(ModelLoadError, match="sliding-window attention .*4096 tokens, 2 layers"):
        check_llama_config(windowed, "mistral-v0.1")
    check_llama_config(MistralConfig(sliding_window=None))  # Mistral 7B v0.2 and later
    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=1024, max_window_layers=2)
    with pytest.raises(ModelLoadError, match="sliding-window attention .*2 layers"):
        check_llama_config(qwen, "qwen-windowed")
    check_llama_config(Qwen2Config(num_hidden_layers=4))  # the window off: Qwen's default
    with pytest.raises(ModelLoadError, match="'mixtral' model.*'qwen3'.*Mixture-of-experts"):
        check_llama_config(MixtralConfig(num_hidden_layers=2), "mixtral")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "num_hidden_layers": 2}))
    with pytest.raises(ModelLoadError, match="'gemma2' model; lazyrag runs the Llama family"):
        LazyEngine.from_pretrained(tmp_path)
