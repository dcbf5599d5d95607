"""``lazyrag tune`` on a tiny random Llama on the CPU: the training forward computes what the engine computes,
a few steps lower the lazy-vs-full KL they train on, a killed run resumes where its checkpoint was, and the
adapter loads into the engine (merged, with its own fingerprint) and is refused on another base."""

import gzip
import json

import pytest
import torch

pytest.importorskip("peft")

from lazyrag.engine import LazyEngine  # noqa: E402
from lazyrag.eval import split_of  # noqa: E402
from lazyrag.tune import (  # noqa: E402
    TuneConfig,
    train as train_mod,  # noqa: E402
    tune,
)
from lazyrag.tune.forward import Example, activation_checkpointing, full_logits, lazy_logits  # noqa: E402
from tests.conftest import tiny_family_model, tiny_llama_config  # noqa: E402

CHUNKS = [
    "The Orinoco flows through Venezuela and Colombia.",
    "Lake Titicaca lies between Peru and Bolivia.",
    "Mount Kilimanjaro is in Tanzania.",
    "The Danube passes through ten countries.",
]


@pytest.mark.parametrize(
    "family, passage",
    [("llama", "default"), ("llama", None), ("qwen2", "default"), ("qwen3", "default")],
    ids=["encoding-passage", "no-passage", "qwen2", "qwen3"],
)
def test_the_training_forward_gives_the_engines_lazy_and_full_logits(tiny_hf, default_hf, family, passage):
    if family != "llama":  # Qwen2's q/k/v biases, Qwen3's q/k norms: tuned as the engine runs them
        tiny_hf = tiny_family_model(family)
    kw = {} if passage == "default" else {"encoding_passage": None}
    engine = LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20, **kw)
    passage_ids = engine.scheduler.planner.passage_ids
    examples = [
        Example(engine.build_prompt("Where does the Orinoco flow?", CHUNKS[:3]), [5, 6, 7]),
        Example(engine.build_prompt("Where is Kilimanjaro?", CHUNKS[::-1]), [9]),
        Example(engine.build_prompt("Say hello.", []), [11, 12]),
    ]
    with torch.no_grad():
        lazy, full = lazy_logits(tiny_hf, examples, passage_ids), full_logits(tiny_hf, examples)
    first = [0, 3, 4]  # the row that predicts each example's first answer token
    for e, i in zip(examples, first):
        torch.testing.assert_close(lazy[i], engine.layout_logits(e.layout, "lazy"), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(full[i], engine.layout_logits(e.layout, "full"), rtol=1e-4, atol=1e-4)
    assert (lazy[0] - full[0]).abs().max() > 1e-2, "chunks read on their own differ from a full prefill here"
    with torch.no_grad():  # every answer row against transformers' own forward of prompt + answer
        ref = tiny_hf(torch.tensor([examples[0].layout.full_ids() + [5, 6]])).logits[0, -3:]
    torch.testing.assert_close(full[:3], ref, rtol=1e-4, atol=1e-4)


def test_keeping_activations_gives_the_same_gradients_as_recomputing_them(tiny_hf, default_hf):
    engine = LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20)
    examples = [
        Example(engine.build_prompt("Where does the Orinoco flow?", CHUNKS[:3]), [5, 6, 7]),
        Example(engine.build_prompt("Where is Kilimanjaro?", CHUNKS[::-1]), [9]),
    ]
    grads = []
    for keep in (False, True):
        tiny_hf.zero_grad(set_to_none=True)
        with activation_checkpointing(not keep):
            lazy = lazy_logits(tiny_hf, examples, engine.scheduler.planner.passage_ids)
            (lazy.logsumexp(-1).sum() + full_logits(tiny_hf, examples).logsumexp(-1).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in tiny_hf.named_parameters() if p.grad is not None})
    tiny_hf.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_hf):
    """A tiny random Llama saved as a model folder (weights large enough that chunk order matters), with the
    default model's tokenizer, and a small SQuAD-format file of tune-part questions."""
    from transformers import LlamaForCausalLM

    tok = default_hf[1]
    torch.manual_seed(7)
    hf = LlamaForCausalLM(tiny_llama_config(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.normal_(0, 0.2)
        hf.lm_head.weight.normal_(0, 1.0)  # peaked next-token distributions: a KL worth lowering
    folder = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    rows, i = [], 0
    while len(rows) < 6:  # questions of the tune part (the report part is never read)
        q = f"Which river is described in note {i}?"
        if split_of(q) == "tune":
            rows.append(
                {
                    "id": str(i),
                    "question": q,
                    "answers": ["Orinoco"],
                    "chunks": [
                        {"title": f"Note {i}", "text": CHUNKS[i % 4], "gold": True},
                        {"title": "Other", "text": CHUNKS[(i + 1) % 4], "gold": False},
                    ],
                }
            )
        i += 1
    with gzip.open(folder / "squad.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return folder


def config(folder, out, **kw) -> TuneConfig:
    base = dict(
        model=str(folder / "model"),
        out=str(out),
        sets=("squad",),
        data={"squad": str(folder / "squad.jsonl.gz")},
        passages=(3,),
        prompts_per_step=2,
        answer_tokens=6,
        dev_prompts=6,
        eval_every=100,
        save_every=2,
        warmup_steps=1,
        learning_rate=5e-3,
        device="cpu",
        seed=3,
    )
    return TuneConfig(**{**base, **kw})


def test_tuning_lowers_the_lazy_kl_and_the_adapter_loads_merged(tiny_folder, tmp_path):
    # each question's two own passages and no distractor: the held-out prompts are orders the steps train on, so
    # a random model (whose lazy-vs-full gap has nothing to generalise) shows the objective going down
    small = dict(max_steps=24, passages=(2,), learning_rate=1e-3)
    result = tune(config(tiny_folder, tmp_path / "a", **small))
    kl = result.dev_kl
    assert kl["tuned_lazy"] < 0.6 * kl["base_lazy"], kl  # 1.29 -> 0.43 when written
    record = json.loads((tmp_path / "a" / "lazyrag_tune.json").read_text())
    assert record["finished"] and record["steps"] == 24 and record["base_id"]

    base = LazyEngine.from_pretrained(str(tiny_folder / "model"), device="cpu", kv_budget=16 << 20)
    tuned = LazyEngine.from_pretrained(
        str(tiny_folder / "model"), adapter=str(tmp_path / "a"), device="cpu", kv_budget=16 << 20
    )
    assert tuned.fingerprint != base.fingerprint, "stores and caches of the base model are not the tuned one's"
    assert tuned.model_name.endswith("+a")
    layout = tuned.build_prompt("Where does the Orinoco flow?", CHUNKS[:3])
    assert not torch.allclose(tuned.layout_logits(layout, "lazy"), base.layout_logits(layout, "lazy"))
    # a rerun of a finished tuning does nothing
    again = tune(config(tiny_folder, tmp_path / "a", **small))
    assert again.steps == 24 and again.seconds == 0.0


def test_a_killed_run_resumes_from_its_checkpoint_and_ends_where_an_unbroken_one_does(
    tiny_folder, tmp_path, monkeypatch
):
    unbroken = tune(config(tiny_folder, tmp_path / "whole", max_steps=4))
    saved = train_mod.Tuner.checkpoint

    def killed_after_step_2(self, student, optimizer, scheduler, step, history):
        saved(self, student, optimizer, scheduler, step, history)
        if step == 2:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(train_mod.Tuner, "checkpoint", killed_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        tune(config(tiny_folder, tmp_path / "broken", max_steps=4))
    monkeypatch.setattr(train_mod.Tuner, "checkpoint", saved)
    resumed = tune(config(tiny_folder, tmp_path / "broken", max_steps=4))
    steps = [json.loads(line)["step"] for line in (tmp_path / "broken" / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4], "steps 3 and 4 ran once, after the resume"
    assert resumed.steps == unbroken.steps == 4
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("whole", "broken"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="other settings"):
        tune(config(tiny_folder, tmp_path / "broken", max_steps=6, learning_rate=1e-3))


def test_an_adapter_is_refused_on_another_base_model(tiny_folder, tmp_path, default_hf):
    tune(config(tiny_folder, tmp_path / "a", max_steps=1))
    from transformers import LlamaForCausalLM

    torch.manual_seed(99)
    other = LlamaForCausalLM(tiny_llama_config()).eval()
    other.save_pretrained(tmp_path / "other")
    default_hf[1].save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="tuned from"):
        LazyEngine.from_pretrained(
            str(tmp_path / "other"), adapter=str(tmp_path / "a"), device="cpu", kv_budget=16 << 20
        )
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        LazyEngine.from_pretrained(str(tiny_folder / "model"), adapter=str(tmp_path / "other"), device="cpu")


def test_the_embedded_adapter_is_tuned_from_the_embedded_model_and_merges(default_hf):
    import copy

    from lazyrag.engine.config import EngineConfig
    from lazyrag.tune.adapter import EMBEDDED, adapter_folder, apply_adapter, base_id, read_record

    hf, _ = default_hf
    record = read_record(adapter_folder(EMBEDDED))
    assert record["base_id"] == base_id(hf)  # not refused on the model it ships with
    assert record["dev_kl"]["tuned_lazy"] < record["dev_kl"]["base_lazy"]
    merged = apply_adapter(copy.deepcopy(hf), EMBEDDED)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged.state_dict()[name], hf.state_dict()[name])
    assert EngineConfig(adapter="none").adapter is None and EngineConfig(adapter="embedded").adapter == "embedded"


def test_a_fully_tuned_gguf_model_saves_as_a_folder_that_loads_with_its_logits(default_hf, default_engine, tmp_path):
    # the GGUF is dequantized on load, but transformers keeps it marked quantized and refuses to save it: a full
    # fine-tuning of the embedded model ran its steps and then lost them at the save
    from lazyrag.tune.train import trainable_copy

    hf, tokenizer = default_hf
    trainable_copy(hf).save_pretrained(tmp_path / "full", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "full")
    assert hf.hf_quantizer is not None, "the original keeps its marker"
    assert "quantization_config" not in json.loads((tmp_path / "full" / "config.json").read_text())
    saved = LazyEngine.from_pretrained(str(tmp_path / "full"), device="cpu", kv_budget=64 << 20)
    layout = saved.build_prompt("Where does the Orinoco flow?", CHUNKS[:2])
    torch.testing.assert_close(
        saved.layout_logits(layout, "lazy"), default_engine.layout_logits(layout, "lazy"), atol=1e-4, rtol=1e-4
    )
