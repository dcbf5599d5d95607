"""Strategy names and their validation, without importing torch: the CLI and the framework
adapters check a ``--strategy`` / ``strategy=`` before a model loads (seconds to minutes)."""

from __future__ import annotations

from typing import Any, Callable

# the strategies engine/reuse.py defines (it asserts the two agree); lazy:... adds quality recovery to lazy
STRATEGY_NAMES = ("full", "prefix", "position_aware", "position_aware:rerotate", "lazy")
# the strategies that never read a chunk's position-free KV (full prefill; prefix caching keys whole prompt blocks)
CHUNK_FREE_STRATEGIES = ("full", "prefix")
# The named quality recovery: ``strategy="lazy+recover"`` is lazy stitching plus this selective recompute
# (benchmarks/NOTES.md, "Answer quality, third pass", has the variants it was chosen from and its cost).
RECOVER = "lazy+recover"
RECOVER_AS = "lazy:blend=0.15:select=attn_dev"
# how lazy:blend=R chooses its tokens (engine/blend.py SELECTIONS; it asserts the two agree)
BLEND_SELECTIONS = ("global", "chunk", "attn", "attn_dev", "gradual")
# where lazy:blend=R's share is counted: over all chunk tokens of the prompt, or R of each chunk
BLEND_BUDGETS = ("global", "chunk")
# lazy:KEY=VALUE: the keyword argument KEY sets, how VALUE is read, and which values it accepts
_LAZY_KEYS: dict[str, tuple[str, Callable[[str], Any], Callable[[Any], bool]]] = {
    "first": ("recompute_first", int, lambda v: v > 0),
    "blend": ("blend", float, lambda v: 0 < v <= 1),
    "select": ("blend_select", str, lambda v: v in BLEND_SELECTIONS),
    "budget": ("blend_budget", str, lambda v: v in BLEND_BUDGETS),
    "attn_from": ("attn_from", float, lambda v: 0 <= v < 1),
}


def lazy_options(name: str) -> dict:
    """LazyStitching's keyword arguments from a strategy name: ``lazy:first=16``, ``lazy:blend=0.15``,
    ``lazy:blend=0.15:select=chunk``, ``lazy:first=16:blend=0.1``, ``lazy:blend=0.15:select=attn:budget=chunk``,
    ``lazy:blend=0.15:select=attn_dev:attn_from=0.5``."""
    usage = (
        f"Bad strategy {name!r}: write lazy:first=K (K a positive number of tokens), lazy:blend=R (R the fraction "
        "of chunk tokens to recompute, in (0, 1]; add :select=S to choose them otherwise: chunk (R of each chunk), "
        "attn (by the question's attention), attn_dev, gradual; :budget=chunk to take R of each chunk rather "
        "than of all chunk tokens; with attn or attn_dev, :attn_from=F to count the question's attention from "
        "the layer at depth F in [0, 1) on), or both, e.g. lazy:first=16:blend=0.1."
    )
    if name == RECOVER:
        name = RECOVER_AS
    opts: dict[str, int | float | str] = {}
    for part in name.split(":")[1:]:
        option = _lazy_option(part, opts)
        if option is None:
            raise ValueError(usage)
        opts[option[0]] = option[1]
    if not opts or (opts.keys() & {"blend_select", "blend_budget", "attn_from"} and "blend" not in opts):
        raise ValueError(usage)
    if "attn_from" in opts and opts.get("blend_select") not in ("attn", "attn_dev"):
        raise ValueError(usage)
    return opts


def _lazy_option(part: str, opts: dict) -> tuple[str, int | float | str] | None:
    """(keyword, value) from one ``KEY=VALUE`` of a lazy:... name; None for an unknown key, one already in
    ``opts``, or a value it does not accept."""
    key, _, value = part.partition("=")
    if key not in _LAZY_KEYS:
        return None
    option, read, accepts = _LAZY_KEYS[key]
    if option in opts:
        return None
    try:
        parsed = read(value)
    except ValueError:
        return None
    return (option, parsed) if accepts(parsed) else None


def check_strategy(name: str) -> str:
    """``name`` if the engine would accept it; a ValueError saying what to write otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"The strategy must be a name (str), not {type(name).__name__}.")
    if name in STRATEGY_NAMES or name == RECOVER:
        return name
    if name.startswith("lazy:"):
        lazy_options(name)
        return name
    raise ValueError(
        f"Unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)} "
        f"(or {RECOVER} for quality recovery, lazy:first=K, lazy:blend=R)."
    )
