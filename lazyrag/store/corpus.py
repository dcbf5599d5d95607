"""A corpus store on disk: chunks, their embeddings and FAISS index, and their position-free KV.

Layout of a store folder (``LAYOUT_VERSION`` 3)::

    manifest.json        what the KV is valid for (model fingerprint, dtype, block size,
                         encoding prefix and system prompt), the embedder, the chunking
                         parameters, ``status`` ("building" until the first index is written),
                         and the published generation: ``num_chunks``, the index's sha256 and
                         the chunk table's ``table_id``
    chunks.sqlite        one row per chunk: id, content key, source document, text, token
                         count, start position, KV shard, row digest, embedding, metadata and
                         ``row_check`` (a sha256 over all of them); plus one row (id -1, kind
                         "prefix") for the shared encoding prefix; table ``store_meta`` holds
                         the table's ``table_id`` (a uuid drawn when the table is created)
    index.faiss          inner-product index over the normalised embeddings; FAISS ids = chunk ids
    index.faiss.next     there only while a ``precache`` publishes a new generation (see Generations)
    kv/shard-NNNNNN.safetensors
                         tensors "<id>.k" and "<id>.v": ``[layers, tokens, H_kv, D]``, UNPADDED (block
                         padding is a pool detail), encoded as the manifest's ``stored_kv_dtype``
                         says (kv/codec.py: 16 bits by default; int8 adds "<id>.k_scale", "<id>.v_scale";
                         float32 is the engine's KV exactly); read back in the engine's dtype
    .precache.lock       held by the ``precache`` run writing the store (one writer at a time)
    .precache.rebuilding there only while ``precache --overwrite`` deletes the store (see below)

A row's digest is a sha256 over the model fingerprint, the row's id, key, kind, start,
token count, document and text, the stored tensors' shapes and dtypes, and their bytes
(``row_digest``): KV is only ever served under the key, at the start position and for the
model it was computed for. A row's ``row_check`` covers every field (the digest included), so a
reader checks what it shows (text, doc_id, metadata) without reading KV; the manifest's
``index_sha256`` ties the index to the store, its ``table_id`` the chunk table: a reader checks the
table's id when it connects and again in every statement that reads rows, so a table copied from
another store is refused at ``open``, and a reader whose store was rebuilt (``--overwrite``) after it
opened it fails with what to do instead of pairing its index with the new table's rows. (A store
built before table ids is read unchecked, with a warning; any ``precache`` run on it adds one.)
Shard names are confined to ``kv/``, and ``kv/`` to the store.

Generations: a reader serves the chunks the manifest it read counts (ids below ``num_chunks``)
with the index whose sha256 it names. A ``precache`` extending a finished store adds rows and
shards (new files, never rewriting published ones), writes the new index as ``index.faiss.next``,
publishes the new generation by replacing the manifest, then renames ``index.faiss.next`` to
``index.faiss``. A reader opening meanwhile sees the old generation or the new one, never a mix: it
takes ``index.faiss``, or ``index.faiss.next`` when that is the one the manifest names. Killed at
any point (kill -9), the store opens as the old generation (the manifest still names the old index,
still in place) or as the new one (the manifest names the next index, still beside the old), and a
rerun of the same command finishes the extension (it first completes or drops a pending rename).

Serving reads and never writes: ``open`` (what ``attach_store``, the retriever and every ``lazyrag serve``
replica use) reads the chunk table through a read-only sqlite connection and takes no lock, so many
processes, on one host or many, serve one store from a read-only folder (a shared filesystem: NFS, or a
bucket mounted with s3fs / gcsfuse); one ``lazyrag precache`` writes it, beforehand or alongside.

Every file is written to a temp name and renamed; a shard's rows are inserted in one
sqlite transaction after its file is in place, so an interrupted build leaves only whole
shards behind and resumes from the first missing one.

``--overwrite`` (``clear_store``) deletes only what a store writes (the names above, the shard
names in ``kv/``, temp files of those), and only in a folder it can tell is a store (a manifest that
reads as ours; for a damaged one, our chunk table or KV shards) holding nothing else: a folder with
anyone else's file, or a manifest that is not ours, is refused and left as it is. It first writes
``.precache.rebuilding``, then deletes the data, then the manifest, then the marker. Killed at any
point, the folder holds the marker (readers refuse it, saying a rebuild was interrupted; the next
``precache`` run, with or without ``--overwrite``, finishes the deletion and builds) or nothing but
the lock (a new build).

The KV is what the engine's lazy strategy computes for the chunk (same prefix, same positions,
same dtype; another batch composition may differ in the last bits), then rounded to the stored
dtype: a store is refused by an
engine with another fingerprint, dtype, block size or prefix, and a chunk whose row does not
match its digest is never used (the engine recomputes it; ``verify(repair=True)`` drops it so
the next ``precache`` run rebuilds it). A damaged manifest, chunk table or index, or a shard
named outside the store, is refused at ``open`` with a StoreError that says how to rebuild.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, overload

import numpy as np
import torch

from lazyrag.extras import require
from lazyrag.kv import codec
from lazyrag.kv.formats import resolve_stored_dtype
from lazyrag.kv.identity import KVIdentity
from lazyrag.kv.tiers import ATOMIC_TEMP_FILE, KV_TENSORS, CorruptKV, Tier, TierEntry, atomic_write_bytes, kv_checksum

if TYPE_CHECKING:  # imported where used: the faiss extra is optional
    import faiss

log = logging.getLogger(__name__)

LAYOUT_VERSION = 3  # 3: rows also carry a check over every field, the manifest the index's sha256 (2: KV digests only)
MANIFEST, TABLE, INDEX, KV_DIR, LOCK = "manifest.json", "chunks.sqlite", "index.faiss", "kv", ".precache.lock"
REBUILDING = ".precache.rebuilding"  # an --overwrite is deleting the store (clear_store)
INDEX_NEXT = "index.faiss.next"  # the index of a generation being published (finish), until it is renamed to INDEX
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
    digest TEXT NOT NULL,
    embedding BLOB,
    meta TEXT NOT NULL,
    row_check TEXT NOT NULL DEFAULT ''
)
"""
_META_SCHEMA = "CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"
_TABLE_ID = "(SELECT value FROM store_meta WHERE name = 'table_id')"

