"""Training prompts for ``lazyrag tune``: questions of the sets' tune parts with their passages, and as many
distractors from the same set's tune part as make each prompt 5, 10 or 20 passages long, in a random order.

Only tune parts are read (``lazyrag.eval.split_of``): the report parts, on which the tuned model is judged, are
never seen, not even as a distractor. A slice of the tune part (``DEV_SHARE``, by a hash of the question) is
held out for the KL the training reports as it goes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import lazyrag.eval as quality

DEV_SHARE = 0.1


@dataclass(frozen=True)
class Question:
    dataset: str
    question: str
    passages: tuple[str, ...]  # its own: the gold one (NQ) or the set's given paragraphs


def is_dev(question: str) -> bool:
    h = int.from_bytes(hashlib.sha256(b"dev:" + question.encode()).digest()[:8], "big")
    return h % 1000 < DEV_SHARE * 1000


def load_questions(dataset: str, path: str | Path | None = None) -> list[Question]:
    """Every tune-part question of ``dataset`` with its own passages (``path``: the set's file, else the default)."""
    path = Path(path) if path is not None else quality.default_data(dataset)
    if not path.is_file():
        raise FileNotFoundError(f"{dataset}: no data at {path}; pass its file, or leave {dataset} out of the sets.")
    if dataset == "nq":
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f]
        return [
            Question(dataset, r["question"], (r["ctxs"][0]["text"],))
            for r in rows
            if quality.split_of(r["question"]) == "tune"
        ]
    items = (
        quality.load_hotpotqa(path, 1 << 30, False, 0, "tune")
        if dataset == "hotpotqa"
        else quality.load_chunked(path, 1 << 30, False, 0, "tune")
    )
    return [Question(dataset, it["question"], tuple(it["chunks"])) for it in items]


class PromptSampler:
    """Deterministic prompts: the ``i``-th draw depends on the seed and ``i`` alone, so a resumed run draws what
    the interrupted one would have."""

    def __init__(
        self,
        questions: list[Question],
        passages: tuple[int, ...],
        seed: int,
        too_long: Callable[[str, list[str]], bool] | None = None,
    ):
        assert questions, "no training questions"
        self.questions, self.passages, self.seed, self.too_long = questions, tuple(passages), seed, too_long
        self.pool: dict[str, list[str]] = {}
        for q in questions:
            self.pool.setdefault(q.dataset, []).extend(q.passages)
        for name in self.pool:
            self.pool[name] = list(dict.fromkeys(self.pool[name]))

    def draw(self, i: int) -> tuple[str, list[str]]:
        rng = random.Random(f"{self.seed}:{i}")
        epoch, at = divmod(i, len(self.questions))
        order = list(range(len(self.questions)))
        random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
        q = self.questions[order[at]]
        chunks = quality.mix_in(q.passages, self.pool[q.dataset], rng.choice(self.passages), rng)
        own = set(q.passages)
        while self.too_long is not None and self.too_long(
            q.question, chunks
        ):  # over the context: fewer distractors, then fewer passages
            distractors = [k for k, c in enumerate(chunks) if c not in own] or list(range(1, len(chunks)))
            if not distractors:
                break
            del chunks[distractors[-1]]
        return q.question, chunks
