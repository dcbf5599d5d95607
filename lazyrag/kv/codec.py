"""How KV is kept off the device pool (host and disk tiers, corpus stores): its dtype, and scales for int8.

The pool holds KV in the compute dtype (float32 on CPU). Off the pool, 16 bits take half of
float32's bytes at a logit error benchmarks/stored_kv.py measures, so that is the default (``auto``);
``int8`` halves them again at a measured accuracy cost; ``float32`` keeps the computed bytes exactly.

The names and what ``auto`` resolves to are in kv/formats.py (the command line reads them without torch).

``int8`` is symmetric round-to-nearest with float32 scales, K per channel (one scale per layer,
head and dimension, over the segment's tokens) and V per token (one per layer, token and head),
as KIVI (Liu et al., ICML'24) found K's outliers sit in fixed channels and V's do not. Our K is
stored before RoPE, so its channels are the model's own, not mixed by position.

An encoded segment describes itself (its tensors' dtypes, scales present or not): a reader
decodes whatever it finds, whatever setting wrote it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FP16_MAX = torch.finfo(torch.float16).max


def encode(k: torch.Tensor, v: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """``k, v [layers, tokens, H_kv, D]`` in a resolved format ``fmt``: {"k", "v"} and, for int8, {"k_scale",
    "v_scale"}."""
    if fmt == "int8":
        kq, ks = _quantize(k, dim=1)  # K per channel: a scale per (layer, head, dim), over the tokens
        vq, vs = _quantize(v, dim=3)  # V per token: a scale per (layer, token, head), over the dims
        return {"k": kq, "v": vq, "k_scale": ks, "v_scale": vs}
    dtype = _FLOAT[fmt]
    if dtype == torch.float16 and k.dtype != torch.float16 and max(_amax(k), _amax(v)) > _FP16_MAX:
        log.warning("KV values exceed float16's range; this segment is kept in bfloat16 instead")
        dtype = torch.bfloat16
    return {"k": k.to(dtype).contiguous(), "v": v.to(dtype).contiguous()}


def decode(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V in ``dtype`` on ``device`` (default: where they are) from what ``encode`` made. The encoded bytes
    travel, then widen on arrival: a host-to-GPU copy moves 1 or 2 bytes per value, not 4."""
    t = {name: x.to(device, non_blocking=True) if device is not None else x for name, x in tensors.items()}
    if "k_scale" in t:  # widened in float32, rounded once: a scale rounded to bfloat16 would skew its whole channel
        return (t["k"].float() * t["k_scale"]).to(dtype), (t["v"].float() * t["v_scale"]).to(dtype)
    return t["k"].to(dtype), t["v"].to(dtype)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    amax = x.abs().amax(dim=dim, keepdim=True) if x.shape[dim] else torch.zeros_like(x.sum(dim, keepdim=True))
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _amax(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0
