"""Slower homes for segment KV below the device pool: host RAM and a directory of safetensors.

A tier stores a segment's KV unpadded, ``[layers, tokens, H_kv, D]``, encoded as the cache
manager chose (kv/codec.py: 16 bits by default, int8, or the pool's float32 exactly: then a round
trip pool -> tier -> pool is bit-exact). Tiers are passive: the cache manager demotes into them
on eviction and promotes out of them on a hit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from lazyrag.kv import codec

log = logging.getLogger(__name__)


@dataclass
class TierEntry:
    key: str
    tensors: dict[str, torch.Tensor]  # encoded KV on CPU (kv/codec.py): "k", "v" [L, T, H_kv, D], int8's scales
    start: int
    kind: str = "chunk"
    cost: float = 0.0

    @classmethod
    def encoded(
        cls,
        key: str,
        k: torch.Tensor,
        v: torch.Tensor,
        fmt: str,
        start: int,
        kind: str = "chunk",
        cost: float = 0.0,
        pinned: bool = False,
    ) -> "TierEntry":
        """The segment ``k, v [L, T, H_kv, D]`` (any device) encoded as ``fmt`` (resolved, kv/codec.py), kept on CPU;
        ``pinned``: in page-locked memory, copied there straight from the device (one copy, not two)."""
        return cls(key, {n: to_host(t, pinned) for n, t in codec.encode(k, v, fmt).items()}, start, str(kind), cost)

    def decode(self, dtype: torch.dtype, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return codec.decode(self.tensors, dtype, device)

    @property
    def num_tokens(self) -> int:
        return self.tensors["k"].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def to_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """``t`` in CPU memory, page-locked if ``pinned`` (a CUDA tensor is copied once, into the page-locked buffer)."""
    if not pinned or (t.device.type == "cpu" and t.is_pinned()):
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


class CorruptKV(RuntimeError):
    """Stored KV does not match its checksum; the caller recomputes it (never uses it)."""


KV_TENSORS = ("k", "v", "k_scale", "v_scale")  # an encoded segment's tensors, in checksum order


def kv_checksum(tensors: dict[str, torch.Tensor], *context: str) -> str:
    """sha256 over ``context`` (what the KV belongs to) and the raw bytes of K, V and any scales (a byte view,
    so every dtype works)."""
    assert set(tensors) <= set(KV_TENSORS), f"unknown KV tensors {sorted(set(tensors) - set(KV_TENSORS))}"
    h = hashlib.sha256()
    for part in context:
        h.update(part.encode() + b"\0")
    for name in KV_TENSORS:
        if name in tensors:
            h.update(tensors[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _entry_context(key: str, meta: dict[str, str]) -> tuple[str, ...]:
    """What a disk file's checksum ties its KV to: the key it is filed under and where the KV was computed."""
    return key, meta.get("start", ""), meta.get("kind", "")


# the temp files atomic_write_bytes makes (".<name>.<mkstemp's 8 characters>.tmp"), left behind when a writer is killed
ATOMIC_TEMP_FILE = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers see old or new, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):  # mkstemp makes 0600; the file gets what open() would give it, as other tools do
            os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process's umask (read from /proc where there is one: setting it to read it back races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class Tier:
    name = "tier"
    writable = True
    evictions = 0  # entries pushed out (to the next tier down, or dropped), for the cache report

    def __contains__(self, key: str) -> bool:
        raise NotImplementedError

    def get(self, key: str) -> TierEntry | None:
        raise NotImplementedError

    def put(self, entry: TierEntry) -> list[TierEntry]:
        """Store ``entry``; returns the entries pushed out to make room (for the next tier down)."""
        raise NotImplementedError


class HostTier(Tier):
    """Segments in CPU RAM (page-locked when CUDA is present, for fast async copies), LRU within a byte budget."""

    name = "host"

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, TierEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.pins_memory = torch.cuda.is_available()  # page-locked entries: copies to and from the GPU run async

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_tokens(self) -> int:
        """Tokens of KV the tier holds, over all its entries."""
        with self._lock:
            return sum(e.num_tokens for e in self._entries.values())

    def get(self, key: str) -> TierEntry | None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._entries.move_to_end(key)
            return e

    def put(self, entry: TierEntry) -> list[TierEntry]:
        if entry.nbytes > self.budget_bytes:
            return [entry]
        if self.pins_memory and not all(t.is_pinned() for t in entry.tensors.values()):
            entry = TierEntry(
                entry.key,
                {n: to_host(t, pinned=True) for n, t in entry.tensors.items()},
                entry.start,
                entry.kind,
                entry.cost,
            )
        out: list[TierEntry] = []
        with self._lock:
            if entry.key in self._entries:
                return []
            while self._bytes + entry.nbytes > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                out.append(old)
                self.evictions += 1
            self._entries[entry.key] = entry
            self._bytes += entry.nbytes
        return out


class DiskTier(Tier):
    """One safetensors file per segment in a folder, with a sha256 in its header, LRU within a byte budget.

    Survives restarts: the folder is re-indexed on open (oldest modification first).
    """

    name = "disk"

    def __init__(self, folder: str | Path, budget_bytes: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> file size
        self._lock = threading.Lock()
        for p in sorted(self.folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime):
            self._files[p.stem] = p.stat().st_size

    @property
    def nbytes(self) -> int:
        return sum(self._files.values())

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def get(self, key: str) -> TierEntry | None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with self._lock:
            if key not in self._files:
                return None
            self._files.move_to_end(key)
        path = self._path(key)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
            t = load_file(str(path))
        except Exception as e:  # truncated or garbled file
            log.warning("disk tier: unreadable %s (%s); dropping it", path.name, e)
            self._drop(key)
            return None
        if set(t) - set(KV_TENSORS) or kv_checksum(t, *_entry_context(key, meta)) != meta.get("sha256"):
            log.warning("disk tier: checksum mismatch in %s; dropping it, the segment will be recomputed", path.name)
            self._drop(key)
            return None
        return TierEntry(key, t, int(meta["start"]), meta["kind"], float(meta["cost"]))

    def _drop(self, key: str) -> None:
        with self._lock:
            self._files.pop(key, None)
        self._path(key).unlink(missing_ok=True)

    def put(self, entry: TierEntry) -> list[TierEntry]:
        from safetensors.torch import save

        meta = {"start": str(entry.start), "kind": str(entry.kind), "cost": repr(entry.cost)}
        meta["sha256"] = kv_checksum(entry.tensors, *_entry_context(entry.key, meta))
        data = save({n: t.contiguous() for n, t in entry.tensors.items()}, metadata=meta)
        if len(data) > self.budget_bytes:
            return [entry]
        with self._lock:
            if entry.key in self._files:
                return []
            while self._files and self.nbytes + len(data) > self.budget_bytes:
                old, _ = self._files.popitem(last=False)
                self._path(old).unlink(missing_ok=True)
                self.evictions += 1
            atomic_write_bytes(self._path(entry.key), data)
            self._files[entry.key] = len(data)
        return []  # the bottom tier: what it drops is gone
