"""lazyrag precache: readers, block-aligned chunking, kill -9 and resume, a new process answering from the store."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lazyrag.store.build import PrecacheConfig, chunk_documents, precache, read_documents
from lazyrag.store.corpus import LOCK, MANIFEST, TABLE, CorpusStore
from tests.helpers import HANG_S

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"


def test_chunks_are_block_aligned_and_overlap(default_engine):
    from lazyrag.store.build import Document

    prompts = default_engine.prompts
    text = " ".join(f"Sentence number {i} talks about topic {i % 7}." for i in range(120))
    chunks = chunk_documents([Document("long", text)], prompts, chunk_tokens=64, overlap=16, block_size=16)
    assert len(chunks) > 5
    for c in chunks:
        assert len(c.ids) <= 64 and c.ids == prompts.encode_chunk(c.text)  # whole blocks, the engine's tokenization
    assert sum(len(c.ids) >= 56 for c in chunks) >= len(chunks) - 1  # and nearly full
    assert chunks[0].text[-25:] in chunks[1].text[:120]  # consecutive chunks share ~16 tokens
    with pytest.raises(ValueError, match="multiple of the KV block size"):
        chunk_documents([Document("long", text)], prompts, chunk_tokens=60, overlap=0, block_size=16)


@pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")
def test_reads_hotpotqa_and_gzipped_nq():
    hot = list(read_documents([str(DATA / "hotpotqa_dev_500.jsonl")], limit=12))
    assert len(hot) == 12 and all(d.meta["title"] and d.text.startswith(d.meta["title"]) for d in hot)
    nq = list(read_documents([str(DATA / "nq_open_oracle_2655.jsonl.gz")], limit=3))
    assert len(nq) == 3 and all(len(d.text) > 50 for d in nq)


def _store_snapshot(path):
    db = sqlite3.connect(Path(path) / TABLE)
    return db.execute(
        "SELECT id, key, doc_id, text, num_tokens, start, shard, digest, embedding FROM chunks ORDER BY id"
    ).fetchall()


# `lazyrag precache` in a child process that kill -9s itself right after its second chunk shard is written (rows
# committed): a real SIGKILL at an exact point of the build, not a race between a poll and the kill
_KILLED_AFTER_TWO_SHARDS = textwrap.dedent("""
    import os, signal, sys
    from lazyrag.store.corpus import CorpusStore
    add_shard, written = CorpusStore.add_shard, []
    def add_shard_then_die(self, shard, rows, *args):
        add_shard(self, shard, rows, *args)
        written.extend(r for r in rows if r.kind == "chunk")
        if len(written) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    CorpusStore.add_shard = add_shard_then_die
    from lazyrag.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_killed_build_resumes_to_the_same_store(default_engine, tiny_corpus, embedder, tmp_path):
    # the shared engine may hold the prefix's KV from a batched forward of an earlier test (fp32 sums in another
    # order); the killed build's process computes it alone, as a build on an empty cache does
    default_engine.cache.clear()
    reference = tmp_path / "reference"
    precache(
        default_engine, PrecacheConfig([str(tiny_corpus)], str(reference), chunks_per_shard=1, progress=False), embedder
    )

    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-c",
        _KILLED_AFTER_TWO_SHARDS,
        "precache",
        str(tiny_corpus),
        "--out",
        str(out),
        "--chunks-per-shard",
        "1",
        "--quiet",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=HANG_S)  # hang guard
    assert proc.returncode == -signal.SIGKILL, proc.stdout.decode()[-2000:]
    partial = _store_snapshot(out)
    assert len(partial) - 1 == 2, "the build was not killed after its second chunk"  # the prefix row and two chunks
    with pytest.raises(Exception, match="unfinished"):
        CorpusStore.open(out)

    report = precache(
        default_engine, PrecacheConfig([str(tiny_corpus)], str(out), chunks_per_shard=1, progress=False), embedder
    )
    assert report.chunks_encoded == 5 - 2  # only what the killed run had not finished
    assert _store_snapshot(out) == _store_snapshot(reference)  # same rows, digests and embeddings
    assert CorpusStore.open(out).verify() == []


