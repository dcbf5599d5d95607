"""Build the compact QA evaluation sets under benchmarks/data/ from the public raw files.

Each output is a gzip'd JSONL, one item a line:

    {"id": str, "question": str, "answers": [str, ...],
     "chunks": [{"title": str, "text": str, "gold": bool}, ...]}

* ``squad``: SQuAD v1.1 dev, single-hop reading. Up to ``--n`` questions, at most 2 a paragraph, drawn
  over all 48 articles; chunks = the gold paragraph plus 4 paragraphs of other articles, shuffled.
  Input: the official ``dev-v1.1.json`` (``--squad-json``) or the official SQuAD explorer's rendering
  of it (``--squad-explorer``: the ``explore/1.1/dev/`` folder of rajpurkar/SQuAD-explorer's gh-pages
  branch, 48 article pages and index.html; the pages hold every paragraph, question id, question and
  ground-truth answer text of dev-v1.1.json, HTML-escaped).
* ``2wiki``: 2WikiMultihopQA dev, multi-hop: each item's 10 paragraphs in the given order, gold = its
  title is among the supporting facts' titles. Input (``--twowiki``): the original dev.json format as
  a JSON list, JSONL, or a pandas ``to_json`` column table of it (``_id`` may appear as ``_1``).
* ``musique`` (optional): MuSiQue-Ans dev records (JSONL or JSON list): each item's paragraphs in the
  given order, gold = ``is_supporting``; unanswerable items are skipped.

Deterministic: random.Random(SEED) only, gzip with mtime=0 and no file name, so two runs give
byte-identical files. Prints each set's statistics as JSON.

    python benchmarks/data/make_qa_sets.py --squad-explorer RAW/squad_explorer \\
        --twowiki RAW/2wiki/sampled_ds.json --musique RAW/musique.json --out benchmarks/data
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import io
import json
import random
import re
import statistics
import sys
from pathlib import Path

SEED = 20261203


# ---------------------------------------------------------------- readers


def _dedupe(xs):
    out = []
    for x in xs:
        if x not in out:
            out.append(x)
    return out


def read_squad_json(path: Path) -> list[dict]:
    """Articles ``[{"title", "paragraphs": [{"context", "qas": [{"id", "question", "answers": [str]}]}]}]``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    return [
        {
            "title": a["title"],
            "paragraphs": [
                {
                    "context": p["context"],
                    "qas": [
                        {"id": q["id"], "question": q["question"], "answers": [x["text"] for x in q["answers"]]}
                        for q in p["qas"]
                    ],
                }
                for p in a["paragraphs"]
            ],
        }
        for a in data
    ]


_PARA = re.compile(r'<div class="para-wrap">.*?<pre>(.*?)</pre>(.*?)(?=<div class="para-wrap">|\Z)', re.S)
_QA = re.compile(
    r'<div class="qa-wrap" data-id="([^"]*)"><p> <strong class="question">(.*?)</strong>'
    r'(.*?)<li class="prediction-holder">',
    re.S,
)
_ANSWER = re.compile(r'<span class="answer">(.*?)</span>', re.S)


def read_squad_explorer(folder: Path) -> list[dict]:
    """The same structure as ``read_squad_json``, from the SQuAD explorer pages (article order of index.html)."""
    folder = Path(folder)
    index = (folder / "index.html").read_text(encoding="utf-8")
    names = _dedupe(re.findall(r'href="/SQuAD-explorer/explore/1\.1/dev/([^"?]+)\.html"', index))
    articles = []
    for name in names:
        page = (folder / f"{name}.html").read_text(encoding="utf-8")
        title = html.unescape(re.search(r'<h1 id="title">(.*?)</h1>', page, re.S).group(1))
        paragraphs = []
        for context, rest in _PARA.findall(page):
            qas = [
                {
                    "id": html.unescape(qid),
                    "question": html.unescape(q),
                    "answers": [html.unescape(a) for a in _ANSWER.findall(block)],
                }
                for qid, q, block in _QA.findall(rest)
            ]
            paragraphs.append({"context": html.unescape(context), "qas": qas})
        assert paragraphs and page.count("<pre>") == len(paragraphs), name
        assert sum(len(p["qas"]) for p in paragraphs) == page.count('class="qa-wrap"'), name
        articles.append({"title": title, "paragraphs": paragraphs})
    return articles


