"""The stored KV dtypes' names and what ``auto`` means, importable without torch (the command line's choices);
kv/codec.py encodes and decodes them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module without torch
    import torch

STORED_KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def resolve_stored_dtype(name: str, compute_dtype: torch.dtype | str) -> str:
    """The format ``name`` means for KV computed in ``compute_dtype`` (a torch dtype or its name): ``auto`` is 16
    bits (float16 from float32, whose 10 mantissa bits keep more than bfloat16's 7; a 16-bit dtype as it is)."""
    if name not in STORED_KV_DTYPES:
        raise ValueError(f"stored KV dtype must be one of {', '.join(STORED_KV_DTYPES)}; got {name!r}")
    if name != "auto":
        return name
    compute = str(compute_dtype).removeprefix("torch.")
    return "float16" if compute == "float32" else compute
