"""Plain helpers shared by test modules (fixtures live in the conftest.py files); no test module imports another."""

import os
import random
import socket
import threading
from contextlib import contextmanager

import torch

# A hang guard, not a deadline: how long a subprocess that loads the model (the CLI, an example, a snippet) may run
# before the test calls it hung. A busy 2-core CI machine ran `lazyrag demo` past 600 s; a hang never ends.
HANG_S = float(os.environ.get("LAZYRAG_TEST_HANG_S", "3600"))

# -- prompts: chunks and questions the engine, scheduler, blend, fault and eval tests share ----------

CHUNKS = [
    "The Grand Canal of China, begun in the 5th century BC, links Beijing with Hangzhou over 1,776 kilometres.",
    "Marie Curie won the Nobel Prize in Physics in 1903 and the Nobel Prize in Chemistry in 1911.",
    "The Mariana Trench in the western Pacific reaches a depth of about 10,935 metres at Challenger Deep.",
    "Basalt forms when lava rich in magnesium and iron cools quickly at the surface of the Earth.",
    "The violinist Niccolo Paganini was born in Genoa in 1782 and toured Europe for decades.",
]
QUESTION = "In which years did Marie Curie win Nobel Prizes?"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


QUESTIONS = [QUESTION, "How deep is the Mariana Trench?", "Where was Paganini born?", "How long is the Grand Canal?"]


def random_layouts(engine, n: int, seed: int = 0):
    rng = random.Random(seed)
    return [
        engine.build_prompt(QUESTIONS[i % len(QUESTIONS)], rng.sample(CHUNKS, k=rng.randint(2, 4))) for i in range(n)
    ]


@contextmanager
def stepped_by_hand(engine):
    """Queue requests inside the block; they are stepped to completion by this thread when it ends. The stepping
    lock is held throughout, so a driver thread left running by an earlier asyncio test on a shared engine
    cannot step some of them first (which made batch shapes and abort timing depend on thread scheduling)."""
    with engine._lock:
        yield
        while engine.scheduler.has_work():
            engine.scheduler.step()


def assert_nothing_held(engine, free_before: int):
    assert not engine.scheduler.has_work()
    assert engine.cache.pool.num_free == free_before
    assert all(seg.pins == 0 for seg in engine.cache._segments.values())


def run_in_threads(n: int, work) -> list:
    """``work(i)`` in n threads started together; each one's result, or the exception it raised."""
    out = [None] * n
    start = threading.Barrier(n)

    def worker(i):
        start.wait()
        try:
            out[i] = work(i)
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


# -- the tiny corpus (tests/conftest.py writes it to a folder) and the adapters' concurrency -------------

TINY_DOCS = {
    "curie.md": "Marie Curie won the Nobel Prize in Physics in 1903 and the Nobel Prize in Chemistry in 1911.",
    "canal.md": (
        "The Grand Canal of China links Beijing with Hangzhou over 1,776 kilometres and was begun in the 5th "
        "century BC."
    ),
    "trench.txt": (
        "The Mariana Trench in the western Pacific reaches a depth of about 10,935 metres at Challenger Deep."
    ),
    "basalt.md": "Basalt forms when lava rich in magnesium and iron cools quickly at the surface of the Earth.",
    "paganini.txt": "The violinist Niccolo Paganini was born in Genoa in 1782 and toured Europe for decades.",
}

# More concurrent calls than any default thread pool runs at once (asyncio.to_thread and LangChain's
# executor use at most 32 workers): adapters that ran the engine in a thread per call could not
# batch them all.
MANY = 34


def kwargs_id(value):
    """A parametrize id for a case of keyword arguments (``temperature=nan`` rather than ``kwargs0``)."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in value.items())
    return None


def free_port() -> int:
    """A free TCP port on loopback, for a server a test starts (in a thread or a process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_body_answer(url: str) -> bytes:
    """What a server at ``url`` answers a client that sends headers and part of a body, then nothing: read until
    the server closes the connection (its own --body-timeout decides when, not a clock of the test's)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


class Running:
    """A uvicorn server in a thread, on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        from lazyrag.server import wait_until_ready

        self.url = f"http://127.0.0.1:{free_port()}"
        host, port = self.url.rsplit(":", 1)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(port), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until_ready(self.url, timeout_s=30)
        self.app = app

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