_STORE_FILES = (
    MANIFEST,
    TABLE,
    INDEX,
    INDEX_NEXT,
    REBUILDING,
)  # what atomic_write_bytes writes (its temp files are ours too)
_TABLE_FILES = (TABLE, TABLE + "-journal", TABLE + "-wal", TABLE + "-shm")  # sqlite's own files beside the table
_OWN_FILES = (MANIFEST, INDEX, INDEX_NEXT, REBUILDING, LOCK, *_TABLE_FILES)  # every file a store writes outside kv/
# any of these in a manifest.json says it is lazyrag's (damaged or not); a JSON object with none is someone else's
_MANIFEST_KEYS = frozenset({"model_fingerprint", "layout_version", "embedder", "chunks_per_shard"})
_SHARD_FILE = re.compile(r"^(prefix|shard-\d{6}(-\d{6})?)\.safetensors$")


class StoreError(RuntimeError):
    """The store cannot be used as asked; the message says what to do."""


class StoreMismatch(StoreError):
    """The store was made for another model, dtype, block size, prefix or layout."""


class _AnotherGeneration(StoreError):
    """A file does not belong to the generation the manifest read publishes (damaged, replaced, or a writer is
    publishing a new one: ``open`` reads again, once)."""


class _IndexOfAnotherGeneration(_AnotherGeneration):
    """index.faiss does not match the manifest's checksum."""


class _TableOfAnotherGeneration(_AnotherGeneration):
    """chunks.sqlite does not carry the manifest's ``table_id`` (``found``: the one it carries)."""

    def __init__(self, message: str, found: str):
        super().__init__(message)
        self.found = found


class _NotAStoreManifest(StoreError):
    """manifest.json is a JSON object of someone else's (a web app's, say)."""


@dataclass
class StoreManifest(KVIdentity):
    """The store's KV identity (the engine's that built it) and how it was built."""

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
    index_sha256: str = ""  # of index.faiss, checked whenever it is read
    table_id: str = ""  # the id chunks.sqlite carries (its store_meta row); "" for stores built before table ids
    stored_kv_dtype: str = (
        "float32"  # how the shards keep KV (kv/codec.py; a manifest without it: float32, as computed)
    )
    sources: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    # what must agree between a store and the engine reading it (and between runs of one build)
    KV_FIELDS = (
        "layout_version",
        "model_fingerprint",
        "dtype",
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "prefix_ids",
        "passage_ids",
    )
    BUILD_FIELDS = KV_FIELDS + (
        "embedder",
        "chunk_tokens",
        "overlap",
        "chunks_per_shard",
        "system_prompt",
        "stored_kv_dtype",
    )

    def differences(self, other: "StoreManifest", fields: tuple[str, ...]) -> list[str]:
        return [
            f"{f}: store has {_short(getattr(self, f))}, expected {_short(getattr(other, f))}"
            for f in fields
            if getattr(self, f) != getattr(other, f)
        ]


def _short(x: object) -> str:
    s = repr(x)
    return s if len(s) < 60 else s[:57] + "..."


def engine_manifest(
    identity: KVIdentity,
    *,
    embedder: str,
    embed_dim: int,
    chunk_tokens: int,
    overlap: int,
    chunks_per_shard: int,
    index_kind: str = "flat",
    stored_kv_dtype: str = "auto",
) -> StoreManifest:
    """The manifest of a store whose KV an engine of this ``identity`` (``engine.kv_identity(system)``) computes,
    kept as ``stored_kv_dtype`` (kv/codec.py; ``auto`` resolved against the engine's dtype)."""
    kv = {f: getattr(identity, f) for f in KVIdentity.__dataclass_fields__}
    stored = resolve_stored_dtype(stored_kv_dtype, identity.dtype)
    return StoreManifest(
        **kv,
        embedder=embedder,
        embed_dim=embed_dim,
        chunk_tokens=chunk_tokens,
        overlap=overlap,
        chunks_per_shard=chunks_per_shard,
        index_kind=index_kind,
        stored_kv_dtype=stored,
    )


@dataclass
class ChunkRow:
    id: int
    key: str
    doc_id: str
    text: str
    num_tokens: int
    shard: str = ""
    digest: str = ""
    kind: str = "chunk"
    start: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


_COLUMNS = "id, key, doc_id, text, num_tokens, shard, digest, kind, start, meta"


