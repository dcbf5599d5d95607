"""The kernels' tuned choices per device, read once from ``tuned_configs.json`` (package data).

``tuned(device)`` is the table of one device: the file's ``"default"`` entry with the keys of an entry named after
the device (``torch.cuda.get_device_name``) merged over it. ``LAZYRAG_TUNED_CONFIGS`` may name more files of the
same layout (``os.pathsep``-separated), merged over the package's in order: how a benchmark adopts a sweep's table.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

PATH = Path(__file__).with_name("tuned_configs.json")


def merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s keys, nested dicts merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    table = json.loads(PATH.read_text())
    for extra in filter(None, os.environ.get("LAZYRAG_TUNED_CONFIGS", "").split(os.pathsep)):
        table = merged(table, json.loads(Path(extra).read_text()))
    return table


@functools.lru_cache(maxsize=None)
def for_device_name(name: str) -> dict:
    table = _table()
    return merged(table["default"], table.get(name, {}))


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def device_name(device) -> str:
    """The table's key for ``device`` (a torch.device): its CUDA name, ``"default"`` for anything else."""
    if device.type != "cuda":
        return "default"
    import torch

    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def tuned(device, override: dict | None = None) -> dict:
    """The tuned table of ``device``, with ``override`` (same layout as one device's entry) merged over it."""
    table = for_device_name(device_name(device))
    return merged(table, override) if override else table