def _read_records(path: Path) -> list[dict]:
    """A JSON list, JSONL, or a pandas ``to_json`` column table ``{"col": {"0": v, ...}}``, as records."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()):
        cols = list(data)
        keys = sorted(data[cols[0]], key=int)
        return [{c: data[c][k] for c in cols} for k in keys]
    return [data]


# ---------------------------------------------------------------- builders


def build_squad(articles: list[dict], n: int, distractors: int = 4, per_paragraph: int = 2) -> list[dict]:
    rng = random.Random(SEED)
    paras = [(ai, a["title"], p) for ai, a in enumerate(articles) for p in a["paragraphs"]]
    candidates = []
    for pi, (_, _, p) in enumerate(paras):
        for qi in rng.sample(range(len(p["qas"])), min(per_paragraph, len(p["qas"]))):
            candidates.append((pi, qi))
    chosen = rng.sample(candidates, min(n, len(candidates)))
    others = {ai: [j for j, (aj, _, _) in enumerate(paras) if aj != ai] for ai in range(len(articles))}
    items = []
    for pi, qi in chosen:
        ai, title, p = paras[pi]
        qa = p["qas"][qi]
        chunks = [{"title": title, "text": p["context"], "gold": True}]
        for j in rng.sample(others[ai], distractors):
            chunks.append({"title": paras[j][1], "text": paras[j][2]["context"], "gold": False})
        rng.shuffle(chunks)
        items.append({"id": qa["id"], "question": qa["question"], "answers": _dedupe(qa["answers"]), "chunks": chunks})
    return items


def build_twowiki(records: list[dict], n: int) -> list[dict]:
    if len(records) > n:
        records = random.Random(SEED).sample(records, n)
    items = []
    for r in records:
        gold_titles = {t for t, _ in r["supporting_facts"]}
        chunks = [
            {"title": t, "text": " ".join(s.strip() for s in sents if s.strip()), "gold": t in gold_titles}
            for t, sents in r["context"]
        ]
        assert any(c["gold"] for c in chunks), r.get("_id")
        answers = _dedupe([r["answer"]] + list(r.get("answer_aliases") or []))
        items.append({"id": r.get("_id", r.get("_1")), "question": r["question"], "answers": answers, "chunks": chunks})
    return items


def build_musique(records: list[dict], n: int) -> tuple[list[dict], int]:
    kept = [r for r in records if r.get("answerable", True)]
    skipped = len(records) - len(kept)
    if len(kept) > n:
        kept = random.Random(SEED).sample(kept, n)
    items = []
    for r in kept:
        chunks = [
            {"title": p["title"], "text": p["paragraph_text"], "gold": bool(p["is_supporting"])}
            for p in r["paragraphs"]
        ]
        assert any(c["gold"] for c in chunks), r["id"]
        items.append(
            {
                "id": r["id"],
                "question": r["question"],
                "answers": _dedupe([r["answer"]] + list(r.get("answer_aliases") or [])),
                "chunks": chunks,
            }
        )
    return items, skipped


# ---------------------------------------------------------------- output


def write_gz(items: list[dict], path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        for it in items:
            gz.write((json.dumps(it, ensure_ascii=False) + "\n").encode("utf-8"))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def stats(items: list[dict]) -> dict:
    chunks = [c for it in items for c in it["chunks"]]
    yes_no = sum(any(a.strip().lower() in ("yes", "no") for a in it["answers"]) for it in items)
    return {
        "items": len(items),
        "chunks": len(chunks),
        "median_chunks_per_item": statistics.median(len(it["chunks"]) for it in items),
        "min_max_chunks_per_item": [min(len(it["chunks"]) for it in items), max(len(it["chunks"]) for it in items)],
        "median_gold_per_item": statistics.median(sum(c["gold"] for c in it["chunks"]) for it in items),
        "median_words_per_chunk": statistics.median(len(c["text"].split()) for c in chunks),
        "median_answers_per_item": statistics.median(len(it["answers"]) for it in items),
        "yes_no_items": yes_no,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--squad-json", type=Path, help="official SQuAD dev-v1.1.json")
    src.add_argument("--squad-explorer", type=Path, help="SQuAD-explorer gh-pages explore/1.1/dev/ folder")
    ap.add_argument("--twowiki", type=Path, help="2WikiMultihopQA dev records (JSON list, JSONL or pandas table)")
    ap.add_argument("--musique", type=Path, help="MuSiQue-Ans dev records (JSONL or JSON list)")
    ap.add_argument("--n", type=int, default=1000, help="items per set at most (default 1000)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="benchmarks/data")
    args = ap.parse_args(argv)
    report = {}

    if args.squad_json or args.squad_explorer:
        if args.squad_json:
            articles, raw = read_squad_json(args.squad_json), {"sha256": sha256_file(args.squad_json)}
        else:
            files = ["index.html"] + sorted(
                p.name for p in args.squad_explorer.glob("*.html") if p.name != "index.html"
            )
            manifest = "".join(f"{sha256_file(args.squad_explorer / f)}  {f}\n" for f in files)
            articles, raw = (
                read_squad_explorer(args.squad_explorer),
                {"files": len(files), "sha256_of_manifest": hashlib.sha256(manifest.encode()).hexdigest()},
            )
        raw.update(
            articles=len(articles),
            paragraphs=sum(len(a["paragraphs"]) for a in articles),
            questions=sum(len(p["qas"]) for a in articles for p in a["paragraphs"]),
        )
        items = build_squad(articles, args.n)
        out = args.out / "squad" / f"squad_dev_{len(items)}.jsonl.gz"
        report["squad"] = {"raw": raw, "out": str(out), "sha256": write_gz(items, out), **stats(items)}

    if args.twowiki:
        records = _read_records(args.twowiki)
        items = build_twowiki(records, args.n)
        out = args.out / "2wiki" / f"2wiki_dev_{len(items)}.jsonl.gz"
        report["2wiki"] = {
            "raw": {"sha256": sha256_file(args.twowiki), "records": len(records)},
            "out": str(out),
            "sha256": write_gz(items, out),
            **stats(items),
        }

    if args.musique:
        records = _read_records(args.musique)
        items, skipped = build_musique(records, args.n)
        out = args.out / "musique" / f"musique_dev_{len(items)}.jsonl.gz"
        report["musique"] = {
            "raw": {"sha256": sha256_file(args.musique), "records": len(records), "skipped_unanswerable": skipped},
            "out": str(out),
            "sha256": write_gz(items, out),
            **stats(items),
        }

    if not report:
        ap.error("give at least one of --squad-json/--squad-explorer, --twowiki, --musique")
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
