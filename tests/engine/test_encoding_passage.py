"""The encoding passage (issue 30): chunks are encoded after the prompt's prefix and a neutral passage, then their
K is rotated back over the passage, so a request reads each chunk right after its prefix as if the passage were
not there. The key rule without a passage is the one stores on disk were made with."""

import torch

from lazyrag.kernels.reference import apply_rotary
from lazyrag.kv.identity import content_key
from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE
from tests.helpers import CHUNKS, QUESTION, rel_err


def test_the_default_engine_encodes_chunks_after_the_passage(default_engine, plain_default_engine):
    passage = default_engine.prompts.passage_ids()
    assert default_engine.config.encoding_passage == DEFAULT_ENCODING_PASSAGE and len(passage) > 16
    assert (
        default_engine.scheduler.planner.passage_ids == passage and default_engine.kv_identity().passage_ids == passage
    )
    assert (
        plain_default_engine.scheduler.planner.passage_ids == []
        and plain_default_engine.kv_identity().passage_ids == []
    )


def test_chunk_kv_is_the_chunk_encoded_after_the_passage_rotated_back(default_engine, plain_default_engine):
    prefix, passage = default_engine.prompts.prefix_ids(), default_engine.prompts.passage_ids()
    chunk = default_engine.prompts.encode_chunk(CHUNKS[1])
    _, kv = default_engine.encode_chunks([chunk], read=True)
    k, v = kv[default_engine.chunk_key(chunk, prefix)]  # [L, T, Hkv, D]
    # the reference: the same chunk with prefix + passage as its whole prefix, so its K sits F positions later
    _, ref = plain_default_engine.encode_chunks([chunk], prefix + passage, read=True)
    k_late, v_ref = ref[plain_default_engine.chunk_key(chunk, prefix + passage)]
    f = len(passage)
    # two compute paths (the passage's KV cached then read, against one prefix computed in a piece; K also rotated
    # back once): fp32 rounding apart, more with a longer passage and on other CPUs' BLAS kernels
    torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        k,
        apply_rotary(k_late, plain_default_engine.runner.rope_cos[f], -plain_default_engine.runner.rope_sin[f]),
        rtol=1e-4,
        atol=1e-4,
    )
    assert rel_err(k, k_late) > 1e-2  # the rotation did something


def test_passage_keys_are_new_and_plain_keys_unchanged(default_engine, plain_default_engine):
    prefix = default_engine.prompts.prefix_ids()
    chunk = default_engine.prompts.encode_chunk(CHUNKS[0])
    plain = plain_default_engine.chunk_key(chunk, prefix)
    assert plain == content_key(plain_default_engine.fingerprint, "chunk", prefix, chunk)  # the rule of stores on disk
    assert default_engine.chunk_key(chunk, prefix) != plain


def test_requests_read_chunks_right_after_the_prefix(default_engine, plain_default_engine):
    """Recomputing every chunk token gives full prefill (no gap of passage positions), and the passage changes lazy's
    answer distribution (it is in the chunks' KV), while full prefill is the same with or without it."""
    layout = default_engine.build_prompt(QUESTION, CHUNKS[:4])
    full = default_engine.layout_logits(layout, "full")
    assert rel_err(plain_default_engine.layout_logits(layout, "full"), full) < 1e-6
    assert rel_err(default_engine.layout_logits(layout, "lazy:blend=1"), full) < 1e-4
    lazy, lazy_plain = default_engine.layout_logits(layout, "lazy"), plain_default_engine.layout_logits(layout, "lazy")
    assert rel_err(lazy, lazy_plain) > 1e-3
    assert rel_err(default_engine.layout_logits(layout, "position_aware"), lazy) < 1e-4
