"""Corpus stores: chunk KV pre-computed once, on disk, for any process to load.

``corpus.py`` is the store itself (a folder: manifest, sqlite chunk table, safetensors KV shards,
FAISS index) and serves the cache as its bottom tier; ``build.py`` builds one with an engine
(``lazyrag precache``); ``retriever.py`` searches one. build and retriever depend on corpus, never
the reverse, and corpus depends on nothing above the KV cache.
"""

from lazyrag.store.corpus import CorpusStore, StoreError, StoreManifest, StoreMismatch

__all__ = ["CorpusStore", "StoreError", "StoreManifest", "StoreMismatch"]
