"""A Llama forward pass over the paged KV pool, readable top to bottom.

The Llama family as vLLM serves it: Llama 2/3, Mistral (full attention), Qwen2 / Qwen2.5 (q/k/v bias) and Qwen3
(RMSNorm over each head of q and k before RoPE). Keys are stored after that norm and before RoPE, so the deferred
rotation of the attention kernels is the same for every family.

Shapes: T = tokens in the batch (packed, variable-length sequences), H = hidden size,
Hq / Hkv = query / KV heads, D = head dim. Under tensor parallelism (model/parallel.py) the
args are one rank's shard: Hq, Hkv and the intermediate size are this rank's share, and the
two row-parallel projections (wo, down) are followed by an all-reduce; ``tp`` None is one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lazyrag.kernels.reference import apply_rotary, rope_tables
from lazyrag.model.attention import AttentionMetadata
from lazyrag.model.loader import SavedConfig
from lazyrag.model.parallel import TensorParallel

if TYPE_CHECKING:
    from lazyrag.kv.block_pool import BlockPool


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # q, k and v projections with a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection with a bias (Llama's attention_bias; not Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3)
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, config) -> "LlamaArgs":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        family = getattr(config, "model_type", "llama")
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            qk_norm=family == "qwen3",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """inv_freq ``[D/2]`` and the attention scaling of the config's rope type (Llama-3, linear, YaRN...).

    transformers computes both; dynamic NTK changes the frequencies with the sequence
    length, which no position-free cache can honour, so it is refused.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        raise ValueError(
            "Dynamic NTK RoPE rescales frequencies with the prompt length; lazyrag needs static frequencies."
        )
    if rope_type == "default":
        # transformers' formula (LlamaRotaryEmbedding.compute_default_rope_parameters), computed here because
        # importing its modeling code costs 0.7 s of a 2 s model load on 2 cores
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if isinstance(config, SavedConfig):  # transformers' RoPE functions call methods of its config
        config = config.to_transformers()
    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.float().cpu(), float(rotary.attention_scaling)


