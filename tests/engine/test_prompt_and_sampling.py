"""Prompt segments, sampling and streaming detokenization."""

import pytest
import torch

from lazyrag.engine import SamplingParams
from lazyrag.engine.sampling import Detokenizer, sample
from lazyrag.prompt import CONTEXT_HEADER, PromptBuilder


def test_segments_concatenate_to_the_chat_template(default_hf):
    tok = default_hf[1]
    b = PromptBuilder(tok, "Be brief.")
    chunks = ["Alpha is first.", "Beta follows alpha."]
    layout = b.build("What follows alpha?", chunks)
    user = CONTEXT_HEADER + "".join(c + "\n\n" for c in chunks) + "Question: What follows alpha?"
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(layout.full_ids()) == expected
    assert layout.chunk_starts() == [len(layout.prefix_ids), len(layout.prefix_ids) + len(layout.chunk_ids[0])]


def test_chunk_ids_do_not_depend_on_neighbours(default_hf):
    b = PromptBuilder(default_hf[1])
    one = b.build("q", ["Gamma rays are light.", "Delta is a river mouth."])
    two = b.build("another q", ["Delta is a river mouth.", "Epsilon is small."])
    assert one.chunk_ids[1] == two.chunk_ids[0]
    assert one.prefix_ids == two.prefix_ids


def test_greedy_and_nucleus_sampling():
    logits = torch.randn(100)
    assert sample(logits, SamplingParams(temperature=0), None) == int(logits.argmax())
    # a nucleus this small keeps only the top token, at any temperature
    assert sample(logits, SamplingParams(temperature=5.0, top_p=1e-6), torch.Generator().manual_seed(1)) == int(
        logits.argmax()
    )
    draws = [
        sample(logits, SamplingParams(temperature=1.0, seed=3), torch.Generator().manual_seed(3)) for _ in range(2)
    ]
    assert draws[0] == draws[1]
    spread = {sample(logits, SamplingParams(temperature=2.0), torch.Generator().manual_seed(s)) for s in range(30)}
    assert len(spread) > 3


def test_detokenizer_holds_back_partial_stop_strings(default_hf):
    tok = default_hf[1]
    ids = tok("The answer is Paris. END of answer", add_special_tokens=False).input_ids
    d = Detokenizer(tok, ["END"])
    out = ""
    for t in ids:
        out += d.push(t)
        assert "E" not in out[len("The answer is Paris.") :]  # never emits the start of the stop string
        if d.stopped:
            break
    out += d.finish()
    assert d.stopped and out == "The answer is Paris. "


def test_layout_token_ids_of_any_integer_type_are_taken_and_bad_ones_named(tiny_engine):
    """numpy / torch integers are token ids too (converted to int); a float or an out-of-vocabulary id is named."""
    import numpy as np

    from lazyrag.engine import SamplingParams
    from lazyrag.prompt import PromptLayout, check_layout

    layout = tiny_engine.build_prompt("What is it?", ["A chunk of text about it."])
    plain = tiny_engine.submit(layout, SamplingParams(max_new_tokens=3)).result().token_ids
    as_numpy = PromptLayout(
        np.array(layout.prefix_ids), [np.array(c) for c in layout.chunk_ids], torch.tensor(layout.question_ids)
    )
    assert tiny_engine.submit(as_numpy, SamplingParams(max_new_tokens=3)).result().token_ids == plain
    assert all(type(t) is int for t in as_numpy.prefix_ids + as_numpy.question_ids + as_numpy.chunk_ids[0])
    with pytest.raises(ValueError, match=r"chunk 0 holds 1\.5 \(float\)"):
        check_layout(PromptLayout([1], [[1.5]], [2]), 100)
    with pytest.raises(ValueError, match=r"question holds token id 100, outside the model's vocabulary \[0, 100\)"):
        check_layout(PromptLayout([1], [], [100]), 100)


def test_a_one_token_completion_prompt_says_what_it_needs(tiny_engine):
    with pytest.raises(ValueError, match="single token.*at least two"):
        tiny_engine.layout_from_text("Hi")
    assert tiny_engine.layout_from_text("Hi there").num_tokens >= 2
