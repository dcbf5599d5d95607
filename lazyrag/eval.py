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
from pathlib import Path

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
    # same run (bf16 batched matmuls round by batch shape), only on its group of questions (--batch and the seed)
    by_strategy = []
    for s in strategies:
        by_strategy.append(
            [engine.add_request(layout, SamplingParams(max_new_tokens, strategy=s)) for layout in layouts]
        )
        while engine.has_unfinished_requests():
            engine.step()
    requests = [list(reqs) for reqs in zip(*by_strategy)]
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


def run_eval(args, engine_options: dict | None = None) -> int:
    """``lazyrag eval``; ``engine_options``: EngineConfig fields the command line set (``--encoding-passage``)."""
    import torch
    from tqdm import tqdm

    from lazyrag.engine import EngineConfig, LazyEngine, SchedulerConfig
    from lazyrag.model.loader import resolve_model_source
    from lazyrag.prompt import passage_label, passage_sha256

    if args.dataset is None:  # nq where its file is (a clone beside shared/data), else a set a wheel ships
        args.dataset = "nq" if args.data or default_data("nq").is_file() else "squad"
        if args.dataset == "squad":
            print(
                "nq's file is not here (nq is not shipped with lazyrag): evaluating on squad; "
                "--dataset nq --data FILE for Natural Questions",
                file=sys.stderr,
            )
    path = args.data or default_data(args.dataset)
    if not path.is_file():
        if args.data:
            print(f"error: --data {path}: no such file", file=sys.stderr)
        elif args.dataset in DATA_FORMATS:
            print(
                f"error: {args.dataset} is not shipped with lazyrag; pass its file with --data: "
                f"{DATA_FORMATS[args.dataset]}. squad, 2wiki and musique run without --data.",
                file=sys.stderr,
            )
        else:
            print(f"error: {path} not found; pass --data FILE", file=sys.stderr)
        return 2
    if path.parent == SAMPLES:
        print(
            f"{args.dataset}: the {path.name} shipped with lazyrag ({sum(1 for _ in _open_text(path))} questions); "
            "--data FILE for the full set",
            file=sys.stderr,
        )
    passages = getattr(args, "passages", None)
    distractors = passages - 1 if passages and args.dataset == "nq" else args.distractors
    items = load_dataset(
        args.dataset, path, args.n, split=args.split, seed=args.seed, shuffle=args.shuffle, distractors=distractors
    )
    if passages and args.dataset != "nq":
        pool = load_dataset(args.dataset, path, 1 << 30, split=args.split, seed=args.seed)
        items = with_passages(items, pool, passages, args.seed)
    strategies = args.strategies.split(",")
    if getattr(args, "skip_answered", None):
        answered = answered_questions(args.skip_answered, strategies)
        kept = [it for it in items if it["question"] not in answered]
        print(f"--skip-answered: {len(items) - len(kept)} of {len(items)} questions already answered by every strategy")
        items = kept
        if not items:
            print("nothing left to score: no report written")
            return 0
    # a batch's questions run as one continuous batch per strategy (_score_group)
    engine_kwargs = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        adapter=getattr(args, "adapter", None),
        scheduler=SchedulerConfig(max_running=max(64, args.batch * len(strategies))),
        **(engine_options or {}),
    )
    if args.kv_budget is not None:
        engine_kwargs["kv_budget"] = args.kv_budget  # bytes (the CLI parsed the size)
    if args.eager:
        engine_kwargs.update(cuda_graphs=False, compile_elementwise=False, triton_elementwise=False)
    if args.store is not None:  # retrieval mode: each question's top-k chunks of the corpus, their KV from the store
        from lazyrag.store.retriever import Retriever

        retriever = Retriever(args.store, getattr(args, "embedder", None))  # None: the store's, if a packaged one
        for item, hits in zip(items, retriever.retrieve_batch([it["question"] for it in items], args.k)):
            item["chunks"] = [h.text for h in hits]
    config = EngineConfig(**engine_kwargs)  # the device and dtype the engines resolve to
    device = config.device
    assert isinstance(device, torch.device)  # __post_init__ resolved it
    model_name = resolve_model_source(args.model).name
    run = {
        "dataset": args.dataset,
        "data": path.name,
        "n": args.n,
        "split": args.split,
        "seed": args.seed,
        "strategies": strategies,
        "max_new_tokens": args.max_new_tokens,
        "model": model_name,
        "device": device.type,
        "dtype": str(config.dtype).replace("torch.", ""),
        "encoding_passage": passage_label(config.encoding_passage),
        "encoding_passage_sha256": passage_sha256(
            config.encoding_passage
        ),  # a resume under another default's text is refused
        **({"distractors": distractors} if args.dataset == "nq" else {"shuffle": args.shuffle}),
        **({"passages": passages} if passages else {}),
        **({"store": str(args.store), "k": args.k} if args.store is not None else {}),
        **(
            {"skip_answered": sorted(p.name for p in args.skip_answered)}
            if getattr(args, "skip_answered", None)
            else {}
        ),
    }
    try:
        checkpoint = Checkpoint(args.out.with_suffix(".partial.jsonl"), run, args.resume)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    todo = [i for i in range(len(items)) if i not in checkpoint.rows]
    if len(todo) < len(items):
        print(f"resuming: {len(items) - len(todo)} of {len(items)} questions already scored ({checkpoint.path})")
    left = [items[i] for i in todo]

    def save(first: int, rows: dict[str, list[dict]]) -> None:  # ``first``: index into ``left``
        checkpoint.add(todo[first : first + len(rows[strategies[0]])], rows)

    t = time.time()
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    if left and args.workers > 1:
        store = None if args.store is None else str(getattr(args.store, "path", args.store))
        gpus = torch.cuda.device_count() if device.type == "cuda" and device.index is None else 1
        score_parallel(
            engine_kwargs,
            left,
            strategies,
            args.max_new_tokens,
            args.batch,
            args.workers,
            store,
            deadline=deadline,
            gpus=gpus,
            on_group=save,
        )
    elif left:
        engine = LazyEngine.from_pretrained(**engine_kwargs)
        if args.store is not None:
            engine.attach_store(args.store)
        bar = tqdm(total=len(left), desc="eval", unit="question")

        def save_and_count(first: int, rows: dict[str, list[dict]]) -> None:
            save(first, rows)
            bar.update(len(rows[strategies[0]]))

        score(
            engine,
            left,
            strategies,
            args.max_new_tokens,
            args.batch,
            deadline=deadline,
            on_group=save_and_count,
        )
        bar.close()
    per = checkpoint.per_strategy(strategies)
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
            "dataset": args.dataset,
            "split": args.split,
            "n": done,
            "n_asked": len(items),
            "model": model_name,
            "device": _device_name(device),
            "dtype": str(config.dtype).replace("torch.", ""),
            "encoding_passage": run["encoding_passage"],
            "workers": args.workers,
            "resumed": len(items) - len(todo),
            "command": "lazyrag " + " ".join(sys.argv[1:]),
            "seconds": time.time() - t,
            "mode": "retrieval" if args.store is not None else "oracle",
            "passages": passages,
            "adapter": getattr(args, "adapter", None),
        }
    )
    print(
        f"\n{args.dataset} ({args.split}), n={done}, {model_name} on {result['device']}, {result['dtype']}, "
        f"{result['seconds']:.0f} s"
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
                f"warning: {m['failed']} {s} requests failed and scored 0 (their errors are in {args.out})",
                file=sys.stderr,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    wrote = f"wrote {args.out}"
    try:
        plot(result["summary"], args.out.with_suffix(".png"), f"{args.dataset} ({args.split}) n={done}, {model_name}")
        wrote += f" and {args.out.with_suffix('.png')}"
    except ModuleNotFoundError as e:  # plotting is an extra: the table and the JSON are the result
        wrote += f" (no plot: {e.name} is not installed; pip install 'lazyrag[bench]' for one)"
    print(wrote)
    if done == len(items):
        checkpoint.path.unlink()  # everything is in --out now
    return 0
