"""The corpus store: built by precache on the default model, read back bit-exact, refused when it does not fit."""
import json
import shutil

import pytest
import torch

from lazyrag.store.build import PrecacheConfig, precache
from lazyrag.store.retriever import Retriever
from lazyrag.store import MANIFEST, CorpusStore, StoreError, StoreMismatch, attach_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store_path(default_engine, tiny_corpus, embedder, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "tiny"
    report = precache(default_engine, PrecacheConfig([str(tiny_corpus)], str(out), chunks_per_shard=2, progress=False), embedder)
    assert report.chunks == 5 and report.chunks_encoded == 5
    return out


@pytest.fixture
def attached(default_engine, store_path):
    """The session engine with the store as its bottom tier, detached afterwards."""
    default_engine.cache.clear()
    store = attach_store(default_engine, store_path)
    yield default_engine, store
    default_engine.cache.tiers.remove(store)
    default_engine.cache.clear()


def test_manifest_and_table(store_path, default_engine):
    store = CorpusStore.open(store_path, default_engine)
    m = store.manifest
    assert m.status == "complete" and m.num_chunks == len(store) == 5
    assert m.model_fingerprint == default_engine.fingerprint and m.dtype == "float32" and m.block_size == 16
    assert m.prefix_ids == default_engine.prompts.prefix_ids()
    rows = store.rows()
    assert sorted(r.doc_id for r in rows) == ["basalt.md", "canal.md", "curie.md", "paganini.txt", "trench.txt"]
    k, v, row = store.load_kv(rows[0].id)
    assert k.shape == (30, row.num_tokens, 3, 64) and k.dtype == torch.float32  # unpadded, model dtype


def test_retriever_finds_the_right_chunk(store_path, embedder):
    hits = Retriever(store_path, embedder).retrieve("Which prizes did Marie Curie win?", k=2)
    assert hits[0].doc_id == "curie.md" and "Nobel" in hits[0].text
    assert hits[0].score > hits[1].score


def test_engine_answers_from_the_store_with_hits_and_identical_logits(attached):
    engine, store = attached
    question, texts = "Where was Paganini born?", [r.text for r in store.rows()[:3]]
    layout = engine.build_prompt(question, texts)
    before = engine.runner.tokens_forwarded
    from_store = engine.layout_logits(layout)
    assert engine.runner.tokens_forwarded - before == len(layout.question_ids)  # prefix and chunks came from disk
    assert engine.cache.stats.tier_hits >= 4
    engine.cache.tiers.remove(store)
    engine.cache.clear()
    computed = engine.layout_logits(layout)  # the same prompt, chunk KV recomputed
    engine.cache.tiers.append(store)
    assert torch.equal(from_store, computed)


def test_corrupt_shard_is_recomputed_never_used_and_repaired(default_engine, store_path, embedder, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(store_path, path)
    store = CorpusStore.open(path, default_engine)
    victim = store.rows()[1]
    shard = path / "kv" / victim.shard
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x40  # one bit of the last tensor in the shard
    shard.write_bytes(bytes(data))
    bad = store.verify()
    assert bad and all(store.rows([b])[0].shard == victim.shard for b in bad)

    default_engine.cache.clear()
    attach_store(default_engine, store)
    try:
        texts = [store.rows([b])[0].text for b in bad]
        result = default_engine.generate("What is this about?", texts, max_new_tokens=1)
        assert result.stats.chunks_missed == len(texts)  # recomputed, not read from the corrupt shard
    finally:
        default_engine.cache.tiers.remove(store)
        default_engine.cache.clear()

    assert store.verify(repair=True) == bad
    with pytest.raises(StoreError, match="unfinished"):
        CorpusStore.open(path)
    report = precache(default_engine, PrecacheConfig(store.manifest.sources, str(path), chunks_per_shard=2, progress=False), embedder)
    assert report.chunks_encoded == 2  # the one damaged shard (2 chunks), nothing else
    assert CorpusStore.open(path, default_engine).verify() == []


@pytest.mark.parametrize("field,value", [("model_fingerprint", "0" * 32), ("dtype", "bfloat16"), ("block_size", 32), ("layout_version", 99)])
def test_mismatched_store_is_refused_with_what_to_do(default_engine, store_path, tmp_path, field, value):
    path = tmp_path / "other"
    shutil.copytree(store_path, path)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest[field] = value
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreMismatch, match="(?i)rebuild"):
        attach_store(default_engine, path)
    assert not any(isinstance(t, CorpusStore) for t in default_engine.cache.tiers)


def test_other_system_prompt_is_refused(default_engine, store_path):
    store = CorpusStore.open(store_path)
    old = default_engine.prompts.system_prompt
    default_engine.prompts.system_prompt = "You are a pirate."
    try:
        with pytest.raises(StoreMismatch, match="system_prompt"):
            store.check_compatible(default_engine)
    finally:
        default_engine.prompts.system_prompt = old
