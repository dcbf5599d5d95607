"""The training forward: what the engine computes for ``lazy`` and for ``full``, written over a transformers
Llama's own modules so that gradients (and a peft adapter inside them) flow through every pass.

``lazy`` (engine/reuse.py ``LazyStitching``, a chunk read exactly as the kernels read it):

1. the encoding context (the prompt's prefix, then the encoding passage) runs once, at positions 0..P-1;
2. every chunk runs after it, at positions P.., all chunks of the batch in one forward (the context's K/V
   shared); the engine then rotates a chunk's keys back over the passage and the kernel forward to the
   chunk's place: one rotation by ``chunk_start - P`` here;
3. the question (and the answer being taught) runs at its final positions over the request's prefix K/V
   (the first tokens of step 1: causal, so the same as the prefix computed alone), the placed chunks and
   itself, causally.

``full``: the whole prompt and answer in one causal forward (the quality reference).

A 4-D mask with final position ids would not be the same computation: a chunk would see the prefix at the
distance of its final place, where the engine encodes it right after the passage.

Shapes: B items, R chunk rows, T tokens, H heads (Hkv K/V heads), D head dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lazyrag.prompt import PromptLayout

# cuDNN's attention is left out: with boolean masks of a new shape every step its host-side set-up cost ~0.45 s of a
# 2.1 s step (H100, SmolLM2 shapes; benchmarks/tune_step_gpu.py --variants). Chosen inside each layer, so that
# the forward that activation checkpointing reruns in the backward takes the same backend.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# whether a pass with gradients recomputes each layer's activations in the backward instead of keeping them
_CHECKPOINT_LAYERS = contextvars.ContextVar("lazyrag_tune_checkpoint_layers", default=True)


@contextlib.contextmanager
def activation_checkpointing(on: bool) -> Iterator[None]:
    """Within this block, the training forward keeps (``on=False``) or recomputes (``on=True``, the default) each
    layer's activations for the backward: keeping them saves a forward of every layer, recomputing them saves the
    memory (eight 20-passage prompts of an 8B model would hold tens of GB)."""
    token = _CHECKPOINT_LAYERS.set(on)
    try:
        yield
    finally:
        _CHECKPOINT_LAYERS.reset(token)


@dataclass
class Example:
    """One training prompt: its layout and the answer tokens taught after it."""

    layout: PromptLayout
    answer_ids: list[int]

    @property
    def targets(self) -> list[int]:
        return list(self.answer_ids)


def _modules(model):
    """(the decoder, its layers, the final norm, the LM head, the rotary embedding) of a transformers Llama, also
    when a peft model wraps it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.model
    return decoder, decoder.layers, decoder.norm, base.lm_head, decoder.rotary_emb


