"""Byte sizes as users write them: ``4GiB``, ``512MB``, ``1.5G``, ``8589934592``; one parser for every budget."""

from __future__ import annotations

import re

_UNITS = {
    "": None,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}
BARE_BYTES = 1 << 20  # a number without a unit: GiB below this, bytes from it (what --kv-budget meant before units)


def parse_bytes(value: str | int | float, what: str = "the size") -> int:
    """Bytes from ``value``: a number with a unit (``4GiB``, ``512MB``, ``1.5G``; K/M/G/T alone are binary), or a bare
    number: GiB when below 2^20 (``8`` = 8 GiB), bytes otherwise (``8589934592``). A ValueError says what to write."""
    text = str(value).strip().replace("_", "").replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-zA-Z]*)", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or isinstance(value, bool):
        raise ValueError(f"{what} must be a size such as 4GiB, 512MB or 1.5G (a bare number is GiB); got {value!r}.")
    number = float(m.group(1))
    scale = _UNITS[unit] or (1 << 30 if number < BARE_BYTES else 1)
    n = int(number * scale)
    if n <= 0:
        raise ValueError(f"{what} must be more than 0 bytes; got {value!r}.")
    return n