def row_digest(model_fingerprint: str, row: ChunkRow, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 binding a chunk's stored KV (``tensors``: "k", "v" and int8's scales) to the model and to
    everything its row says about them.

    The KV alone is not enough: served under another key or at another start position,
    intact bytes give wrong logits, so those are hashed together with the bytes.
    """
    head = json.dumps(
        {
            "model": model_fingerprint,
            "id": row.id,
            "key": row.key,
            "kind": row.kind,
            "start": row.start,
            "num_tokens": row.num_tokens,
            "doc_id": row.doc_id,
            "text": row.text,
            **{n: [list(t.shape), str(t.dtype)] for n, t in tensors.items()},
        },
        sort_keys=True,
    )
    return hashlib.sha256(f"{head}\n{kv_checksum(tensors)}".encode()).hexdigest()


def row_check(row: ChunkRow, meta_json: str, embedding: bytes | None) -> str:
    """sha256 over every field of a stored row as it is in the table (the KV digest included): what a
    reader shows (text, doc_id, metadata, title) and what it uses (key, start, shard, embedding) is
    served only as it was stored. Cheap: no KV bytes are read."""
    head = json.dumps(
        {
            "id": row.id,
            "key": row.key,
            "kind": row.kind,
            "doc_id": row.doc_id,
            "text": row.text,
            "num_tokens": row.num_tokens,
            "start": row.start,
            "shard": row.shard,
            "digest": row.digest,
            "meta": meta_json,
            "embedding": None if embedding is None else hashlib.sha256(embedding).hexdigest(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(head.encode()).hexdigest()


def rebuild_command(path: Path, manifest: StoreManifest | None, flag: str) -> str:
    """The precache command line that repairs (``--verify``) or rebuilds (``--overwrite``) the store at ``path``."""
    sources = " ".join(manifest.sources) if manifest is not None and manifest.sources else "CORPUS"
    return f"lazyrag precache {sources} --out {path} {flag}"


class CorpusStore(Tier):
    """A store folder, and a read-only KV tier for the cache manager (lookups by content key)."""

    name = "store"
    writable = False  # the cache never demotes into a store: its chunks are already here

    def __init__(self, path: str | Path, manifest: StoreManifest, limit: int | None = None, read_only: bool = False):
        """``limit``: serve only chunk ids below it (``open`` passes the manifest's ``num_chunks``: rows a
        concurrent ``precache`` is adding belong to the next generation, which its next manifest publishes).
        ``read_only`` (``open``'s): the chunk table is opened read-only, nothing in the folder is written."""
        self.path = Path(path)
        self.manifest = manifest
        self.read_only = read_only
        self._limit = None if limit is None else int(limit)
        self._local = threading.local()  # sqlite connections are per thread
        self._index: faiss.Index | None = None
        if not read_only:
            with self._table_errors(), self._db() as db:
                db.execute(_SCHEMA)
                db.execute(_META_SCHEMA)
                # a new table (a new store, a rebuild, one deleted by hand) gets an id of its own, never the old
                # manifest's: a reader holding the old index then refuses it. A writer publishes the table it
                # writes (``finish`` indexes its rows), so it adopts an existing table's id.
                db.execute("INSERT OR IGNORE INTO store_meta VALUES ('table_id', ?)", (uuid.uuid4().hex,))
                manifest.table_id = db.execute(f"SELECT {_TABLE_ID}").fetchone()[0]
        self._keys = dict(self._sql(f"SELECT key, id FROM chunks WHERE 1{self._visible()}"))
        self.bad: set[int] = set()  # chunk ids whose KV failed its digest this session

    def _visible(self) -> str:
        return "" if self._limit is None else f" AND id < {self._limit}"

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path) -> "CorpusStore":
        """Open a finished store (``check_compatible`` then says whether an engine can use its KV).

        Damaged files (manifest, chunk table, index, missing shards) and shard names that
        point outside the store raise StoreError here, not at the first request.
        """
        path = Path(path)
        deadline = time.monotonic() + 60
        while True:
            manifest = cls._published_manifest(path)
            try:
                store = cls(
                    path, manifest, limit=manifest.num_chunks, read_only=True
                )  # rows a writer adds now are not served
                store.check_files()
                break
            except _AnotherGeneration as e:
                # the manifest and index.faiss (or chunks.sqlite) of two generations: a precache publishing a new
                # one writes the index, then the manifest. Read both again once it has; a damaged or replaced file
                # stays refused.
                if time.monotonic() > deadline or cls._still_published(path, manifest):
                    if isinstance(e, _TableOfAnotherGeneration):  # at open: not a rebuild since, a replaced table
                        raise StoreError(
                            f"{path}: {TABLE} is not the chunk table {MANIFEST} published (its table id is {e.found}, "
                            f"the manifest names {manifest.table_id}): it was replaced, e.g. copied from another "
                            "store, so the store is refused. Repair it with "
                            f"`{rebuild_command(path, manifest, '--verify')}` (it checks every row against the store's "
                            "KV, rebuilds what does not match and rewrites the index), or rebuild it with --overwrite "
                            "or into a new --out folder."
                        ) from None
                    raise
                time.sleep(0.02)
        if not manifest.table_id:
            log.warning(
                "%s was built before chunk tables carried an id, so a %s replaced by another store's would not be "
                "noticed; `%s` adds one (it encodes no chunk again)",
                path,
                TABLE,
                rebuild_command(path, manifest, "--verify"),
            )
        return store

    @staticmethod
    def _still_published(path: Path, manifest: StoreManifest) -> bool:
        """Whether ``manifest`` is still the store's, with no writer at work: a mismatch found now is damage."""
        try:
            return read_manifest(path) == manifest and not build_in_progress(path) and not (path / REBUILDING).exists()
        except StoreError:
            return False

    @classmethod
    def _published_manifest(cls, path: Path) -> StoreManifest:
        if (path / REBUILDING).exists():
            if build_in_progress(path):
                raise StoreError(
                    f"{path} is being rebuilt right now by lazyrag precache --overwrite; open it once that finishes."
                )
            raise StoreError(
                f"{path} is half deleted: a lazyrag precache --overwrite was interrupted. Rerun that command "
                "(or the same command without --overwrite: either finishes the rebuild), then open it."
            )
        if not (path / MANIFEST).is_file():
            raise StoreError(
                f"{path} is not a lazyrag store (no {MANIFEST}); build one with: lazyrag precache CORPUS --out {path}"
            )
        manifest = read_manifest(path)
        if manifest.layout_version != LAYOUT_VERSION:
            raise StoreMismatch(
                f"{path} has store layout {manifest.layout_version}; this lazyrag reads layout {LAYOUT_VERSION}. "
                f"Rebuild it with `{rebuild_command(path, manifest, '--overwrite')}` or into a new --out folder."
            )
        if manifest.status != "complete":
            if build_in_progress(path):
                raise StoreError(f"{path} is being built right now by another lazyrag precache; wait for it to finish.")
            raise StoreError(
                f"{path} is an unfinished build (status {manifest.status!r}); rerun the same lazyrag precache command "
                "to finish it."
            )
        if not (path / TABLE).is_file():
            raise StoreError(
                f"{path} has no chunk table ({TABLE}); rebuild the store with "
                f"`{rebuild_command(path, manifest, '--overwrite')}` or into a new --out folder."
            )
        return manifest

    @classmethod
    def create_or_resume(cls, path: str | Path, manifest: StoreManifest) -> "CorpusStore":
        """A store being built: a new folder, or an interrupted/finished build made with the same settings.

        Call it holding ``writer_lock(path)``: two builds of one store would both do the full work."""
        path = Path(path)
        publish = True
        if (path / REBUILDING).exists():  # precache clears such a folder first; never resume a half-deleted store
            raise StoreError(
                f"{path} is half deleted by an interrupted lazyrag precache --overwrite; rerun lazyrag precache "
                "(with or without --overwrite): it finishes the rebuild."
            )
        if (path / MANIFEST).is_file():
            old = read_manifest(path)
            diff = old.differences(manifest, StoreManifest.BUILD_FIELDS)
            if diff:
                raise StoreMismatch(
                    f"{path} already holds a store built with other settings:\n  "
                    + "\n  ".join(diff)
                    + "\nUse a new --out folder, or pass --overwrite to rebuild this one."
                )
            manifest.created, manifest.sources = old.created, old.sources
            # a finished store stays readable while this run extends it: its manifest (the generation readers
            # serve) is replaced only by ``finish``, after the new rows and index are in place
            publish = old.status != "complete"
            settle_pending_index(path, old)
        else:
            check_new_store_folder(path)
        remove_stale_temp_files(path)
        if (path / KV_DIR).is_symlink():
            raise StoreError(
                f"{path}/{KV_DIR} is a link; a store keeps its KV shards in a folder of its own. "
                "Remove the link, or build into a new --out folder."
            )
        try:
            (path / KV_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(_write_failed(path / KV_DIR, e)) from e
        manifest.status = "building"
        if publish:
            write_manifest(path, manifest)
        return cls(path, manifest)

    def check_files(self) -> None:
        """Raise StoreError unless the chunk table reads, every shard lies in ``kv/`` and exists, and the index
        matches."""
        with self._table_errors():
            problems = [p for (p,) in self._db().execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            self._table_damaged(problems[0])
        for (shard,) in self._sql(f"SELECT DISTINCT shard FROM chunks WHERE 1{self._visible()}"):
            if not self.shard_path(shard).is_file():
                raise StoreError(
                    f"{self.path}: the KV shard {KV_DIR}/{shard} is missing; rebuild its chunks with "
                    f"`{rebuild_command(self.path, self.manifest, '--verify')}`."
                )
        n, dim = len(self), self.manifest.embed_dim
        if (self.index.ntotal, self.index.d) != (n, dim):
            self._index = None
            self._index_damaged(
                f"it holds {self.index.ntotal} vectors of dimension {self.index.d}, "
                f"the store {n} chunks embedded in dimension {dim}"
            )

    def check_compatible(self, identity: KVIdentity) -> None:
        """Raise StoreMismatch unless this store's KV is what an engine of this ``identity``
        (``engine.kv_identity()``) would compute for its chunks."""
        m = self.manifest
        if identity.system_prompt != m.system_prompt:
            raise StoreMismatch(
                f"The store at {self.path} was encoded after the system prompt {_short(m.system_prompt)} but the "
                f"engine uses {_short(identity.system_prompt)}; the prompt prefix is part of every chunk's KV. Create "
                "the engine with system_prompt=store.manifest.system_prompt, or rebuild the store with lazyrag "
                "precache --system."
            )
        if identity.passage_ids != m.passage_ids:
            built = (
                f"after an encoding passage of {len(m.passage_ids)} tokens"
                if m.passage_ids
                else "without an encoding passage"
            )
            uses = f"one of {len(identity.passage_ids)} tokens" if identity.passage_ids else "none"
            if not m.passage_ids:
                how = "encoding_passage=None, or `--encoding-passage none`"
            elif m.encoding_passage:
                how = "encoding_passage=store.manifest.encoding_passage; `lazyrag ask/serve --store` take it themselves"
            else:  # built by a version that kept only the passage's ids
                how = "the store does not keep the passage's text: rebuild it"
            raise StoreMismatch(
                f"The store at {self.path} was encoded {built}, but the engine uses {uses}; the passage is part of "
                f"every chunk's KV. Create the engine with the store's passage ({how}), or rebuild the store with this "
                f"engine: {rebuild_command(self.path, m, '--overwrite')}"
            )
        want = engine_manifest(
            identity,
            embedder=m.embedder,
            embed_dim=m.embed_dim,
            chunk_tokens=m.chunk_tokens,
            overlap=m.overlap,
            chunks_per_shard=m.chunks_per_shard,
        )
        diff = m.differences(want, StoreManifest.KV_FIELDS)
        if diff:
            raise StoreMismatch(
                f"The store at {self.path} holds KV made for model {m.model_name} ({m.model_fingerprint[:12]}, "
                f"{m.dtype}, block {m.block_size}), which this engine cannot use:\n  "
                + "\n  ".join(diff)
                + "\nLoad the model, dtype and block size it was built with, or rebuild it for this engine: "
                "lazyrag precache CORPUS --out NEW_FOLDER --model ... --dtype ..."
            )

    # -- files inside the store ---------------------------------------------------------------

    def shard_path(self, shard: str) -> Path:
        """The file of a KV shard named in the chunk table; StoreError if the name leads out of ``kv/``."""
        folder = self._kv_folder()
        path = (folder / shard).resolve()
        if not shard or path.parent != folder:
            raise StoreError(
                f"{self.path}: the chunk table names the KV shard {shard!r}, which is not a file in {folder}; "
                f"the table was damaged or tampered with, so the store is refused. Repair it with "
                f"`{rebuild_command(self.path, self.manifest, '--verify')}` or build into a new --out folder."
            )
        return path

    def _kv_folder(self) -> Path:
        """``kv/``, resolved; StoreError if it is a link leading out of the store (shards are confined to the store)."""
        folder = (self.path / KV_DIR).resolve()
        if folder != self.path.resolve() / KV_DIR:
            raise StoreError(
                f"{self.path}: {KV_DIR}/ leads to {folder}, outside the store, so the store is refused "
                f"(its KV shards must be files of its own {KV_DIR} folder). Move them back into it, or rebuild "
                f"with `{rebuild_command(self.path, self.manifest, '--overwrite')}` or into a new --out folder."
            )
        return folder

    @property
    def index(self) -> faiss.Index:
        """The FAISS index (ids = chunk ids), read once and checked against the manifest's sha256 (a
        full hash of the bytes just read: 0.7x to 2.4x of faiss's own deserialization, benchmarks/index_hash.py);
        StoreError if the file is damaged or is not the index the manifest published."""
        if self._index is None:
            try:
                data = np.fromfile(self.path / INDEX, dtype=np.uint8)
            except OSError as e:
                data, missing = None, e
            # numpy's stubs give ndarray its buffer protocol (__buffer__) only for Python 3.12+
            if data is None or hashlib.sha256(data).hexdigest() != self.manifest.index_sha256:  # type: ignore[arg-type]
                # a precache publishing a new generation: its index waits beside the old one until the manifest names it
                pending = _read_pending_index(self.path, self.manifest.index_sha256)
                if pending is not None:
                    data = pending
                elif data is None:
                    self._index_damaged(f"{type(missing).__name__}: {missing}")
                else:
                    self._index_damaged(
                        "its sha256 is not the one the manifest recorded: it was changed or replaced",
                        _IndexOfAnotherGeneration,
                    )
            try:
                self._index = deserialize_index(data)
            except (RuntimeError, ValueError) as e:  # faiss reports a damaged file as RuntimeError
                self._index_damaged(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return self._index

    def _index_damaged(self, why: str, error: type[StoreError] = StoreError) -> NoReturn:
        raise error(
            f"{self.path}: the FAISS index {INDEX} is missing or damaged ({why}). Rerun "
            f"`{rebuild_command(self.path, self.manifest, '--verify')}`: it checks the stored KV and rewrites the "
            "index."
        )

    # -- the chunk table ----------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
        return db

    def _connect(self) -> sqlite3.Connection:
        table = self.path / TABLE
        if not self.read_only:
            return sqlite3.connect(table, timeout=60)
        if not table.is_file():  # ``open`` saw it: deleted since (a rebuild), not damaged
            raise self._other_table("none: the file is gone")
        db = sqlite3.connect(table.resolve().as_uri() + "?mode=ro", uri=True, timeout=60)
        if table.with_name(TABLE + "-journal").exists():
            # a killed writer's journal: only a writable connection rolls it back (a read-only one cannot read
            # past it); on a folder this process may write, let sqlite do that, as before
            try:
                db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            except sqlite3.OperationalError:
                db.close()
                db = sqlite3.connect(table, timeout=60)
        if self.manifest.table_id:  # each thread's connection may reach a file other than the one ``open`` checked
            try:
                found = db.execute(f"SELECT {_TABLE_ID}").fetchone()[0]
            except sqlite3.OperationalError as e:
                if "no such table" not in str(e):
                    raise
                found = None
            if found != self.manifest.table_id:
                db.close()
                raise self._other_table(found or "none")
        return db

    def _other_table(self, found: str) -> _TableOfAnotherGeneration:
        return _TableOfAnotherGeneration(
            f"{self.path}: {TABLE} is not the chunk table of the store this process opened (its table id is {found}, "
            f"the manifest read at open names {self.manifest.table_id}), so none of its rows is served with the index "
            f"read then. If the store was rebuilt (lazyrag precache --overwrite) since, open it again (restart "
            f"`lazyrag serve`); otherwise the table was replaced: repair the store with "
            f"`{rebuild_command(self.path, self.manifest, '--verify')}`.",
            found,
        )

    @contextmanager
    def _table_errors(self) -> Iterator[None]:
        """sqlite's errors on a damaged table file, as a StoreError that says how to rebuild."""
        try:
            yield
        except sqlite3.OperationalError as e:
            if "full" in str(e) or "disk I/O" in str(e) or "readonly" in str(e):  # the disk, not the table
                raise StoreError(_write_failed(self.path / TABLE, e)) from e
            self._table_damaged(f"{type(e).__name__}: {e}", e)
        except sqlite3.DatabaseError as e:
            self._table_damaged(f"{type(e).__name__}: {e}", e)

    def _table_damaged(self, why: str, cause: Exception | None = None) -> NoReturn:
        raise StoreError(
            f"{self.path}: the chunk table {TABLE} is damaged ({why}). Rebuild the store with "
            f"`{rebuild_command(self.path, self.manifest, '--overwrite')}` or into a new --out folder."
        ) from cause

    def _sql(self, query: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        with self._table_errors():
            return self._db().execute(query, params).fetchall()

    def __len__(self) -> int:
        count: int = self._sql(f"SELECT COUNT(*) FROM chunks WHERE kind = 'chunk'{self._visible()}")[0][0]
        return count

    def done_shards(self) -> set[str]:
        return {s for (s,) in self._sql(f"SELECT DISTINCT shard FROM chunks WHERE 1{self._visible()}")}

    def keys_by_id(self) -> dict[int, str]:
        return dict(self._sql(f"SELECT id, key FROM chunks WHERE 1{self._visible()}"))

    def rows(self, ids: list[int] | None = None) -> list[ChunkRow]:
        """Chunk rows by id (in the order asked; missing ids are skipped), or every chunk in id order.
        StoreError (with what to do) if a row does not match its check: it is never served changed."""
        out, bad = self._read_rows(ids)
        if bad:
            raise StoreError(self._changed_rows(bad))
        return out

    @overload
    def _read_rows(
        self, ids: list[int] | None, with_embeddings: Literal[False] = False
    ) -> tuple[list[ChunkRow], list[int]]: ...

    @overload
    def _read_rows(
        self, ids: list[int] | None, with_embeddings: Literal[True]
    ) -> tuple[list[tuple[ChunkRow, bytes]], list[int]]: ...

    def _read_rows(self, ids: list[int] | None, with_embeddings: bool = False) -> tuple[list[Any], list[int]]:
        """The rows (or ``(row, embedding)`` pairs), and the ids of those that fail their ``row_check``."""
        # the table's id read in the same statement as the rows (under one sqlite read lock, so both come from one
        # file): a connection made before the table was replaced is checked on every read, not only when it connected
        table_id = self.manifest.table_id
        columns = f"SELECT {_COLUMNS}, embedding, row_check{', ' + _TABLE_ID if table_id else ''} FROM chunks"
        if ids is None:
            found = self._sql(f"{columns} WHERE kind = 'chunk'{self._visible()} ORDER BY id")
        else:
            found = self._sql(
                f"{columns} WHERE id IN ({','.join('?' * len(ids))}){self._visible()}", [int(i) for i in ids]
            )
        if table_id and found and found[0][12] != table_id:
            raise self._other_table(found[0][12] or "none")
        out: list[ChunkRow | tuple[ChunkRow, Any]] = []
        bad: list[int] = []
        for r in found:
            try:
                id_, key, doc_id, text, num_tokens, shard, digest, kind, start, meta = r[:10]  # _COLUMNS
                row = ChunkRow(id_, key, doc_id, text, num_tokens, shard, digest, kind, start, meta=json.loads(meta))
                ok = row_check(row, r[9], r[10]) == r[11]
            except (TypeError, ValueError) as e:
                self._table_damaged(f"a row's metadata is not JSON: {e}", e)
            if not ok:
                bad.append(row.id)
            out.append((row, r[10]) if with_embeddings else row)
        if ids is not None:
            by_id = {(r[0] if isinstance(r, tuple) else r).id: r for r in out}  # a tuple: with_embeddings
            out = [by_id[int(i)] for i in ids if int(i) in by_id]
        return out, bad

    def chunk_texts(self) -> list[str]:
        """The text of every chunk whose row checks out (the others are logged: their KV is recomputed, never
        served, until ``precache --verify`` rebuilds them), for an engine to find them in free-form prompts."""
        rows, bad = self._read_rows(None)
        if bad:
            log.warning("%s", self._changed_rows(bad))
        skip = set(bad)
        return [r.text for r in rows if r.text and r.id not in skip]

    def _changed_rows(self, bad: list[int]) -> str:
        return (
            f"{self.path}: chunk(s) {', '.join(map(str, bad[:10]))}{' ...' if len(bad) > 10 else ''} of {TABLE} do not "
            "match their row digest (text, doc_id, metadata, key, start, shard or embedding changed after they were "
            "stored), so they are not served. Repair the store with "
            f"`{rebuild_command(self.path, self.manifest, '--verify')}`."
        )

    def embeddings(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, embeddings [N, dim] float32) of every chunk, in id order."""
        ids, vecs = [], []
        found, bad = self._read_rows(None, with_embeddings=True)
        if bad:
            raise StoreError(self._changed_rows(bad))
        for row, blob in found:
            ids.append(row.id)
            vecs.append(np.frombuffer(blob, dtype=np.float32))
        dim = self.manifest.embed_dim
        return np.asarray(ids, dtype=np.int64), (np.stack(vecs) if vecs else np.zeros((0, dim), np.float32))

    def add_shard(
        self,
        shard: str,
        rows: list[ChunkRow],
        kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
        embeddings: np.ndarray | None,
    ) -> None:
        """Write one shard's KV file (atomically), then its rows in one transaction."""
        from safetensors.torch import save

        tensors = {}
        for r in rows:
            k, v = kv[r.key]
            stored = codec.encode(k, v, self.manifest.stored_kv_dtype)
            r.shard, r.num_tokens = shard, k.shape[1]
            r.digest = row_digest(self.manifest.model_fingerprint, r, stored)
            tensors.update({f"{r.id}.{n}": t for n, t in stored.items()})
        _write(self.shard_path(shard), save(tensors))
        values = []
        for j, r in enumerate(rows):
            blob = None if embeddings is None or r.kind != "chunk" else np.asarray(embeddings[j], np.float32).tobytes()
            meta = json.dumps(r.meta)
            values.append(
                (
                    r.id,
                    r.key,
                    r.kind,
                    r.doc_id,
                    r.text,
                    r.num_tokens,
                    r.start,
                    r.shard,
                    r.digest,
                    blob,
                    meta,
                    row_check(r, meta, blob),
                )
            )
        with self._table_errors(), self._db() as db:  # one transaction: all rows of the shard or none
            db.executemany("INSERT OR REPLACE INTO chunks VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", values)
        self._keys.update({r.key: r.id for r in rows})

    def finish(self, index_kind: str, sources: list[str]) -> None:
        """Build the FAISS index and publish the new generation (its rows, its index's sha256): the index
        written as ``index.faiss.next`` beside the published one, then the manifest naming it, then the rename
        to ``index.faiss``. Killed anywhere, readers open the old generation or the new one whole."""
        ids, vecs = self.embeddings()
        self._index = build_index(vecs, ids, index_kind)
        m = self.manifest
        m.index_sha256 = write_index(self.path / INDEX_NEXT, self._index)
        m.num_chunks = len(ids)
        m.num_tokens = self._sql("SELECT COALESCE(SUM(num_tokens), 0) FROM chunks WHERE kind = 'chunk'")[0][0]
        m.index_kind, m.sources, m.status = index_kind, sorted(set(m.sources) | set(sources)), "complete"
        write_manifest(self.path, m)
        _publish_index(self.path / INDEX_NEXT, self.path / INDEX)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    # -- the KV tier --------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def put(self, entry: TierEntry) -> list[TierEntry]:
        return [entry]  # read-only

    def get(self, key: str) -> TierEntry | None:
        """The chunk's KV, verified against its row digest; None (and logged) if it is missing or corrupt."""
        cid = self._keys.get(key)
        if cid is None or cid in self.bad:
            return None
        try:
            stored, row = self.load_kv(cid)
            if row.key != key:  # the row was changed since the store was opened
                raise CorruptKV(f"chunk {cid} is now stored under another key")
        except Exception as e:
            self.bad.add(cid)
            log.warning(
                "store %s: chunk %d is unreadable or corrupt (%s); recomputing it. Repair the store with: %s",
                self.path,
                cid,
                e,
                rebuild_command(self.path, self.manifest, "--verify"),
            )
            return None
        return TierEntry(key, stored, row.start, row.kind)

    def load_kv(self, chunk_id: int) -> tuple[dict[str, torch.Tensor], ChunkRow]:
        """One chunk's stored KV tensors ("k", "v", int8's scales: ``TierEntry.decode`` or kv/codec.py widens them)
        and its row; raises CorruptKV if they or their row do not match the row's digest."""
        from safetensors import safe_open

        rows, bad = self._read_rows([chunk_id])
        if not rows:
            raise KeyError(f"chunk {chunk_id} is not in the store")
        row = rows[0]
        shard = self.shard_path(row.shard)  # StoreError for a shard outside the store, before anything is read
        if bad:
            raise CorruptKV(
                f"chunk {chunk_id}'s row does not match its row digest (a field of it changed after it was stored)"
            )
        with safe_open(str(shard), framework="pt") as f:
            names = set(f.keys())
            stored = {n: f.get_tensor(f"{row.id}.{n}") for n in KV_TENSORS if f"{row.id}.{n}" in names}
        if "k" not in stored or "v" not in stored:
            raise CorruptKV(f"chunk {chunk_id}'s K/V are not in {row.shard}")
        if row_digest(self.manifest.model_fingerprint, row, stored) != row.digest:
            raise CorruptKV(
                f"chunk {chunk_id} in {row.shard} does not match its row digest "
                "(its KV, key, start, token count or text changed after it was stored)"
            )
        return stored, row

    def verify(self, repair: bool = False) -> list[int]:
        """Check every chunk's KV and row against its digest; ids of the bad ones. ``repair`` drops their
        rows, so the next ``lazyrag precache`` run with the same arguments recomputes them."""
        self._kv_folder()  # a kv/ leading outside the store fails the whole store, not each of its rows
        bad = []
        for (cid,) in self._sql(f"SELECT id FROM chunks WHERE 1{self._visible()} ORDER BY id"):
            try:
                self.load_kv(cid)
            except Exception as e:
                log.info("store %s: chunk %d is bad: %s", self.path, cid, e)
                bad.append(cid)
        if bad and repair:
            if self.read_only:  # opened for serving (``open``): repairing writes, so take writable connections now
                self.read_only, self._local = False, threading.local()
            shards = {
                s for (s,) in self._sql(f"SELECT shard FROM chunks WHERE id IN ({','.join('?' * len(bad))})", bad)
            }
            with self._table_errors(), self._db() as db:  # drop whole shards: builds resume shard by shard
                db.executemany("DELETE FROM chunks WHERE shard = ?", [(s,) for s in shards])
            self._keys = dict(self._sql("SELECT key, id FROM chunks"))
            self.manifest.status = "building"
            write_manifest(self.path, self.manifest)
        return bad


def read_manifest(path: Path) -> StoreManifest:
    """The store's manifest; StoreError (with what to do) if it is not a readable manifest, _NotAStoreManifest
    if it is someone else's."""
    try:
        data = json.loads((Path(path) / MANIFEST).read_text())
        if isinstance(data, dict) and not _MANIFEST_KEYS & data.keys():
            raise _NotAStoreManifest(
                f"{path} is not a lazyrag store: its {MANIFEST} is not a lazyrag manifest (it has none of its fields), "
                f"so lazyrag leaves the folder alone, --overwrite included. Build a store into an empty or new folder: "
                f"lazyrag precache CORPUS --out NEW_FOLDER"
            )
        if isinstance(data, dict):  # a store built before encoding passages: its chunks follow the prefix alone
            data.setdefault("passage_ids", [])
            data.setdefault("encoding_passage", "")  # before the text was kept too: only passage_ids tell
        known = set(StoreManifest.__dataclass_fields__)
        return _typed(StoreManifest(**{k: v for k, v in data.items() if k in known}))
    except (OSError, ValueError, TypeError, AttributeError) as e:  # unreadable, not JSON, not an object, fields missing
        # --overwrite is safe to name: it deletes only a store's own files, in a folder that shows it is a store
        raise StoreError(
            f"{path}: {MANIFEST} is damaged ({type(e).__name__}: {e}), so the store cannot be used. "
            f"Rebuild it with `{rebuild_command(Path(path), None, '--overwrite')}` or into a new --out folder."
        ) from e


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "str": str,
    "float": (int, float),
    "list[int]": list,
    "list[str]": list,
}


def _typed(manifest: StoreManifest) -> StoreManifest:
    """``manifest`` if every field holds its declared type (an edited ``"embed_dim": "384"`` would otherwise read as
    an index mismatch, far from its cause); a TypeError naming the field otherwise."""
    for name, f in StoreManifest.__dataclass_fields__.items():
        want, value = _FIELD_TYPES.get(str(f.type)), getattr(manifest, name)
        if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
            raise TypeError(f"its field {name} is {value!r} ({type(value).__name__}), not {f.type}")
    return manifest


def write_manifest(path: Path, manifest: StoreManifest) -> None:
    _write(Path(path) / MANIFEST, json.dumps(asdict(manifest), indent=1).encode())


def _write(path: Path, data: bytes) -> None:
    """atomic_write_bytes, with a full disk (or any other failed write) as a StoreError that says what to do."""
    try:
        atomic_write_bytes(path, data)
    except OSError as e:
        raise StoreError(_write_failed(path, e)) from e


def _write_failed(path: Path, e: Exception) -> str:
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "full" in str(e)
    why = "the disk is full" if full else (getattr(e, "strerror", None) or str(e))
    return (
        f"cannot write {path}: {why}. {'Free some space' if full else 'Fix that'} (or pick another --out), then rerun "
        "the same lazyrag precache command: it resumes from the last whole shard."
    )


# -- one writer at a time -------------------------------------------------------------------


def check_new_store_folder(path: Path, overwrite: bool = False) -> None:
    """Refuse to build into a folder that is not a store's (a manifest of someone else's; without a manifest,
    other things than what a build killed before its first manifest write leaves: the lock file, an empty
    ``kv/``, our temp files) or, to rebuild (``overwrite``, or an interrupted one), a folder that
    ``check_overwritable`` refuses. Called before the lock file goes into the folder."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise StoreError(f"{path} is a file, not a folder; pick an empty or new --out folder.")
    if overwrite or (path / REBUILDING).is_file():
        check_overwritable(path)
    elif (path / MANIFEST).is_file():
        read_manifest(path)  # someone else's or damaged: refused, saying what to do
    elif not half_built_store(path):
        if not _foreign_entries(path) and _looks_like_a_store(path):
            raise StoreError(
                f"{path} holds a store's files but no {MANIFEST}: a rebuild (--overwrite) was interrupted. "
                "Rerun the command with --overwrite to finish it (it deletes only the store's own files), "
                "or pick a new --out folder."
            )
        raise StoreError(f"{path} exists and is not a lazyrag store; pick an empty or new --out folder.")


def check_overwritable(path: Path) -> None:
    """Raise StoreError unless ``--overwrite`` may delete ``path``'s contents: every entry is one a store
    writes, and the folder shows it is a store (a manifest that reads as ours, or, damaged or gone, our
    rebuild marker, chunk table or KV shards; or only what a build killed before its first manifest leaves)."""
    path = Path(path)
    ours = False
    if (path / MANIFEST).is_file():
        try:
            read_manifest(path)
            ours = True
        except _NotAStoreManifest:
            raise
        except StoreError:
            pass  # damaged: the rest of the folder has to show it is a store
    foreign = _foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        if (path / MANIFEST).is_file():
            raise StoreError(
                f"{path} holds {shown} besides a store's files. --overwrite deletes only a store's own files "
                f"and never anything else, so it leaves this folder as it is: move those out of {path}, or "
                "pick an empty or new --out folder."
            )
        raise StoreError(
            f"{path} exists and is not a lazyrag store: it holds {shown}, which a store does not write. "
            "--overwrite deletes only a store's own files, so it leaves this folder as it is: pick an empty "
            "or new --out folder."
        )
    if not (ours or half_built_store(path) or _looks_like_a_store(path)):
        raise StoreError(
            f"{path}: nothing in it shows it is a lazyrag store ({MANIFEST} is damaged or missing, and "
            f"there is no chunk table or KV shard), so --overwrite deletes nothing. Pick an empty or new "
            "--out folder."
        )


def _foreign_entries(path: Path) -> list[str]:
    """What in a store folder no store writer made (links included: a writer makes none)."""
    out = []
    for p in sorted(path.iterdir()):
        if p.name == KV_DIR and p.is_dir() and not p.is_symlink():
            out += [
                f"{KV_DIR}/{q.name}"
                for q in sorted(p.iterdir())
                if not (_our_temp_file(q, True) or (q.is_file() and not q.is_symlink() and _SHARD_FILE.match(q.name)))
            ]
        elif not (_our_temp_file(p, False) or (p.is_file() and not p.is_symlink() and p.name in _OWN_FILES)):
            out.append(p.name + ("/" if p.is_dir() else ""))
    return out


def _looks_like_a_store(path: Path) -> bool:
    """Whether a folder whose manifest is damaged or gone is a store's: our rebuild marker, KV shards, or our chunk
    table."""
    kv = path / KV_DIR
    if (path / REBUILDING).is_file() or (kv.is_dir() and any(_SHARD_FILE.match(q.name) for q in kv.iterdir())):
        return True
    table = path / TABLE
    if not table.is_file():
        return False
    try:
        db = sqlite3.connect(table.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            found = db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'chunks'").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return False
    return found is not None and "row_check" in found[0]


def _our_temp_file(p: Path, in_kv: bool) -> bool:
    """Whether ``p`` is a temp file of one of a store writer's atomic writes."""
    m = ATOMIC_TEMP_FILE.match(p.name)
    if m is None or p.is_symlink() or not p.is_file():
        return False
    return bool(_SHARD_FILE.match(m["name"])) if in_kv else m["name"] in _STORE_FILES


def half_built_store(path: Path) -> bool:
    """Whether a folder without a manifest holds only what a ``precache`` killed before its first
    manifest write leaves: its lock file, our temp files and a ``kv/`` folder with nothing else in it."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return False
    for p in path.iterdir():
        if p.name == LOCK and p.is_file() and not p.is_symlink():
            continue
        if p.name == KV_DIR and p.is_dir() and not p.is_symlink() and all(_our_temp_file(q, True) for q in p.iterdir()):
            continue
        if not _our_temp_file(p, False):
            return False
    return True


def remove_stale_temp_files(path: Path) -> list[Path]:
    """Delete the temp files killed writes left (call it holding the writer lock: a live writer's are its own)."""
    path = Path(path)
    found = [p for p in path.iterdir() if _our_temp_file(p, False)] if path.is_dir() else []
    kv = path / KV_DIR
    if kv.is_dir() and not kv.is_symlink():
        found += [p for p in kv.iterdir() if _our_temp_file(p, True)]
    for p in found:
        p.unlink(missing_ok=True)
    if found:
        log.info("%s: removed %d temp file(s) of interrupted writes", path, len(found))
    return found


@contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Hold the store's build lock (a file lock in the folder, so other processes see it too).

    A second writer waits, saying so, and then finds the first one's shards done."""
    from filelock import FileLock, Timeout

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path / LOCK)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning(
            "%s is being built by another lazyrag precache; waiting for it to finish "
            "(the chunks it stores will not be encoded again)",
            path,
        )
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def build_in_progress(path: Path) -> bool:
    """Whether a precache run holds the store's build lock now (without creating a lock file)."""
    from filelock import FileLock, Timeout

    if not (Path(path) / LOCK).is_file():
        return False
    lock = FileLock(Path(path) / LOCK)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:  # a read-only store: nobody builds it
        return False
    lock.release()
    return False


def rebuild_interrupted(path: Path) -> bool:
    """Whether an ``--overwrite`` is deleting the store, or was stopped doing so (the one answer holding the writer
    lock)."""
    return (Path(path) / REBUILDING).is_file()


def clear_store(path: Path) -> None:
    """Delete a store's files for a rebuild (``--overwrite``), keeping the lock file its writer holds; call it
    holding the writer lock. StoreError, deleting nothing, for a folder ``check_overwritable`` refuses.

    The marker goes first and the manifest last but for the marker: wherever this stops, the folder holds the
    marker (readers refuse it as half deleted; the next precache run finishes this) or only the lock."""
    path = Path(path)
    if not path.exists():
        return
    check_overwritable(path)
    marker = path / REBUILDING
    if not marker.is_file():
        _write(marker, json.dumps({"overwrite_started": time.time()}).encode())
    for name in (INDEX, INDEX_NEXT, *reversed(_TABLE_FILES)):
        _delete(path / name)
    kv = path / KV_DIR
    if kv.is_dir():
        for p in sorted(kv.iterdir()):  # every one a shard or temp file of ours: check_overwritable saw to it
            _delete(p)
        _delete(kv)
    remove_stale_temp_files(path)
    _delete(path / MANIFEST)
    _delete(marker)


def _delete(p: Path) -> None:
    try:
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)
    except OSError as e:
        raise StoreError(
            f"cannot delete {p} ({e.strerror or e}); fix that, then rerun the same lazyrag precache "
            "command: it finishes the rebuild."
        ) from e


# -- the FAISS index ------------------------------------------------------------------------


def build_index(vecs: np.ndarray, ids: np.ndarray, kind: str = "flat") -> faiss.Index:
    """Inner product over normalised embeddings (cosine). flat: exact; ivf/hnsw: approximate, for large corpora."""
    require("FAISS indexes", "faiss")
    import faiss

    dim = vecs.shape[1]
    base: faiss.Index
    if kind == "flat":
        base = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        base = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
    elif kind == "ivf":
        nlist = max(1, min(int(4 * np.sqrt(len(vecs))), len(vecs) // 39 or 1))  # FAISS wants ~39 points per list
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(vecs)
        ivf.nprobe = max(1, nlist // 8)
        base = ivf
    else:
        raise ValueError(f"Unknown index kind {kind!r}: choose flat, ivf or hnsw.")
    index = faiss.IndexIDMap2(base)
    if len(vecs):
        index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
    return index


def write_index(path: Path, index: faiss.Index) -> str:
    """Write the index (atomically); its sha256, which the manifest records."""
    require("FAISS indexes", "faiss")
    import faiss

    data = faiss.serialize_index(index).tobytes()
    _write(path, data)
    return hashlib.sha256(data).hexdigest()


def _publish_index(pending: Path, path: Path) -> None:
    """Rename the index a new manifest names into place (``finish``'s last step)."""
    try:
        pending.replace(path)
    except OSError as e:
        raise StoreError(_write_failed(path, e)) from e


def _read_pending_index(path: Path, sha256: str) -> np.ndarray | None:
    """``index.faiss.next``'s bytes if it is the index the manifest names (its publishing rename not done yet)."""
    try:
        data = np.fromfile(Path(path) / INDEX_NEXT, dtype=np.uint8)
    except OSError:
        return None
    # numpy's stubs give ndarray its buffer protocol (__buffer__) only for Python 3.12+
    return data if sha256 and hashlib.sha256(data).hexdigest() == sha256 else None  # type: ignore[arg-type]


def settle_pending_index(path: Path, manifest: StoreManifest) -> None:
    """What a ``finish`` killed while publishing left (call it holding the writer lock): an ``index.faiss.next``
    that ``manifest`` names is renamed into place; one it does not name (killed before the manifest) is deleted."""
    path = Path(path)
    pending = path / INDEX_NEXT
    if not pending.is_file() or pending.is_symlink():
        return
    if _read_pending_index(path, manifest.index_sha256) is not None:
        _publish_index(pending, path / INDEX)
        log.info("%s: finished publishing the index of an interrupted precache", path)
    else:
        _delete(pending)


def deserialize_index(data: np.ndarray) -> faiss.Index:
    require("FAISS indexes", "faiss")
    import faiss

    return faiss.deserialize_index(data)


def read_index(path: Path) -> faiss.Index:
    return deserialize_index(np.fromfile(path, dtype=np.uint8))
