"""Replicas share one corpus store, read-only (issue 32 item 1): two ``lazyrag serve --replicas`` replicas
(``LazyragReplica``, the Ray Serve deployment's class, called here in process through ASGI) attach one
store folder made read-only (``chmod -R a-w``) and answer from it, and nothing in the folder is written:
its files, sizes and times are unchanged, no file under it is opened for writing and its chunk table is
opened read-only (an audit hook sees every ``open`` and ``sqlite3.connect`` of this process, also as root,
whom ``chmod`` does not stop)."""

import asyncio
import json
import os
import shutil
import sqlite3
import stat
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

_WATCHED: list[Path] = []  # the folders the audit hook reports writes under (empty: it reports nothing)
_WRITES: list[str] = []


def _audit(event: str, args) -> None:
    if not _WATCHED:
        return
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None
            and isinstance(flags, int)
            and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        )
    elif event == "sqlite3.connect":
        path, writes = args[0], "mode=ro" not in str(args[0])
    elif event in (
        "os.rename",
        "os.replace",
        "os.remove",
        "os.mkdir",
        "os.rmdir",
        "os.chmod",
        "os.truncate",
        "os.utime",
    ):
        path, writes = args[0], True
    else:
        return
    if writes and isinstance(path, (str, bytes, os.PathLike)):
        text = os.fsdecode(path).removeprefix("file:").split("?")[0]
        if any(text.startswith(str(w)) or text.startswith(w.as_uri().removeprefix("file:")) for w in _WATCHED):
            _WRITES.append(f"{event} {text} {args[1:]}")


sys.addaudithook(_audit)


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, stat.S_IMODE(p.stat().st_mode))
        for p in sorted(folder.rglob("*"))
    } | {".": stat.S_IMODE(folder.stat().st_mode)}


def make_read_only(folder: Path) -> None:
    for p in [*folder.rglob("*"), folder]:
        p.chmod(stat.S_IMODE(p.stat().st_mode) & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def make_writable(folder: Path) -> None:
    for p in [folder, *folder.rglob("*")]:
        p.chmod(stat.S_IMODE(p.stat().st_mode) | stat.S_IWUSR)


def ask(replica, question: str) -> dict:
    from lazyrag.server.replicas import call_asgi

    body = json.dumps(
        {"model": replica.engine.model_name, "messages": [{"role": "user", "content": question}], "max_tokens": 4}
    ).encode()

    async def go():
        status, data = None, b""
        async for message in call_asgi(
            replica.app, "POST", "/v1/chat/completions", b"", [(b"content-type", b"application/json")], body
        ):
            if message["type"] == "http.response.start":
                status = message["status"]
            else:
                data += message.get("body", b"")
        return status, json.loads(data)

    status, out = asyncio.run(go())
    assert status == 200, out
    return out


@pytest.fixture
def read_only_store(tiny_store, tmp_path):
    """A copy of the session's tiny store (``lazyrag precache``'s output), made read-only for everyone."""
    folder = tmp_path / "shared-store"
    shutil.copytree(tiny_store, folder, ignore=shutil.ignore_patterns(".precache.lock"))
    make_read_only(folder)
    yield folder
    make_writable(folder)


def test_two_replicas_answer_from_one_read_only_store_and_write_nothing_there(read_only_store, default_engine):
    from lazyrag.server.replicas import LazyragReplica, ReplicaSpec

    before = snapshot(read_only_store)
    _WATCHED[:] = [read_only_store.resolve()]
    _WRITES.clear()
    try:
        spec = asdict(ReplicaSpec(kv_budget=128 << 20, store=str(read_only_store), server={"max_tokens": 4, "k": 2}))
        replicas = [LazyragReplica(spec), LazyragReplica(spec)]
        answers = [ask(r, q) for r in replicas for q in ("Where was Paganini born?", "How deep is the Mariana Trench?")]
    finally:
        _WATCHED.clear()
    for replica in replicas:  # each retrieved the store's chunks and read their KV from it (no chunk encoded)
        report = replica.engine.cache_report()
        store_tier = next(t for t in report["tiers"] if t["label"].startswith("store "))
        assert store_tier["hits"] >= 2, report
    assert all(a["lazyrag"]["choices"][0]["chunks_hit"] >= 1 for a in answers), answers
    assert all(a["choices"][0]["message"]["content"] for a in answers)
    assert _WRITES == [], _WRITES
    assert snapshot(read_only_store) == before


def test_a_read_only_open_of_a_store_never_connects_for_writing(read_only_store):
    from lazyrag.store.corpus import TABLE, CorpusStore

    store = CorpusStore.open(read_only_store)
    assert store.read_only and len(store) == 5
    with pytest.raises(sqlite3.OperationalError, match="readonly"):  # sqlite itself refuses, also for root
        store._db().execute("DELETE FROM chunks")
    assert (read_only_store / TABLE).stat().st_mode & 0o222 == 0