@pytest.mark.slow
def test_new_process_answers_from_the_store_with_hits(default_engine, tiny_corpus, embedder, tmp_path):
    store = tmp_path / "store"
    precache(default_engine, PrecacheConfig([str(tiny_corpus)], str(store), progress=False), embedder)
    script = textwrap.dedent(f"""
        import json
        from lazyrag.engine import LazyEngine
        from lazyrag.store.retriever import Retriever
        engine = LazyEngine.from_pretrained(device="cpu")
        engine.attach_store({str(store)!r})
        q = "How deep is the Mariana Trench?"
        chunks = [c.text for c in Retriever({str(store)!r}).retrieve(q, k=3)]
        layout = engine.build_prompt(q, chunks)
        r = engine.generate(q, chunks, max_new_tokens=1)
        print(json.dumps(dict(r.stats.as_dict(), question_tokens=len(layout.question_ids),
                              tier_hits=engine.cache.stats.tier_hits, doc=chunks[0][:20])))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["doc"].startswith("The Mariana Trench")
    assert stats["chunks_hit"] == 3 and stats["chunks_missed"] == 0
    assert stats["tokens_prefilled"] == stats["question_tokens"]  # nothing but the question ran through the model
    assert stats["tier_hits"] == 4  # the prefix and three chunks loaded from disk


def test_cli_help_teaches():
    proc = subprocess.run(
        [sys.executable, "-m", "lazyrag.cli", "precache", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0
    for word in ("--chunk-tokens", "--overlap", "--index", "--limit", "resume", "nq_open_oracle_2655.jsonl.gz"):
        assert word in proc.stdout


def _wait_for(condition, seconds=120):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
def test_second_writer_waits_for_the_first_and_finds_the_work_done(
    default_engine, tiny_corpus, embedder, tmp_path, caplog
):
    out = tmp_path / "store"
    config = PrecacheConfig([str(tiny_corpus)], str(out), chunks_per_shard=2, progress=False)
    reports, errors = {}, []

    def build(name):
        try:
            reports[name] = precache(default_engine, config, embedder)
        except Exception as e:  # surfaced by the asserts below
            errors.append(e)

    first, second = (threading.Thread(target=build, args=(name,)) for name in ("first", "second"))
    with caplog.at_level("WARNING", logger="lazyrag.store"):
        with default_engine._lock:  # the first writer takes the store lock, then blocks before encoding
            first.start()
            _wait_for(lambda: (out / MANIFEST).is_file() and (out / LOCK).is_file())  # written under the store lock
            second.start()
            _wait_for(lambda: "being built by another lazyrag precache; waiting" in caplog.text or errors)
            assert not reports  # neither got past the lock and the engine
        first.join(300)
        second.join(300)
    assert not errors, errors
    assert reports["first"].chunks_encoded == 5 and reports["second"].chunks_encoded == 0  # not done twice
    assert CorpusStore.open(out).verify() == []


# -- issue 29: half-built folders, stale temp files, a full disk, the umask (tiny model: fast) --------------


def _tiny_build(engine, corpus, out, embedder, **kw):
    return precache(engine, PrecacheConfig([str(corpus)], str(out), chunks_per_shard=2, progress=False, **kw), embedder)


def _temp_file(folder, name):
    """A temp file named as atomic_write_bytes names them (what a write killed before its rename leaves)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.write(fd, b'{"model_fingerprint": "3f')  # half a manifest
    os.close(fd)
    return Path(tmp)


def test_a_build_killed_in_its_first_manifest_write_resumes(tiny_engine, tiny_corpus, embedder, tmp_path):
    out = tmp_path / "store"
    out.mkdir()
    (out / LOCK).touch()  # what `lazyrag precache` killed inside its first write_manifest leaves behind
    (out / "kv").mkdir()
    temp = _temp_file(out, MANIFEST)
    report = _tiny_build(tiny_engine, tiny_corpus, out, embedder)
    assert report.chunks_encoded == 5 and not temp.exists()
    assert len(CorpusStore.open(out)) == 5


@pytest.mark.parametrize("user_file", ["notes.txt", "kv/notes.txt", ".manifest.json.tmp"])
def test_a_folder_of_someone_else_is_refused_and_left_alone(tiny_engine, tiny_corpus, embedder, tmp_path, user_file):
    from lazyrag.store import StoreError

    out = tmp_path / "mine"
    (out / "kv").mkdir(parents=True)
    temp = _temp_file(out, MANIFEST)
    (out / user_file).write_text("keep me")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for overwrite in (False, True):
        with pytest.raises(StoreError, match="exists and is not a lazyrag store"):
            _tiny_build(tiny_engine, tiny_corpus, out, embedder, overwrite=overwrite)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and temp.exists()


def test_stale_temp_files_are_removed_when_a_writer_opens_the_store(tiny_engine, tiny_corpus, embedder, tmp_path):
    out = tmp_path / "store"
    _tiny_build(tiny_engine, tiny_corpus, out, embedder)
    stale = [
        _temp_file(out, "index.faiss"),
        _temp_file(out, MANIFEST),
        _temp_file(out / "kv", "shard-000001.safetensors"),
    ]
    mine = out / "kv" / "my.tmp"
    mine.write_text("not ours")
    assert _tiny_build(tiny_engine, tiny_corpus, out, embedder).chunks_encoded == 0
    assert not any(p.exists() for p in stale) and mine.exists()
    assert CorpusStore.open(out).verify() == []


def test_a_full_disk_during_precache_is_a_one_line_error(
    tiny_engine, tiny_corpus, embedder, tmp_path, monkeypatch, capsys
):
    import errno

    import lazyrag.store.build as build
    import lazyrag.store.corpus as corpus
    from lazyrag.cli import main
    from lazyrag.engine import LazyEngine

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(LazyEngine, "from_pretrained", classmethod(lambda cls, *a, **kw: tiny_engine))
    monkeypatch.setattr(build, "load_embedder", lambda name: embedder)
    monkeypatch.setattr(corpus, "atomic_write_bytes", full)
    rc = main(["precache", str(tiny_corpus), "--out", str(tmp_path / "store"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    first, *rest = err.strip().splitlines()
    assert first.startswith("error: cannot write") and "disk is full" in first and "rerun" in first, err
    assert all("--debug" in line for line in rest)


def test_store_files_respect_the_umask(tiny_engine, tiny_corpus, embedder, tmp_path):
    from lazyrag.kv.tiers import atomic_write_bytes

    old = os.umask(0o027)
    try:
        out = tmp_path / "store"
        _tiny_build(tiny_engine, tiny_corpus, out, embedder)
        atomic_write_bytes(tmp_path / "one", b"x")
    finally:
        os.umask(old)
    modes = {
        str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
        for p in [tmp_path / "one", *out.rglob("*")]
        if p.is_file()
    }
    assert modes and set(modes.values()) == {"0o640"}, modes  # as other tools create files; mkstemp alone gives 0600


# -- issue 34: stores from LlamaIndex and LangChain, answered from in a new process -----------------------

INDEX_DOCS = {
    "saturn.md": "Saturn's rings are made mostly of water ice, with smaller amounts of rock and dust.",
    "tea.md": "Green and black tea both come from the leaves of the Camellia sinensis plant.",
    "bach.md": "Johann Sebastian Bach spent his last twenty-seven years as cantor of St. Thomas Church in Leipzig.",
    "sahara.md": "The Sahara covers most of North Africa and is the largest hot desert on Earth.",
}
SPLITS = [
    "Honey bees communicate the direction of flowers to their hive mates with a waggle dance.",
    "The Danube flows through ten countries, more than any other river in the world.",
    "Mount Kilimanjaro in Tanzania is the highest mountain on the African continent.",
    "The Rosetta Stone carries one decree in hieroglyphic, Demotic and ancient Greek scripts.",
]

NEW_PROCESS = """
import json, sys
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import StorageContext, load_index_from_storage
from lazyrag.integrations.langchain import ChatLazyLlama, LazyRAGEmbeddings
from lazyrag.integrations.llama_index import LazyEmbedding, LazyLlamaLLM, node_chunk_text

folder, index_store, vectors, docs_store = sys.argv[1:]
llm = LazyLlamaLLM(store=index_store, device="cpu", max_new_tokens=1)
index = load_index_from_storage(StorageContext.from_defaults(persist_dir=folder), embed_model=LazyEmbedding())
answer = index.as_query_engine(llm=llm, similarity_top_k=3).query("What are Saturn's rings made of?")
engine = llm.engine
chunk_tokens = lambda texts: sum(len(engine.prompts.encode_chunk(t)) for t in texts)
out = {"llama_index": llm.stats_log, "nodes": chunk_tokens(node_chunk_text(n) for n in answer.source_nodes)}

def format_docs(docs):
    return "\\n\\n".join(d.page_content for d in docs)

retriever = InMemoryVectorStore.load(vectors, LazyRAGEmbeddings()).as_retriever(search_kwargs={"k": 3})
prompt = ChatPromptTemplate.from_template("Answer from the context.\\n\\n{context}\\n\\nQuestion: {question}")
chain = (
    {"context": retriever | format_docs, "question": RunnablePassthrough()}
    | prompt
    | ChatLazyLlama(store=docs_store, device="cpu", max_tokens=1)
)
question = "Which river flows through the most countries?"
out["langchain"] = chain.invoke(question).response_metadata["lazyrag"]
out["documents"] = chunk_tokens(d.page_content for d in retriever.invoke(question))
out["tier_hits"] = engine.cache.stats.tier_hits
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_new_process_answers_from_llama_index_and_langchain_stores_from_the_first_question(
    default_engine, embedder, detaches_stores, tmp_path, monkeypatch, capsys
):
    from langchain_core.documents import Document as Split
    from langchain_core.vectorstores import InMemoryVectorStore
    from llama_index.core import Document as IndexDocument, VectorStoreIndex

    import lazyrag.store.build as build
    from lazyrag.cli import main
    from lazyrag.engine import LazyEngine
    from lazyrag.integrations import langchain
    from lazyrag.integrations.llama_index import LazyEmbedding, node_chunk_text

    # LlamaIndex: an index persisted as the docs show, its folder pre-cached by the CLI
    index = VectorStoreIndex.from_documents(
        [IndexDocument(text=t, metadata={"file_name": n}) for n, t in INDEX_DOCS.items()], embed_model=LazyEmbedding()
    )
    folder, index_store = tmp_path / "index", tmp_path / "index-store"
    index.storage_context.persist(str(folder))
    monkeypatch.setattr(LazyEngine, "from_pretrained", classmethod(lambda cls, *a, **kw: default_engine))
    monkeypatch.setattr(build, "load_embedder", lambda name: embedder)
    assert main(["precache", str(folder), "--out", str(index_store), "--quiet"]) == 0
    store = CorpusStore.open(index_store)
    assert [(r.doc_id, r.text) for r in store.rows()] == [
        (n.node_id, node_chunk_text(n)) for n in index.docstore.docs.values()
    ]
    assert store.manifest.sources == [str(folder)] and store.manifest.chunk_tokens == 256
    capsys.readouterr()
    assert main(["precache", str(folder), "--out", str(index_store), "--quiet"]) == 0  # the same folder again: done
    assert "encoded 0 chunks" in capsys.readouterr().out

    # LangChain: an in-memory vector store, saved for the new process
    vectors = InMemoryVectorStore(langchain.LazyRAGEmbeddings())
    vectors.add_documents([Split(page_content=t, metadata={"source": "facts.txt"}) for t in SPLITS])
    vectors.dump(str(tmp_path / "vectors.json"))
    docs_store = tmp_path / "docs-store"
    assert langchain.precache_store(vectors, docs_store, default_engine, progress=False).chunks == len(SPLITS)

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            NEW_PROCESS,
            str(folder),
            str(index_store),
            str(tmp_path / "vectors.json"),
            str(docs_store),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    # the first question of each framework: every retrieved chunk's KV read from its store, none computed
    (li,) = seen["llama_index"]  # compact mode: one LLM call
    lc = seen["langchain"]
    for stats, tokens in ((li, seen["nodes"]), (lc, seen["documents"])):
        assert stats["chunks_missed"] == 0 and stats["chunks_hit"] == 3, seen
        assert stats["chunk_tokens_reused"] == tokens, seen  # the retrieved chunks, whole
    # six chunks, loaded from disk (all hit: what they were encoded after is not read)
    assert seen["tier_hits"] == 6, seen


def test_a_rebuild_command_naming_in_memory_documents_says_to_rerun_the_python_call(tmp_path, capsys):
    from lazyrag.cli import main

    # what rebuild_command prints for a store precache_store built from a docstore
    assert main(["precache", "llama_index:docstore", "--out", str(tmp_path / "store"), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "precache_store" in err and "verify=True" in err and "Traceback" not in err


# -- --overwrite deletes only a store's own files; an interrupted one is finished; one chunk table per reader -------
# (the tiny random model: what is checked does not depend on the model)

OTHER_DOCS = {  # five other one-chunk documents: a store of them has as many rows as one of TINY_DOCS
    "fertilization.md": (
        "Human fertilization is the union of a human egg and sperm, usually in the ampulla of the fallopian tube."
    ),
    "kelp.md": (
        "Giant kelp forests grow along cool coasts, where the algae can rise more than forty metres from the sea floor."
    ),
    "abacus.md": (
        "The abacus was used for arithmetic in Mesopotamia, China and Rome long before written numerals spread."
    ),
    "saffron.txt": "Saffron is picked by hand from the stigmas of the crocus flower, which makes it the dearest spice.",
    "pharos.txt": (
        "The Lighthouse of Alexandria stood on the island of Pharos and guided ships into the harbour for centuries."
    ),
}
CURIE = "Which prizes did Marie Curie win?"


@pytest.fixture
def other_corpus(tmp_path):
    folder = tmp_path / "other-corpus"
    folder.mkdir()
    for name, text in OTHER_DOCS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def precache_cli(tiny_engine, embedder, monkeypatch):
    """``lazyrag precache ARGS --quiet`` in this process, on the tiny engine; its exit status."""
    import lazyrag.store.build as build
    from lazyrag.cli import main
    from lazyrag.engine import LazyEngine

    monkeypatch.setattr(LazyEngine, "from_pretrained", classmethod(lambda cls, *a, **kw: tiny_engine))
    monkeypatch.setattr(build, "load_embedder", lambda name: embedder)
    return lambda *args: main(["precache", *map(str, args), "--quiet"])


def _tree(folder):
    """Every path under ``folder`` and a file's bytes: what must stay as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in Path(folder).rglob("*")}


def _as_finished_by_the_cli(out):
    """The manifest naming the model as `lazyrag precache` names the default one (as the tiny engine is served
    here): a plain rerun would take its "already finished; nothing to do" shortcut if it trusted the manifest."""
    from lazyrag.model.loader import resolve_model_source

    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "model_name": resolve_model_source(None).name}))


WEB_MANIFEST = json.dumps(
    {
        "name": "Weather",
        "short_name": "Weather",
        "start_url": "/",
        "display": "standalone",
        "icons": [{"src": "icon-192.png", "sizes": "192x192", "type": "image/png"}],
    }
)


@pytest.mark.parametrize(
    "files,says",
    [
        (
            {
                "manifest.json": WEB_MANIFEST,
                "index.html": "<!doctype html><title>Weather</title>",
                "static/app.js": "go()",
            },
            "not a lazyrag manifest",
        ),
        ({"manifest.json": WEB_MANIFEST}, "not a lazyrag manifest"),
        ({"manifest.json": "{ not JSON", "notes.txt": "keep me"}, "notes.txt"),
        ({"manifest.json": "{ not JSON"}, "nothing in it shows it is a lazyrag store"),
    ],
    ids=["web-app", "web-manifest-alone", "garbage-manifest-and-a-file", "garbage-manifest-alone"],
)
def test_overwrite_leaves_a_folder_that_is_not_a_store_alone(precache_cli, tiny_corpus, tmp_path, capsys, files, says):
    from lazyrag.store import StoreError

    folder = tmp_path / "app"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    before = _tree(folder)
    assert precache_cli(tiny_corpus, "--out", folder, "--overwrite") == 2
    err = capsys.readouterr().err
    assert says in err and ("new --out folder" in err or "NEW_FOLDER" in err), err
    assert "Traceback" not in err
    assert _tree(folder) == before  # nothing deleted, and no lock file left in it
    if "not a lazyrag manifest" in says:
        # nothing sends the user to --overwrite (or reads the folder as a damaged store)
        assert precache_cli(tiny_corpus, "--out", folder) == 2
        for err in (capsys.readouterr().err, str(pytest.raises(StoreError, CorpusStore.open, folder).value)):
            assert "is not a lazyrag store" in err and "damaged" not in err, err
        assert _tree(folder) == before


@pytest.mark.parametrize(
    "user_file,shown",
    [
        ("notes.txt", "notes.txt"),
        ("kv/notes.txt", "kv/notes.txt"),
        ("backup/chunks.sqlite", "backup/"),
        (".manifest.json.tmp", ".manifest.json.tmp"),
    ],
)
def test_overwrite_refuses_a_store_folder_holding_anything_else(
    precache_cli, tiny_corpus, tmp_path, capsys, user_file, shown
):
    out = tmp_path / "store"
    assert precache_cli(tiny_corpus, "--out", out) == 0
    (out / user_file).parent.mkdir(exist_ok=True)
    (out / user_file).write_text("keep me")
    before = _tree(out)
    capsys.readouterr()
    assert precache_cli(tiny_corpus, "--out", out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert f"holds {shown} besides a store's files" in err and "move those out" in err, err
    assert _tree(out) == before
    assert len(CorpusStore.open(out)) == 5  # the store itself still serves


def test_the_command_a_damaged_manifest_names_rebuilds_the_store(precache_cli, tiny_corpus, tmp_path, capsys):
    import re
    import shlex

    from lazyrag.store import StoreError

    out = tmp_path / "store"
    assert precache_cli(tiny_corpus, "--out", out) == 0
    (out / MANIFEST).write_text('{"model_fingerprint": "3f')  # truncated
    with pytest.raises(StoreError, match="damaged") as refused:
        CorpusStore.open(out)
    command = shlex.split(re.search(r"`(lazyrag precache .*?)`", str(refused.value))[1])
    assert command[-1] == "--overwrite"
    capsys.readouterr()
    assert precache_cli(*[str(tiny_corpus) if a == "CORPUS" else a for a in command[2:]]) == 0
    assert "encoded 5 chunks" in capsys.readouterr().out
    assert len(CorpusStore.open(out)) == 5 and CorpusStore.open(out).verify() == []


class _Killed(BaseException):
    """What kill -9 does to precache at that point (nothing after it runs)."""


@pytest.mark.parametrize("rerun", ["plain", "overwrite"])
@pytest.mark.parametrize(
    "killed_at",
    ["index.faiss", "kv", MANIFEST, ".precache.rebuilding"],
    ids=["before-any-data", "before-kv-folder", "before-manifest", "before-marker"],
)
def test_an_interrupted_overwrite_is_finished_by_the_next_run(
    precache_cli, tiny_corpus, tmp_path, capsys, monkeypatch, killed_at, rerun
):
    import lazyrag.store.corpus as corpus
    from lazyrag.store import StoreError

    out = tmp_path / "store"
    assert precache_cli(tiny_corpus, "--out", out) == 0
    _as_finished_by_the_cli(out)
    delete = corpus._delete

    def killed_before(path):
        if path.name == killed_at:
            raise _Killed()
        delete(path)

    monkeypatch.setattr(corpus, "_delete", killed_before)
    with pytest.raises(_Killed):
        precache_cli(tiny_corpus, "--out", out, "--overwrite")
    monkeypatch.setattr(corpus, "_delete", delete)
    with pytest.raises(StoreError, match="half deleted.*interrupted.*Rerun"):
        CorpusStore.open(out)  # what readers see meanwhile: no half-deleted store served, whatever the manifest says
    capsys.readouterr()
    assert precache_cli(tiny_corpus, "--out", out, *(["--overwrite"] if rerun == "overwrite" else [])) == 0
    said = capsys.readouterr().out
    assert "encoded 5 chunks" in said and "nothing to do" not in said, said
    store = CorpusStore.open(out)
    assert len(store) == 5 and store.verify() == [] and not (out / ".precache.rebuilding").exists()


def test_a_store_an_older_overwrite_left_without_its_manifest_is_rebuilt_by_overwrite(
    precache_cli, tiny_corpus, tmp_path, capsys
):
    out = tmp_path / "store"
    assert precache_cli(tiny_corpus, "--out", out) == 0
    (out / MANIFEST).unlink()  # killed after deleting the manifest, before kv/ (the order of lazyrag before the marker)
    before = _tree(out)
    capsys.readouterr()
    assert precache_cli(tiny_corpus, "--out", out) == 2  # a plain rerun deletes nothing: it says what will
    err = capsys.readouterr().err
    assert "no manifest.json" in err and "--overwrite" in err, err
    assert _tree(out) == before
    assert precache_cli(tiny_corpus, "--out", out, "--overwrite") == 0
    assert "encoded 5 chunks" in capsys.readouterr().out
    assert len(CorpusStore.open(out)) == 5


def test_a_finished_manifest_whose_files_are_gone_is_not_called_done(precache_cli, tiny_corpus, tmp_path, capsys):
    import shutil

    out = tmp_path / "store"
    assert precache_cli(tiny_corpus, "--out", out) == 0
    _as_finished_by_the_cli(out)
    # killed before it reached the manifest (the order of lazyrag before the marker)
    for name in (TABLE, "index.faiss"):
        (out / name).unlink()
    shutil.rmtree(out / "kv")
    capsys.readouterr()
    assert precache_cli(tiny_corpus, "--out", out) == 0
    said = capsys.readouterr().out
    assert "already a finished store" not in said and "encoded 5 chunks" in said, said
    assert len(CorpusStore.open(out)) == 5 and CorpusStore.open(out).verify() == []


def test_a_store_rebuilt_under_an_open_reader_is_never_served_mixed(
    tiny_engine, tiny_corpus, other_corpus, embedder, tmp_path
):
    """`lazyrag serve --store S` (engine.attach_store: CorpusStore.open) while `lazyrag precache --overwrite --out S`
    rebuilds S from other documents: the server's index is the old one, the table the new one. A request answers
    from the store it opened or fails saying to open it again; never the new table's row under an old id."""
    from lazyrag.store import StoreError
    from lazyrag.store.retriever import Retriever

    out = tmp_path / "store"
    _tiny_build(tiny_engine, tiny_corpus, out, embedder)
    served = CorpusStore.open(out)  # as engine.attach_store opens it for `lazyrag serve --store`
    retriever = Retriever(served, embedder)
    opened = {r.id: r.text for r in served.rows()}
    assert "Nobel" in retriever.retrieve(CURIE, 1)[0].text
    assert _tiny_build(tiny_engine, other_corpus, out, embedder, overwrite=True).chunks_encoded == 5

    def request():  # on a thread of its own, as a server's worker: a new sqlite connection
        got = []
        thread = threading.Thread(target=lambda: got.append(_answer(retriever)))
        thread.start()
        thread.join()
        return got[0]

    for got in (_answer(retriever), request(), request()):
        if isinstance(got, StoreError):
            assert "open it again" in str(got), got
        else:  # the snapshot opened: its rows under its ids
            assert all(h.text == opened[h.id] for h in got), [h.text for h in got]
    assert isinstance(request(), StoreError)  # a new connection reaches the new table: refused, not mixed
    reopened = Retriever(out, embedder).retrieve(CURIE, 5)  # opened again: the new store, whole
    assert sorted(h.text for h in reopened) == sorted(OTHER_DOCS.values())


def _answer(retriever):
    from lazyrag.store import StoreError

    try:
        return retriever.retrieve(CURIE, 5)
    except StoreError as e:
        return e


def test_a_chunk_table_copied_from_another_store_is_refused_with_what_to_do(
    tiny_engine, tiny_corpus, other_corpus, embedder, tmp_path
):
    import shutil

    from lazyrag.store import StoreError
    from lazyrag.store.retriever import Retriever

    mine, other = tmp_path / "mine", tmp_path / "other"
    _tiny_build(tiny_engine, tiny_corpus, mine, embedder)
    _tiny_build(tiny_engine, other_corpus, other, embedder)
    assert len(CorpusStore.open(mine)) == len(CorpusStore.open(other)) == 5
    shutil.copyfile(other / TABLE, mine / TABLE)  # the same row count: the index still holds as many vectors
    for refused in (
        lambda: CorpusStore.open(mine),
        lambda: Retriever(mine, embedder),
        lambda: tiny_engine.attach_store(mine),
    ):
        with pytest.raises(
            StoreError, match=rf"(?s){TABLE} is not the chunk table.*replaced.*precache .*--out {mine} --verify"
        ):
            refused()
    report = _tiny_build(tiny_engine, tiny_corpus, mine, embedder, verify=True)  # what the message says to do
    assert set(report.corrupt) - {-1} == {0, 1, 2, 3, 4} and report.chunks_encoded == 5  # -1: the prefix, if it differs
    hit = Retriever(mine, embedder).retrieve(CURIE, 1)[0]
    assert hit.doc_id == "curie.md" and "Nobel" in hit.text


def test_a_store_from_before_table_ids_is_served_and_any_precache_run_gives_it_one(
    tiny_engine, tiny_corpus, embedder, tmp_path, caplog
):
    from lazyrag.store.retriever import Retriever

    out = tmp_path / "store"
    _tiny_build(tiny_engine, tiny_corpus, out, embedder)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["table_id"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    db = sqlite3.connect(out / TABLE)
    db.execute("DROP TABLE store_meta")
    db.commit()
    db.close()
    with caplog.at_level("WARNING", logger="lazyrag.store"):
        assert "Nobel" in Retriever(out, embedder).retrieve(CURIE, 1)[0].text  # served as before
    assert "before chunk tables carried an id" in caplog.text and "--verify" in caplog.text
    # what the warning says
    assert _tiny_build(tiny_engine, tiny_corpus, out, embedder, verify=True).chunks_encoded == 0
    table_id = (
        sqlite3.connect(out / TABLE).execute("SELECT value FROM store_meta WHERE name = 'table_id'").fetchone()[0]
    )
    assert CorpusStore.open(out).manifest.table_id == table_id != ""


@pytest.mark.parametrize(
    "line,says",
    [
        ('{"text": "fine"', r"line 2 is not JSON \(Expecting ',' delimiter, column 1"),
        ('["a", "list"]', r"line 2 is a JSON list, not an object"),
        ('{"text": "broken \\ud800 half"}', r"line 2: its text is not valid Unicode: character 7 is a lone surrogate"),
    ],
)
def test_a_bad_corpus_line_is_named_with_its_file_and_line(tmp_path, line, says):
    from lazyrag.store.corpus import StoreError

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "A good first document."}\n' + line + "\n")
    with pytest.raises(StoreError, match=f"{path}, {says}"):
        list(read_documents([str(path)]))


def test_a_corpus_file_that_is_not_utf8_is_named(tmp_path):
    from lazyrag.store.corpus import StoreError

    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(StoreError, match="not UTF-8 text"):
        list(read_documents([str(path)]))


def test_raising_limit_on_a_finished_store_adds_the_documents(precache_cli, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "store"
    assert precache_cli(tiny_corpus, "--out", out, "--limit", "2") == 0
    _as_finished_by_the_cli(out)
    assert len(CorpusStore.open(out)) == 2
    capsys.readouterr()
    assert precache_cli(tiny_corpus, "--out", out, "--limit", "4") == 0
    said = capsys.readouterr().out
    assert "already a finished store" not in said and "encoded 2 chunks" in said, said
    assert len(CorpusStore.open(out)) == 4 and CorpusStore.open(out).verify() == []


# -- an extension killed at any point: the store opens as the old or the new generation; a rerun finishes it ------


def _store_ops(monkeypatch, killed_at=None, mid_write=False):
    """Count the file operations a precache run makes on a store (each atomic write, the index's publishing rename);
    with ``killed_at``, kill -9 the run before that one (``mid_write``: in the middle of it, its temp file left)."""
    import tempfile

    import lazyrag.store.corpus as corpus

    ops = []

    def hooked(real):
        def op(path, *args):
            path = Path(path)
            if len(ops) == killed_at:
                if mid_write and real is write:
                    fd, _ = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
                    os.write(fd, b"\0" * 7)  # half written
                    os.close(fd)
                raise _Killed()
            ops.append(path.name)
            return real(path, *args)

        return op

    write = corpus._write
    monkeypatch.setattr(corpus, "_write", hooked(write))
    if hasattr(corpus, "_publish_index"):
        monkeypatch.setattr(corpus, "_publish_index", hooked(corpus._publish_index))
    return ops


@pytest.mark.parametrize("extension", ["limit", "documents"], ids=["raising-limit", "adding-documents"])
def test_an_extension_killed_at_any_point_leaves_a_store_that_opens_and_a_rerun_finishes(
    precache_cli, tiny_corpus, other_corpus, embedder, tmp_path, capsys, monkeypatch, extension
):
    import shutil

    from lazyrag.store.retriever import Retriever

    first, more = (["--limit", "2"], ["--limit", "4"]) if extension == "limit" else ([], [other_corpus])
    grown = 4 if extension == "limit" else 10
    base = tmp_path / "base"
    assert precache_cli(tiny_corpus, "--out", base, "--chunks-per-shard", "1", *first) == 0
    old = len(CorpusStore.open(base))

    def extend(out):
        return precache_cli(tiny_corpus, *more, "--out", out, "--chunks-per-shard", "1")

    with monkeypatch.context() as m:  # the operations of a whole extension
        shutil.copytree(base, tmp_path / "counted")
        ops = _store_ops(m)
        assert extend(tmp_path / "counted") == 0
    assert "manifest.json" in ops and len(ops) >= 4, ops
    for killed_at in range(len(ops)):
        for mid_write in (False, True):
            out = tmp_path / f"killed-{killed_at}-{int(mid_write)}"
            shutil.copytree(base, out)
            with monkeypatch.context() as m:
                _store_ops(m, killed_at, mid_write)
                with pytest.raises(_Killed):
                    extend(out)
            where = f"killed before {ops[killed_at]}{' (mid-write)' if mid_write else ''}"
            store = CorpusStore.open(out)  # the old generation or the new one, whole
            n = store.manifest.num_chunks
            assert n in (old, grown) and len(store) == n == store.index.ntotal, where
            hits = Retriever(store, embedder).retrieve("Who discovered penicillin?", k=50)
            assert sorted(h.id for h in hits) == list(range(n)), where
            assert store.verify() == [], where
            capsys.readouterr()
            assert extend(out) == 0, (where, capsys.readouterr().err)  # a plain rerun of the same command finishes it
            said = capsys.readouterr().out
            assert "nothing to do" not in said or n == grown, (where, said)
            store = CorpusStore.open(out)
            assert len(store) == grown and store.verify() == [], where
            leftovers = sorted(p.name for p in out.rglob("*") if p.name.endswith(".tmp") or "next" in p.name)
            assert leftovers == [], (where, leftovers)