# -- elementwise pieces: plain functions, so that on CUDA each can be compiled into one kernel
# (a decode step of an 8B model otherwise spends as long launching ~40 tiny kernels a layer
# as it does reading the weights).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # statistics in fp32, scaled in the model dtype: transformers' Llama numerics
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rotate_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float, hq: int, hkv: int):
    """Split the fused projection into q [T, Hq, D], k, v [T, Hkv, D]; rotate q and k at their positions."""
    T, d = qkv.shape[0], cos.shape[-1] * 2
    qk = qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d)
    qk = apply_rotary(qk, cos, sin)
    if scaling != 1.0:  # YaRN-style attention scaling, applied to both q and k
        qk = qk * scaling
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    return qk[:, :hq], qk[:, hq:], v


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def rope_at(rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin ``[T, 1, D/2]`` of the tokens at ``positions [T]``, broadcasting over heads."""
    return rope_cos[positions][:, None, :].to(dtype), rope_sin[positions][:, None, :].to(dtype)


GEMV_LAYERS = frozenset({"wqkv", "wo", "gate_up", "down"})
# the engine's default: on the H200 (round 6, benchmarks/NOTES.md) the GEMV v2 beat the norm (or silu*up) kernel +
# cuBLAS for all four projections (wqkv 14.6 vs 20.3 µs, wo 9.65 vs 13.4, gate_up 55.9 vs 61.7, down 30.0 vs 33.9);
# decode at batch 1 4.64 ms/token with all four against 4.97-5.04 with wqkv and wo only (A/B, one engine)
GEMV_DEFAULT = GEMV_LAYERS


@dataclass
class ElementwiseOps:
    rms_norm: Callable[..., Any] = rms_norm
    add_rms_norm: Callable[..., Any] = add_rms_norm
    rotate_qk: Callable[..., Any] = rotate_qk
    silu_mul: Callable[..., Any] = silu_mul
    # rotate_qk and the pool write of the new K/V in one kernel (kernels/qkv.py), where Triton runs;
    # None: rotate_qk, then ``pool.write``
    rotate_qk_store: Callable[..., Any] | None = None
    # Qwen3's q/k head norms of the fused projection in place, one kernel (kernels/elementwise.py), where Triton
    # runs; None: two ``rms_norm`` calls and a concatenation
    head_rms_norm: Callable[..., Any] | None = None
    # each row's greedy token, ``[B, V]`` logits -> ``[B]`` int64 on the same device (no host sync)
    greedy_tokens: Callable[..., Any] = greedy_tokens
    # projections (of GEMV_LAYERS) that a one-token forward runs as a Triton GEMV (kernels/gemv.py), the
    # norm or silu*up before them folded into its prologue: one launch instead of two, and the weights
    # read at a GEMV's rate rather than a GEMM's small-tile one. Empty: elementwise kernel, then torch's GEMM.
    gemv: frozenset = frozenset()
    # projections (of GEMV_LAYERS) that a 2-64 token forward (the TTFT prefill) runs through kernels/gemm.py's
    # skinny GEMM instead of torch's, where Triton runs: CUDA, or the CPU under its interpreter (the tests).
    skinny: frozenset = frozenset()

    @classmethod
    def compiled(cls) -> "ElementwiseOps":
        compile = lambda f: torch.compile(f, dynamic=True)  # noqa: E731  (shapes vary with the token count)
        return cls(compile(rms_norm), compile(add_rms_norm), compile(rotate_qk), compile(silu_mul))

    def with_triton_kernels(self) -> "ElementwiseOps":
        """The norms, silu*up and the greedy argmax as the Triton kernels of kernels/elementwise.py (any token
        count)."""
        from lazyrag.kernels import elementwise as E

        return replace(
            self,
            rms_norm=E.rms_norm,
            add_rms_norm=E.add_rms_norm,
            silu_mul=E.silu_mul,
            greedy_tokens=E.greedy_tokens,
            head_rms_norm=E.head_rms_norm,
        )

    def with_fused_kv_store(self) -> "ElementwiseOps":
        from lazyrag.kernels.qkv import rotate_qk_store

        return replace(self, rotate_qk_store=rotate_qk_store)

    def _gemv(self, name: str, x: torch.Tensor):
        """kernels.gemv where this projection of a one-token forward uses it, else None."""
        if name in self.gemv and x.shape[0] == 1:
            from lazyrag.kernels import gemv

            return gemv
        return None

    def _gemm(self, name: str, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """``linear(x)``: kernels.gemm's skinny GEMM where this projection of a 2-64 token forward uses it, else
        torch's."""
        if name in self.skinny and 2 <= x.shape[0] <= 64:
            from lazyrag.kernels.gemm import skinny_linear
            from lazyrag.kernels.kvloop import interpreting

            if x.is_cuda or interpreting():
                return skinny_linear(x, linear.weight, linear.bias)
        return linear(x)

    def norm_linear(self, name: str, x, residual, norm: "RMSNorm", linear: nn.Linear):
        """(the stream ``x + residual`` (``x`` where residual is None), ``linear(rms_norm(stream))``)."""
        k = self._gemv(name, x)
        if k is not None:
            if residual is None:
                return x, k.gemv(x, linear.weight, linear.bias, prologue=k.NORM, norm_weight=norm.weight, eps=norm.eps)
            return k.gemv(
                x,
                linear.weight,
                linear.bias,
                prologue=k.ADD_NORM,
                residual=residual,
                norm_weight=norm.weight,
                eps=norm.eps,
            )
        if residual is None:
            return x, self._gemm(name, self.rms_norm(x, norm.weight, norm.eps), linear)
        residual, h = self.add_rms_norm(x, residual, norm.weight, norm.eps)
        return residual, self._gemm(name, h, linear)

    def gated_linear(self, name: str, gate_up: torch.Tensor, inter: int, linear: nn.Linear) -> torch.Tensor:
        """``linear(silu(gate) * up)`` of the ``[T, 2 inter]`` gate|up projection."""
        k = self._gemv(name, gate_up)
        if k is not None:
            return k.gemv(gate_up, linear.weight, linear.bias, prologue=k.SILU)
        return self._gemm(name, self.silu_mul(gate_up, inter), linear)

    def linear(self, name: str, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        k = self._gemv(name, x)
        return self._gemm(name, x, linear) if k is None else k.gemv(x, linear.weight, linear.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


def _all_reduce(tp: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's partial ``[T, H]`` summed over the ranks; one process: ``x`` itself."""
    return x if tp is None else tp.all_reduce(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.hq, self.hkv, self.d = args.num_heads, args.num_kv_heads, args.head_dim
        # q, k and v in one matmul
        self.wqkv = nn.Linear(args.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=args.qkv_bias)
        self.wo = nn.Linear(self.hq * self.d, args.hidden_size, bias=args.o_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.d, args.rms_norm_eps), RMSNorm(self.d, args.rms_norm_eps)

    def normed(self, qkv: torch.Tensor, ops: "ElementwiseOps") -> torch.Tensor:
        """The fused projection ``[T, (Hq + 2 Hkv) D]`` with each head of q and k RMS-normed (Qwen3), else as it is."""
        if not self.qk_norm:
            return qkv
        if ops.head_rms_norm is not None:
            return ops.head_rms_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.hq, self.hkv)
        T, d, nq, nk = qkv.shape[0], self.d, self.hq * self.d, self.hkv * self.d
        q = ops.rms_norm(qkv[:, :nq].reshape(T * self.hq, d), self.q_norm.weight, self.q_norm.eps)
        k = ops.rms_norm(qkv[:, nq : nq + nk].reshape(T * self.hkv, d), self.k_norm.weight, self.k_norm.eps)
        return torch.cat((q.view(T, nq), k.view(T, nk), qkv[:, nq + nk :]), dim=1)

    def project(self, x, cos, sin, ops: "ElementwiseOps", rope_scaling: float):
        """q: [T, Hq, D]; k, v: [T, Hkv, D], q and k rotated at the positions of ``cos``, ``sin``."""
        return ops.rotate_qk(self.normed(self.wqkv(x), ops), cos, sin, rope_scaling, self.hq, self.hkv)

    def forward(self, qkv, cos, sin, rt: "Runtime") -> torch.Tensor:
        """This layer's fused projection ``qkv [T, (Hq + 2 Hkv) D]`` -> its attention output, projected ``[T, H]``."""
        T = qkv.shape[0]
        qkv = self.normed(qkv, rt.ops)
        # Keys are stored rotated at the positions they were computed at; the attention
        # backend adds each cached segment's offset later.
        if rt.ops.rotate_qk_store is not None:  # rotation and K/V store in one kernel
            q, k, v = rt.ops.rotate_qk_store(
                qkv,
                cos,
                sin,
                rt.rope_scaling,
                self.hq,
                self.hkv,
                rt.pool.k[self.layer],
                rt.pool.v[self.layer],
                rt.meta.slot_mapping,
            )
        else:
            q, k, v = rt.ops.rotate_qk(qkv, cos, sin, rt.rope_scaling, self.hq, self.hkv)
            rt.pool.write(self.layer, rt.meta.slot_mapping, k, v)
        o = rt.attention(
            q, k, v, rt.pool.k[self.layer], rt.pool.v[self.layer], rt.meta, rt.rope_cos, rt.rope_sin, rt.sm_scale
        )
        return _all_reduce(self.tp, rt.ops.linear("wo", o.reshape(T, self.hq * self.d), self.wo))  # [T, H]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output ``o [T, Hq D]`` projected to ``[T, H]`` (summed over the ranks), for callers
        that attend their own way (engine/blend.py)."""
        return _all_reduce(self.tp, self.wo(o))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.inter = args.intermediate_size
        self.w_gate_up = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.w_down = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, ops: ElementwiseOps) -> torch.Tensor:
        return _all_reduce(self.tp, ops.gated_linear("down", self.w_gate_up(x), self.inter, self.w_down))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer, tp)
        self.mlp_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, tp)

    def forward(self, x, residual, cos, sin, rt) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream kept apart, vLLM-style: ``x`` is the previous layer's MLP output and
        ``residual`` the stream before it (None at the first layer), so each residual add is fused
        into the norm that follows it. Returns (this layer's MLP output, the stream before it);
        their sum is ``after_attention(...)``'s output, to the bit (one-token GEMVs off: they round differently)."""
        ops, mlp = rt.ops, self.mlp
        residual, qkv = ops.norm_linear("wqkv", x, residual, self.attn_norm, self.attn.wqkv)
        residual, gate_up = ops.norm_linear(
            "gate_up", self.attn(qkv, cos, sin, rt), residual, self.mlp_norm, mlp.w_gate_up
        )
        return _all_reduce(mlp.tp, ops.gated_linear("down", gate_up, mlp.inter, mlp.w_down)), residual

    # The layer in two halves around its attention, for callers that attend their own way (engine/blend.py).

    def attn_input(self, x: torch.Tensor, ops: ElementwiseOps) -> torch.Tensor:
        return ops.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps)

    def after_attention(self, x: torch.Tensor, a: torch.Tensor, ops: ElementwiseOps) -> torch.Tensor:
        """The layer's output from its input ``x`` and attention output ``a`` (both [T, H]): residual, MLP."""
        h, hn = ops.add_rms_norm(x, a, self.mlp_norm.weight, self.mlp_norm.eps)
        return h + self.mlp(hn, ops)


@dataclass
class Runtime:
    """Per-forward state the layers share: the pool, the batch's layout, the backend, RoPE tables."""

    pool: BlockPool
    meta: AttentionMetadata
    attention: Callable[..., torch.Tensor]
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_scaling: float
    sm_scale: float
    ops: ElementwiseOps = field(default_factory=ElementwiseOps)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TensorParallel | None = None):
        """``args``: the model's, or with ``tp`` one rank's shard of it (``parallel.local_args``)."""
        super().__init__()
        self.args, self.tp = args, tp
        # made uninitialised: every caller loads or initialises the weights, and nn.Embedding's own normal_ on the meta
        # device imports torch._dynamo (1.4 s of a model load on 2 cores)
        self.embed = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
        )
        self.layers = nn.ModuleList(Block(args, i, tp) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rt: Runtime) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H] (new K/V written into the pool)."""
        x = self.embed(input_ids)  # [T, H]
        cos, sin = rope_at(rt.rope_cos, rt.rope_sin, positions, x.dtype)  # cast once for all layers
        residual = None
        for block in self.layers:
            x, residual = block(x, residual, cos, sin, rt)
        if residual is None:  # no layers
            return rt.ops.rms_norm(x, self.norm.weight, self.norm.eps)
        return rt.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [T, V]

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.args.head_dim)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' LlamaForCausalLM into this module."""
        a = self.args
        own = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
        if not a.tie_word_embeddings:
            own["lm_head.weight"] = sd["lm_head.weight"]
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            own[f"layers.{i}.attn.wqkv.weight"] = torch.cat([sd[att + f"{n}_proj.weight"] for n in "qkv"])
            if a.qkv_bias:
                own[f"layers.{i}.attn.wqkv.bias"] = torch.cat([sd[att + f"{n}_proj.bias"] for n in "qkv"])
            if a.o_bias:
                own[f"layers.{i}.attn.wo.bias"] = sd[att + "o_proj.bias"]
            if a.qk_norm:
                own[f"layers.{i}.attn.q_norm.weight"] = sd[att + "q_norm.weight"]
                own[f"layers.{i}.attn.k_norm.weight"] = sd[att + "k_norm.weight"]
            own[f"layers.{i}.attn.wo.weight"] = sd[att + "o_proj.weight"]
            own[f"layers.{i}.mlp.w_gate_up.weight"] = torch.cat(
                [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
            )
            own[f"layers.{i}.mlp.w_down.weight"] = sd[p + "mlp.down_proj.weight"]
            if a.mlp_bias:
                own[f"layers.{i}.mlp.w_gate_up.bias"] = torch.cat(
                    [sd[p + "mlp.gate_proj.bias"], sd[p + "mlp.up_proj.bias"]]
                )
                own[f"layers.{i}.mlp.w_down.bias"] = sd[p + "mlp.down_proj.bias"]
            own[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
            own[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if not (a.tie_word_embeddings and m == "lm_head.weight")]
        assert not missing and not unexpected, (missing, unexpected)


def build_rope(config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
    """fp32 cos/sin tables for every position the model supports, and the rope's attention scaling."""
    inv_freq, scaling = rope_frequencies(config)
    cos, sin = rope_tables(inv_freq, config.max_position_embeddings)
    return cos.to(device), sin.to(device), scaling
