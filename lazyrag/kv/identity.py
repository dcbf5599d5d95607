"""What cached KV depends on besides its tokens: the model, the KV layout, and the shared prefix chunks are
encoded after. KV made under one identity is useless under another (a corpus store checks it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVIdentity:
    model_fingerprint: str
    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    system_prompt: str
    prefix_ids: list[int]  # the shared encoding prefix every chunk is encoded after
    prefix_key: str
