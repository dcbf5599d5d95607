"""Fixtures shared by the LlamaIndex and LangChain adapter tests (imported by those modules)."""
import pytest


@pytest.fixture(scope="session")
def tiny_store(default_engine, tiny_corpus, embedder, tmp_path_factory):
    """A finished corpus store of the five tiny documents, built on the session engine."""
    from lazyrag.store.build import PrecacheConfig, precache

    out = tmp_path_factory.mktemp("adapter-stores") / "tiny"
    precache(default_engine, PrecacheConfig([str(tiny_corpus)], str(out), progress=False), embedder)
    return out


@pytest.fixture(scope="module")
def adapter_engine(default_engine):
    """The session engine as the adapters' shared engine for the default model; stores the adapters
    attach are detached afterwards, so other test modules see the engine as they left it."""
    from lazyrag.integrations._common import register_engine

    register_engine(default_engine)
    tiers = list(default_engine.cache.tiers)
    yield default_engine
    default_engine.cache.tiers[:] = tiers
    default_engine.cache.clear()


@pytest.fixture
def decode_batches(adapter_engine, monkeypatch):
    """The batch size of every decode step the engine runs while the test does (a spy on the runner)."""
    runner = adapter_engine.scheduler.runner
    sizes: list[int] = []
    decode = runner.decode

    def spy(seqs, tokens):
        sizes.append(len(seqs))
        return decode(seqs, tokens)

    monkeypatch.setattr(runner, "decode", spy)
    return sizes


# More concurrent calls than any default thread pool runs at once (asyncio.to_thread and LangChain's
# executor use at most 32 workers): adapters that ran the engine in a thread per call could not
# batch them all.
MANY = 34


@pytest.fixture
def detaches_stores(default_engine, tiny_engine, embedder, monkeypatch):
    """precache_store attaches the store it builds to the engine it is given: detached again after the test,
    since other tests count hits and misses on these session engines. The adapters use the session embedder."""
    from lazyrag.integrations import _common
    from lazyrag.store.retriever import DEFAULT_EMBEDDER

    monkeypatch.setitem(_common._embedders, DEFAULT_EMBEDDER, embedder)
    tiers = [(engine, list(engine.cache.tiers)) for engine in (default_engine, tiny_engine)]
    yield
    for engine, before in tiers:
        engine.cache.tiers[:] = before


@pytest.fixture
def store_engine(tiny_engine, detaches_stores):
    """A fast engine for precache_store's text and resume checks (random weights: its KV serves no real model)."""
    return tiny_engine