def _rope(rotary, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[B, T, D]`` for ``positions [B, T]`` (negative ones too: a rotation backwards)."""
    assert getattr(rotary, "attention_scaling", 1.0) == 1.0, "rotations compose only without an attention scaling"
    return rotary(x, positions)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, Hkv, T, D]`` rotated by RoPE angles ``cos, sin [B, T, D]`` (transformers' half-split layout)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _layer(layer, x, cos, sin, mask, past_k, past_v):
    """One decoder layer: ``x [B, T, hidden]`` -> (its output, this layer's new K and V ``[B, Hkv, T, D]``)."""
    attn = layer.self_attn
    B, T, _ = x.shape
    hd = attn.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(B, T, -1, hd).transpose(1, 2)  # [B, H, T, D]
    k = attn.k_proj(h).view(B, T, -1, hd).transpose(1, 2)  # [B, Hkv, T, D]
    v = attn.v_proj(h).view(B, T, -1, hd).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: each head of q and k RMS-normed, before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    new_k, new_v = k, v
    if past_k is not None:
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
    groups = q.shape[1] // k.shape[1]
    with sdpa_kernel(ATTENTION_BACKENDS):
        o = F.scaled_dot_product_attention(
            q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask, is_causal=mask is None, scale=attn.scaling
        )
    x = x + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, new_k, new_v


def _layers(
    model,
    x: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
):
    """Run ``x [B, T, hidden]`` through every layer; returns the last hidden states and each layer's new (K, V)
    ``[B, Hkv, T, D]`` (K rotated at ``positions``). ``past``: each layer's context K/V ``[B, Hkv, N, D]``,
    attended to before the new tokens; ``mask [B, 1, T, N + T]``: True where a token may attend; None: plain
    causal (right padding needs no mask: no real token sees a later one), which flash attention runs.
    With gradients on, each layer's activations are recomputed in the backward pass instead of kept, unless
    ``activation_checkpointing(False)`` says otherwise."""
    from torch.utils.checkpoint import checkpoint

    _, layers, _, _, rotary = _modules(model)
    cos, sin = _rope(rotary, x, positions)
    new_kv = []
    recompute = torch.is_grad_enabled() and _CHECKPOINT_LAYERS.get()
    for i, layer in enumerate(layers):
        pk, pv = past[i] if past is not None else (None, None)
        if recompute:
            x, k, v = checkpoint(_layer, layer, x, cos, sin, mask, pk, pv, use_reentrant=False)
        else:
            x, k, v = _layer(layer, x, cos, sin, mask, pk, pv)
        new_kv.append((k, v))
    return x, new_kv


def _embed(model, ids: torch.Tensor) -> torch.Tensor:
    return _modules(model)[0].embed_tokens(ids)


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    _, _, norm, head, _ = _modules(model)
    return head(norm(hidden)).float()


def _pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-padded with 0 ``[B, T]`` and which entries are real ``[B, T]``."""
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long, device=device)
    real = torch.zeros(len(rows), T, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
        real[i, : len(r)] = True
    return ids, real


def _causal_mask(real: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1, T, N + T]``: each token sees the real context tokens and the real tokens up to itself. A padded
    row sees itself, so that no softmax is over nothing."""
    B, T = real.shape
    own = torch.ones(T, T, dtype=torch.bool, device=real.device).tril()[None] & real[:, None, :]
    own = own | torch.eye(T, dtype=torch.bool, device=real.device)[None]
    if context is not None:
        own = torch.cat((context[:, None, :].expand(B, T, context.shape[1]), own), dim=2)
    return own[:, None]


def answer_rows(examples: list[Example]) -> list[list[int]]:
    """What the question pass reads after the context: the question, then the answer but its last token."""
    return [list(e.layout.question_ids) + e.targets[:-1] for e in examples]


def target_logits(model, hidden: torch.Tensor, examples: list[Example], offsets: list[int]) -> torch.Tensor:
    """The logits ``[sum of answers, V]`` that predict each answer token: from row ``i``'s token
    ``offsets[i] - 1`` (the last question token) on. Only those rows meet the LM head (a whole prompt's logits
    would be gigabytes)."""
    rows = torch.cat([hidden[i, o - 1 : o - 1 + len(e.targets)] for i, (e, o) in enumerate(zip(examples, offsets))])
    return _logits(model, rows)


def full_logits(model, examples: list[Example]) -> torch.Tensor:
    """``[sum of answers, V]``: a full prefill of each prompt and its answer (the quality reference)."""
    device = next(model.parameters()).device
    rows = [e.layout.full_ids() + e.targets[:-1] for e in examples]
    ids, real = _pad(rows, device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    hidden, _ = _layers(model, _embed(model, ids), positions, None)
    return target_logits(model, hidden, examples, [e.layout.num_tokens for e in examples])


def lazy_logits(model, examples: list[Example], passage_ids: list[int]) -> torch.Tensor:
    """``[sum of answers, V]``: each prompt as the engine's ``lazy`` strategy reads it, chunks encoded on their own."""
    device = next(model.parameters()).device
    enc = list(examples[0].layout.encoding_prefix)
    assert all(e.layout.encoding_prefix == enc and e.layout.prefix_ids == enc for e in examples), (
        "one encoding prefix, also each prompt's own prefix (the engine's usual case)"
    )
    context = enc + list(passage_ids)
    P = len(context)
    # 1. the encoding context, once
    ctx_ids = torch.tensor([context], device=device)
    ctx_pos = torch.arange(P, device=device)[None]
    _, ctx_kv = _layers(model, _embed(model, ctx_ids), ctx_pos, None)
    # 2. every distinct chunk of the batch after it, in one forward
    chunks: dict[tuple[int, ...], int] = {}
    for e in examples:
        for c in e.layout.chunk_ids:
            chunks.setdefault(tuple(c), len(chunks))
    chunk_kv = None
    if chunks:
        ids, real = _pad([list(c) for c in chunks], device)
        R, T = ids.shape
        past = [(k.expand(R, -1, -1, -1), v.expand(R, -1, -1, -1)) for k, v in ctx_kv]
        positions = (P + torch.arange(T, device=device)).expand(R, T)
        mask = _causal_mask(real, torch.ones(R, P, dtype=torch.bool, device=device))
        _, chunk_kv = _layers(model, _embed(model, ids), positions, mask, past)  # each layer's [R, Hkv, T, D]
    # 3. the question and answer over the request's prefix and the placed chunks
    rows = answer_rows(examples)
    ids, real = _pad(rows, device)
    B = len(examples)
    n_prefix = len(enc)
    spans = []  # per example: (chunk row, tokens, rotation) in prompt order
    for e in examples:
        chunk_starts = e.layout.chunk_starts()
        spans.append([(chunks[tuple(c)], len(c), s - P) for c, s in zip(e.layout.chunk_ids, chunk_starts)])
    N = n_prefix + max((sum(n for _, n, _ in sp) for sp in spans), default=0)
    rot_pos = torch.zeros(B, N, dtype=torch.long, device=device)  # each context slot's rotation (0: prefix, padding)
    ctx_real = torch.zeros(B, N, dtype=torch.bool, device=device)
    ctx_real[:, :n_prefix] = True
    row_of = torch.zeros(B, N, dtype=torch.long, device=device)  # which chunk row and token each slot reads
    tok_of = torch.zeros(B, N, dtype=torch.long, device=device)
    for b, sp in enumerate(spans):
        at = n_prefix
        for r, n, delta in sp:
            rot_pos[b, at : at + n] = delta
            row_of[b, at : at + n] = r
            tok_of[b, at : at + n] = torch.arange(n, device=device)
            ctx_real[b, at : at + n] = True
            at += n
    _, _, _, _, rotary = _modules(model)
    past = []
    x = _embed(model, ids)
    cos, sin = _rope(rotary, x, rot_pos[:, n_prefix:]) if N > n_prefix else (None, None)
    # each context slot's row in the chunks' K/V flattened to [R * T, Hkv, D]: index_select, whose backward is an
    # index_add (advanced indexing's backward sorted the indices: the largest GPU cost of a step)
    flat = (row_of[:, n_prefix:] * (chunk_kv[0][0].shape[2] if chunk_kv else 0) + tok_of[:, n_prefix:]).reshape(-1)
    for layer in range(len(ctx_kv)):
        pk, pv = ctx_kv[layer]
        k = pk[:, :, :n_prefix].expand(B, -1, -1, -1)
        v = pv[:, :, :n_prefix].expand(B, -1, -1, -1)
        if chunk_kv is not None and N > n_prefix:
            ck, cv = chunk_kv[layer]  # [R, Hkv, T, D]
            hkv, hd = ck.shape[1], ck.shape[3]
            sel_k = ck.transpose(1, 2).reshape(-1, hkv, hd).index_select(0, flat).view(B, N - n_prefix, hkv, hd)
            sel_v = cv.transpose(1, 2).reshape(-1, hkv, hd).index_select(0, flat).view(B, N - n_prefix, hkv, hd)
            assert cos is not None and sin is not None  # set whenever N > n_prefix
            sel_k = _rotate(sel_k.transpose(1, 2), cos, sin)  # [B, Hkv, N', D], rotated to each chunk's place
            k, v = torch.cat((k, sel_k), dim=2), torch.cat((v, sel_v.transpose(1, 2)), dim=2)
        past.append((k, v))
    starts = torch.tensor([e.layout.question_start for e in examples], device=device)
    positions = starts[:, None] + torch.arange(ids.shape[1], device=device)[None]
    hidden, _ = _layers(model, x, positions, _causal_mask(real, ctx_real), past)
    return target_logits(model, hidden, examples, [len(e.layout.question_ids) for e in examples])
