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


def write_gguf(hf, path) -> None:
    """``hf`` (a tiny Qwen2 / Qwen3) as an fp32 GGUF file the way llama.cpp's converter names it (no q/k permutation:
    these families rotate halves), with the embedded SmolLM2 GGUF's tokenizer (its vocabulary is the tiny models')."""
    import gguf

    from lazyrag.model.loader import default_model_source

    c, family, tokenizer = hf.config, hf.config.model_type, default_model_source()
    w = gguf.GGUFWriter(str(path), family)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for field in gguf.GGUFReader(tokenizer.folder / str(tokenizer.gguf_file)).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY and field.types[1] == gguf.GGUFValueType.STRING:
            w.add_array(field.name, [bytes(field.parts[i]).decode() for i in field.data])
        elif kind == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, [field.parts[i].tolist()[0] for i in field.data])
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            w.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], kind)
    blocks = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    top["lm_head.weight"] = None if c.tie_word_embeddings else "output.weight"
    for name, tensor in hf.state_dict().items():
        if name in top:
            gguf_name = top[name]
        else:  # model.layers.<i>.<module>.<weight | bias>
            parts = name.split(".")
            gguf_name = f"blk.{parts[2]}.{blocks['.'.join(parts[3:-1])]}.{parts[-1]}"
        if gguf_name is not None:
            w.add_tensor(gguf_name, tensor.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_a_gguf_file_loads_with_the_answers_transformers_reads_from_it(name, tmp_path):
    """Qwen2 and Qwen3 GGUF files (transformers reads both) through from_pretrained: the same greedy answer as
    transformers' model of the same file. Qwen3 at head_dim 128: transformers' GGUF reader takes Qwen3's default
    head_dim and reads no key_length, as every published Qwen3 has 128."""
    from transformers import AutoModelForCausalLM

    write_gguf(tiny_family_model(name, **({"head_dim": 128} if name == "qwen3" else {})), tmp_path / f"{name}.gguf")
    engine = LazyEngine.from_pretrained(tmp_path / f"{name}.gguf", device="cpu", kv_budget=32 << 20, model_cache=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f"{name}.gguf").eval()
    assert hf.config.model_type == name
    layout = engine.build_prompt(QUESTION, CHUNKS[:3])
    ids = torch.tensor([layout.full_ids()])
    answer = engine.submit(layout, SamplingParams(max_new_tokens=8, ignore_eos=True, strategy="full")).result()
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
        reference = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, ids.shape[1] :]
    assert rel_err(engine.layout_logits(layout, "full"), expected) < 1e-4
    assert answer.token_ids == reference.tolist()
    assert rel_err(engine.layout_logits(layout, "lazy"), engine.layout_logits(layout, "position_aware")) < 1e-4


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
