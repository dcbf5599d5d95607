"""``lazyrag cache``: what a corpus store holds, read from its manifest and folder (no model load)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lazyrag.cli.common import HelpFormatter

CACHE_HELP = """\
Show what a corpus store from `lazyrag precache` holds, without loading a model: its status, the model and
dtype its KV is for (an engine with another model or dtype refuses it), entries (chunks) and tokens, bytes
on disk (KV shards and the whole folder) and per token, and how it was built.

The live cache of a running engine is `engine.cache_report()` in Python (per tier: entries, bytes, hits,
misses, hit rate, evictions; prefix vs chunk reuse) and `GET /metrics` of `lazyrag serve`.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cache",
        help="show a corpus store's entries, bytes on disk, dtype and model (no model load)",
        description=CACHE_HELP,
        formatter_class=HelpFormatter,
        epilog="examples:\n  lazyrag cache --store stores/nq\n  lazyrag cache --store stores/nq --json",
    )
    p.add_argument("--store", type=Path, required=True, help="a corpus store folder (lazyrag precache --out)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    return p


def check(args) -> None:
    from lazyrag.store.corpus import MANIFEST, StoreError

    if not (args.store / MANIFEST).is_file():
        raise StoreError(
            f"{args.store} is not a corpus store (no {MANIFEST}); build one with: "
            f"lazyrag precache CORPUS --out {args.store}"
        )


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def store_report(path: Path) -> dict:
    """What ``lazyrag cache --store`` shows: read from the manifest and the folder, no model, no index load."""
    import time

    from lazyrag.store.corpus import KV_DIR, read_manifest, rebuild_interrupted

    m = read_manifest(path)
    kv_bytes = _folder_bytes(path / KV_DIR)
    status = "half deleted by an interrupted precache --overwrite: rerun it" if rebuild_interrupted(path) else m.status
    return {
        "store": str(path),
        "status": status,
        "model": m.model_name,
        "model_fingerprint": m.model_fingerprint,
        "dtype": m.dtype,
        "stored_kv_dtype": m.stored_kv_dtype,
        "kv_shape": f"{m.num_layers} layers x {m.num_kv_heads} KV heads x {m.head_dim}",
        "block_size": m.block_size,
        "entries": m.num_chunks,
        "tokens": m.num_tokens,
        "prefix_tokens": len(m.prefix_ids),
        "kv_bytes": kv_bytes,
        "bytes_on_disk": _folder_bytes(path),
        # the KV files hold every chunk's tokens and, once, the shared prefix's
        "bytes_per_token": kv_bytes // (m.num_tokens + len(m.prefix_ids)) if m.num_tokens else None,
        "chunk_tokens": m.chunk_tokens,
        "overlap": m.overlap,
        "index": m.index_kind,
        "embedder": m.embedder,
        "layout_version": m.layout_version,
        "sources": len(m.sources),
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)),
    }


def _size(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run(args) -> int:
    import json

    report = store_report(args.store)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"corpus store {report['store']}", show_header=True, header_style="bold")
    table.add_column("field")
    table.add_column("value", overflow="fold")
    shown = {
        **report,
        "kv_bytes": f"{_size(report['kv_bytes'])} ({report['kv_bytes']} B)",
        "bytes_on_disk": f"{_size(report['bytes_on_disk'])} ({report['bytes_on_disk']} B)",
        "bytes_per_token": _size(report["bytes_per_token"]),
    }
    for key, value in shown.items():
        if key != "store":
            table.add_row(key.replace("_", " "), str(value))
    Console().print(table)
    return 0
