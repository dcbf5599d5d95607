"""A corpus store on disk: chunks, their embeddings and FAISS index, and their position-free KV.

Layout of a store folder (``LAYOUT_VERSION`` 1)::

    manifest.json        what the KV is valid for (model fingerprint, dtype, block size,
                         encoding prefix and system prompt), the embedder, the chunking
                         parameters, and ``status``: "building" until the index is written
    chunks.sqlite        one row per chunk: id, content key, source document, text, token
                         count, KV shard, sha256 of its K+V bytes, embedding; plus one row
                         (id -1, kind "prefix") for the shared encoding prefix
    index.faiss          inner-product index over the normalised embeddings; FAISS ids = chunk ids
    kv/shard-NNNNNN.safetensors
                         tensors "<id>.k" and "<id>.v": ``[layers, tokens, H_kv, D]`` in the
                         engine's KV dtype, UNPADDED (block padding is a pool detail)

Every file is written to a temp name and renamed; a shard's rows are inserted in one
sqlite transaction after its file is in place, so an interrupted build leaves only whole
shards behind and resumes from the first missing one.

The KV is exactly what the engine caches for the chunk (same prefix, same positions,
same dtype): a store is refused by an engine with another fingerprint, dtype, block size
or prefix, and a chunk whose bytes do not match their checksum is never used (the engine
recomputes it; ``verify(repair=True)`` drops it so the next ``precache`` run rebuilds it).
"""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from lazyrag.kv.tiers import Tier, TierEntry, atomic_write_bytes, kv_checksum

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
MANIFEST, TABLE, INDEX, KV_DIR = "manifest.json", "chunks.sqlite", "index.faiss", "kv"
PREFIX_ID = -1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    doc_id TEXT NOT NULL,
    text TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    start INTEGER NOT NULL,
    shard TEXT NOT NULL,
    checksum TEXT NOT NULL,
    embedding BLOB,
    meta TEXT NOT NULL
)
"""


class StoreError(RuntimeError):
    """The store cannot be used as asked; the message says what to do."""


class StoreMismatch(StoreError):
    """The store was made for another model, dtype, block size, prefix or layout."""


@dataclass
class StoreManifest:
    model_fingerprint: str
    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    system_prompt: str
    prefix_ids: list[int]
    prefix_key: str
    embedder: str
    embed_dim: int
    chunk_tokens: int
    overlap: int
    chunks_per_shard: int
    index_kind: str = "flat"
    layout_version: int = LAYOUT_VERSION
    status: str = "building"
    num_chunks: int = 0
    num_tokens: int = 0
    sources: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    # what must agree between a store and the engine reading it (and between runs of one build)
    KV_FIELDS = ("layout_version", "model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "prefix_ids")
    BUILD_FIELDS = KV_FIELDS + ("embedder", "chunk_tokens", "overlap", "chunks_per_shard", "system_prompt")

    def differences(self, other: "StoreManifest", fields: tuple[str, ...]) -> list[str]:
        return [f"{f}: store has {_short(getattr(self, f))}, expected {_short(getattr(other, f))}"
                for f in fields if getattr(self, f) != getattr(other, f)]


def _short(x) -> str:
    s = repr(x)
    return s if len(s) < 60 else s[:57] + "..."


def engine_manifest(engine, *, embedder: str, embed_dim: int, chunk_tokens: int, overlap: int,
                    chunks_per_shard: int, index_kind: str = "flat", system: str | None = None) -> StoreManifest:
    """The manifest a store built by ``engine`` (with this system prompt) must carry."""
    if engine.prompts is None:
        raise StoreError("The engine has no tokenizer; a corpus store needs one to tokenize chunks.")
    system = system or engine.prompts.system_prompt
    shape = engine.cache.pool.shape
    prefix_ids = engine.prompts.prefix_ids(system)
    return StoreManifest(
        model_fingerprint=engine.fingerprint, model_name=engine.model_name, dtype=str(shape.dtype).replace("torch.", ""),
        block_size=shape.block_size, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        system_prompt=system, prefix_ids=list(prefix_ids), prefix_key=engine.kv_identity(system).prefix_key,
        embedder=embedder, embed_dim=embed_dim, chunk_tokens=chunk_tokens, overlap=overlap,
        chunks_per_shard=chunks_per_shard, index_kind=index_kind,
    )


@dataclass
class ChunkRow:
    id: int
    key: str
    doc_id: str
    text: str
    num_tokens: int
    shard: str = ""
    checksum: str = ""
    kind: str = "chunk"
    start: int = 0
    meta: dict = field(default_factory=dict)


class CorpusStore(Tier):
    """A store folder, and a read-only KV tier for the cache manager (lookups by content key)."""

    name = "store"
    writable = False  # the cache never demotes into a store: its chunks are already here

    def __init__(self, path: str | Path, manifest: StoreManifest):
        self.path = Path(path)
        self.manifest = manifest
        self._local = threading.local()  # sqlite connections are per thread
        with self._db() as db:
            db.execute(_SCHEMA)
        self._keys = {k: i for k, i in self._db().execute("SELECT key, id FROM chunks")}
        self.bad: set[int] = set()  # chunk ids whose KV failed its checksum this session

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, engine=None) -> "CorpusStore":
        """Open a finished store; with ``engine``, refuse it unless its KV was made for that engine."""
        path = Path(path)
        if not (path / MANIFEST).is_file():
            raise StoreError(f"{path} is not a lazyrag store (no {MANIFEST}); build one with: lazyrag precache CORPUS --out {path}")
        manifest = read_manifest(path)
        if manifest.layout_version != LAYOUT_VERSION:
            raise StoreMismatch(f"{path} has store layout {manifest.layout_version}; this lazyrag reads layout {LAYOUT_VERSION}. "
                                "Rebuild it with lazyrag precache into a new --out folder.")
        if manifest.status != "complete":
            raise StoreError(f"{path} is an unfinished build (status {manifest.status!r}); rerun the same lazyrag precache command to finish it.")
        store = cls(path, manifest)
        if engine is not None:
            store.check_compatible(engine)
        return store

    @classmethod
    def create_or_resume(cls, path: str | Path, manifest: StoreManifest) -> "CorpusStore":
        """A store being built: a new folder, or an interrupted/finished build made with the same settings."""
        path = Path(path)
        if (path / MANIFEST).is_file():
            old = read_manifest(path)
            diff = old.differences(manifest, StoreManifest.BUILD_FIELDS)
            if diff:
                raise StoreMismatch(
                    f"{path} already holds a store built with other settings:\n  " + "\n  ".join(diff)
                    + "\nUse a new --out folder, or pass --overwrite to rebuild this one."
                )
            manifest.created, manifest.sources = old.created, old.sources
        elif path.exists() and any(path.iterdir()):
            raise StoreError(f"{path} exists and is not a lazyrag store; pick an empty or new --out folder.")
        (path / KV_DIR).mkdir(parents=True, exist_ok=True)
        manifest.status = "building"
        write_manifest(path, manifest)
        return cls(path, manifest)

    def check_compatible(self, engine) -> None:
        """Raise StoreMismatch unless this store's KV is what ``engine`` would compute for its chunks."""
        m = self.manifest
        if engine.prompts is not None and engine.prompts.system_prompt != m.system_prompt:
            raise StoreMismatch(
                f"The store at {self.path} was encoded after the system prompt {_short(m.system_prompt)} but the engine "
                f"uses {_short(engine.prompts.system_prompt)}; the prompt prefix is part of every chunk's KV. Create the "
                f"engine with system_prompt=store.manifest.system_prompt, or rebuild the store with lazyrag precache --system."
            )
        want = engine_manifest(engine, embedder=m.embedder, embed_dim=m.embed_dim, chunk_tokens=m.chunk_tokens,
                               overlap=m.overlap, chunks_per_shard=m.chunks_per_shard, system=m.system_prompt)
        diff = m.differences(want, StoreManifest.KV_FIELDS)
        if diff:
            raise StoreMismatch(
                f"The store at {self.path} holds KV made for model {m.model_name} ({m.model_fingerprint[:12]}, {m.dtype}, "
                f"block {m.block_size}), which this engine cannot use:\n  " + "\n  ".join(diff)
                + "\nLoad the model, dtype and block size it was built with, or rebuild it for this engine: "
                "lazyrag precache CORPUS --out NEW_FOLDER --model ... --dtype ..."
            )

    # -- the chunk table ----------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite3.connect(self.path / TABLE, timeout=60)
        return db

    def __len__(self) -> int:
        return self._db().execute("SELECT COUNT(*) FROM chunks WHERE kind = 'chunk'").fetchone()[0]

    def done_shards(self) -> set[str]:
        return {s for (s,) in self._db().execute("SELECT DISTINCT shard FROM chunks")}

    def keys_by_id(self) -> dict[int, str]:
        return {i: k for i, k in self._db().execute("SELECT id, key FROM chunks")}

    def rows(self, ids: list[int] | None = None) -> list[ChunkRow]:
        """Chunk rows by id (in the order asked; missing ids are skipped), or every chunk in id order."""
        cols = "id, key, doc_id, text, num_tokens, shard, checksum, kind, start, meta"
        if ids is None:
            cur = self._db().execute(f"SELECT {cols} FROM chunks WHERE kind = 'chunk' ORDER BY id")
        else:
            q = ",".join("?" * len(ids))
            cur = self._db().execute(f"SELECT {cols} FROM chunks WHERE id IN ({q})", [int(i) for i in ids])
        out = [ChunkRow(*r[:9], meta=json.loads(r[9])) for r in cur]
        if ids is not None:
            by_id = {r.id: r for r in out}
            out = [by_id[int(i)] for i in ids if int(i) in by_id]
        return out

    def embeddings(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, embeddings [N, dim] float32) of every chunk, in id order."""
        cur = self._db().execute("SELECT id, embedding FROM chunks WHERE kind = 'chunk' ORDER BY id")
        ids, vecs = [], []
        for i, blob in cur:
            ids.append(i)
            vecs.append(np.frombuffer(blob, dtype=np.float32))
        dim = self.manifest.embed_dim
        return np.asarray(ids, dtype=np.int64), (np.stack(vecs) if vecs else np.zeros((0, dim), np.float32))

    def add_shard(self, shard: str, rows: list[ChunkRow], kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  embeddings: np.ndarray | None) -> None:
        """Write one shard's KV file (atomically), then its rows in one transaction."""
        from safetensors.torch import save

        tensors = {}
        for r in rows:
            k, v = kv[r.key]
            r.shard, r.checksum, r.num_tokens = shard, kv_checksum(k, v), k.shape[1]
            tensors[f"{r.id}.k"], tensors[f"{r.id}.v"] = k.contiguous(), v.contiguous()
        atomic_write_bytes(self.path / KV_DIR / shard, save(tensors))
        with self._db() as db:  # one transaction: all rows of the shard or none
            db.executemany(
                "INSERT OR REPLACE INTO chunks VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                [(r.id, r.key, r.kind, r.doc_id, r.text, r.num_tokens, r.start, r.shard, r.checksum,
                  None if embeddings is None or r.kind != "chunk" else np.asarray(embeddings[j], np.float32).tobytes(),
                  json.dumps(r.meta)) for j, r in enumerate(rows)],
            )
        self._keys.update({r.key: r.id for r in rows})

    def finish(self, index_kind: str, sources: list[str]) -> None:
        """Build and write the FAISS index, then mark the store complete."""
        ids, vecs = self.embeddings()
        write_index(self.path / INDEX, build_index(vecs, ids, index_kind))
        m = self.manifest
        m.num_chunks = len(ids)
        m.num_tokens = self._db().execute("SELECT COALESCE(SUM(num_tokens), 0) FROM chunks WHERE kind = 'chunk'").fetchone()[0]
        m.index_kind, m.sources, m.status = index_kind, sorted(set(m.sources) | set(sources)), "complete"
        write_manifest(self.path, m)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    # -- the KV tier --------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def put(self, entry: TierEntry) -> list[TierEntry]:
        return [entry]  # read-only

    def get(self, key: str) -> TierEntry | None:
        """The chunk's KV, verified against its checksum; None (and logged) if it is missing or corrupt."""
        cid = self._keys.get(key)
        if cid is None or cid in self.bad:
            return None
        try:
            k, v, row = self.load_kv(cid)
        except Exception as e:
            self.bad.add(cid)
            log.warning("store %s: chunk %d is unreadable or corrupt (%s); recomputing it. "
                        "Run lazyrag precache with --verify to repair the store.", self.path, cid, e)
            return None
        return TierEntry(key, k, v, row.start, row.kind)

    def load_kv(self, chunk_id: int) -> tuple[torch.Tensor, torch.Tensor, ChunkRow]:
        """K, V of one chunk from its shard; raises CorruptKV if the bytes do not match the checksum."""
        from safetensors import safe_open

        from lazyrag.kv.tiers import CorruptKV

        rows = self.rows([chunk_id])
        if not rows:
            raise KeyError(f"chunk {chunk_id} is not in the store")
        row = rows[0]
        with safe_open(str(self.path / KV_DIR / row.shard), framework="pt") as f:
            k, v = f.get_tensor(f"{row.id}.k"), f.get_tensor(f"{row.id}.v")
        if kv_checksum(k, v) != row.checksum:
            raise CorruptKV(f"chunk {chunk_id} in {row.shard} does not match its sha256")
        return k, v, row

    def verify(self, repair: bool = False) -> list[int]:
        """Check every chunk's KV against its checksum; ids of the bad ones. ``repair`` drops their
        rows, so the next ``lazyrag precache`` run with the same arguments recomputes them."""
        bad = []
        for (cid,) in self._db().execute("SELECT id FROM chunks ORDER BY id").fetchall():
            try:
                self.load_kv(cid)
            except Exception:
                bad.append(cid)
        if bad and repair:
            shards = {s for (s,) in self._db().execute(
                f"SELECT shard FROM chunks WHERE id IN ({','.join('?' * len(bad))})", bad)}
            with self._db() as db:  # drop whole shards: builds resume shard by shard
                db.executemany("DELETE FROM chunks WHERE shard = ?", [(s,) for s in shards])
            self._keys = {k: i for k, i in self._db().execute("SELECT key, id FROM chunks")}
            self.manifest.status = "building"
            write_manifest(self.path, self.manifest)
        return bad


def read_manifest(path: Path) -> StoreManifest:
    data = json.loads((Path(path) / MANIFEST).read_text())
    known = set(StoreManifest.__dataclass_fields__)
    return StoreManifest(**{k: v for k, v in data.items() if k in known})


def write_manifest(path: Path, manifest: StoreManifest) -> None:
    atomic_write_bytes(Path(path) / MANIFEST, json.dumps(asdict(manifest), indent=1).encode())


def build_index(vecs: np.ndarray, ids: np.ndarray, kind: str = "flat"):
    """Inner product over normalised embeddings (cosine). flat: exact; ivf/hnsw: approximate, for large corpora."""
    import faiss

    dim = vecs.shape[1]
    if kind == "flat":
        base = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        base = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
    elif kind == "ivf":
        nlist = max(1, min(int(4 * np.sqrt(len(vecs))), len(vecs) // 39 or 1))  # FAISS wants ~39 points per list
        base = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        base.train(vecs)
        base.nprobe = max(1, nlist // 8)
    else:
        raise ValueError(f"Unknown index kind {kind!r}: choose flat, ivf or hnsw.")
    index = faiss.IndexIDMap2(base)
    if len(vecs):
        index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
    return index


def write_index(path: Path, index) -> None:
    import faiss

    atomic_write_bytes(path, faiss.serialize_index(index).tobytes())


def read_index(path: Path):
    import faiss

    return faiss.deserialize_index(np.fromfile(path, dtype=np.uint8))


def attach_store(engine, store: "CorpusStore | str | Path") -> CorpusStore:
    """Make ``store`` the engine's bottom KV tier: its chunks are loaded from disk on a miss, not recomputed."""
    if not isinstance(store, CorpusStore):
        store = CorpusStore.open(store)
    store.check_compatible(engine)
    engine.cache.add_tier(store)
    return store
