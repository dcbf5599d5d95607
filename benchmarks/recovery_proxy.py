"""How far each recovery variant's answer distribution is from full prefill's, on every QA set's tune part (issue 30).

A cheap proxy for answer quality, run before any accuracy eval (issue 14's `recovery_kl.py`, archived at 32eec34,
ported to today's engine and to the five sets). Per item: full prefill's greedy answer (``--answer-tokens``), then
each variant runs the question and that answer teacher-forced over its own context; reported per set and on the
mean over sets: mean per-token KL(full || variant) with its standard error, top-1 agreement with full's greedy
tokens, chunk tokens recomputed and compute (selection passes included), in % of chunk tokens.

A variant is a strategy, run by an engine that encodes chunks after the prompt's prefix and the encoding passage
(``lazy``: the default since issue 30, prompt.py's DEFAULT_ENCODING_PASSAGE), or after the prefix alone
(``lazy@none``: ``encoding_passage=None``, the engine before it), or after the first of the passage's three
documents alone (``lazy@one``).

    .venv/bin/python benchmarks/recovery_proxy.py --n 16 [--sets nq,hotpotqa,squad,2wiki,musique]
        [--variants lazy,lazy@none,...] [--out benchmarks/results/recovery_proxy_cpu.json]
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# the repository, not benchmarks/ (its kernels.py would shadow the `kernels` package transformers imports)
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from lazyrag.engine import LazyEngine  # noqa: E402
from lazyrag.engine.runner import SeqState  # noqa: E402
from lazyrag.eval import DATASETS, default_data, load_dataset  # noqa: E402
from lazyrag.kv.block_pool import blocks_for  # noqa: E402
from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE  # noqa: E402

# ``@one``: the first of the default passage's three documents alone (71 tokens), the default of 8693e4f.
ENCODINGS = {
    "passage": {},
    "none": {"encoding_passage": None},
    "one": {"encoding_passage": DEFAULT_ENCODING_PASSAGE.split("\n\n")[0]},
}  # engine options
DEFAULT = [
    "lazy@none",
    "lazy",
    "lazy+recover@none",
    "lazy+recover",
    "lazy:blend=0.15:select=attn@none",
    "lazy:blend=0.15:select=attn",
]


def parse_variant(label: str) -> tuple[str, str]:
    strategy, _, encoding = label.partition("@")
    encoding = encoding or "passage"
    assert encoding in ENCODINGS, f"unknown encoding {encoding!r}: {', '.join(ENCODINGS)}"
    return strategy, encoding


@torch.inference_mode()
def teacher_forced(e: LazyEngine, layout, strategy: str, answer: list[int]):
    """Log-probs [A, V] at each answer position given the prompt and the answer before it; the plan's recompute."""
    runner, planner = e.runner, e.scheduler.planner[strategy]
    plan = planner.plan(layout)
    blocks = []
    try:
        new = list(plan.new_ids) + answer[:-1]
        blocks = e.cache.allocate(blocks_for(len(new), e.cache.pool.shape.block_size))
        seq = SeqState(context=plan.context, blocks=blocks, next_pos=plan.new_start)
        batch = runner._batch([seq], [0], new, [len(new)], is_decode=False)  # nothing of its own written yet
        ids, positions, meta = batch.to_device(runner.device)
        hidden = runner.model(ids, positions, runner._runtime(meta))  # [len(new), hidden]
        logp = runner.model.logits(hidden[-len(answer) :]).float().log_softmax(-1).cpu()  # [A, V]
        return logp, plan.tokens_recomputed, plan.recompute_cost
    finally:
        if blocks:
            e.cache.pool.decref(blocks)
        planner.release(plan)


@torch.inference_mode()
def full_greedy(e: LazyEngine, layout, n: int):
    """Full prefill's greedy answer (up to ``n`` tokens, end token excluded) and its log-probs [A, V]."""
    runner = e.runner
    ids = layout.full_ids()
    blocks = e.cache.allocate(blocks_for(len(ids) + n, e.cache.pool.shape.block_size))
    try:
        seq = SeqState(context=[], blocks=blocks, next_pos=0)
        logits = runner.prefill([seq], [ids])
        answer, logps, end = [], [], e.scheduler.end_tokens
        while True:
            lp = logits[0].float().log_softmax(-1).cpu()
            tok = int(lp.argmax())
            if tok in end or len(answer) == n:
                break
            answer.append(tok)
            logps.append(lp)
            logits = runner.decode([seq], [tok])
        return answer, torch.stack(logps) if logps else None
    finally:
        e.cache.pool.decref(blocks)


def summarize(rows: list[dict]) -> dict:
    kl = torch.tensor([r["kl"] for r in rows])
    n = len(rows)
    return {
        "n": n,
        "kl": float(kl.mean()),
        "kl_se": float(kl.std() / math.sqrt(n)) if n > 1 else float("nan"),
        "top1": 100 * sum(r["top1"] for r in rows) / n,
        "recomputed": 100 * sum(r["recomputed"] for r in rows) / n,
        "cost": 100 * sum(r["cost"] for r in rows) / n,
    }


def report(args, labels, rows, seconds, file=sys.stdout) -> dict:
    """The table per set and the mean over sets (and, with --out, the JSON) of the items done so far."""
    sets = [s for s in args.sets.split(",") if rows[s][labels[0]]]
    out = {"command": " ".join(sys.argv), "args": vars(args), "seconds": round(seconds), "sets": {}, "mean": {}}
    print(f"{args.answer_tokens} answer tokens, tune parts, {seconds:.0f} s", file=file)
    print(
        f"{'variant':<40} "
        + " ".join(f"{s + ' (' + str(len(rows[s][labels[0]])) + ')':>14}" for s in sets)
        + f" {'mean KL':>8} {'mean top1':>9} {'recomp %':>8} {'cost %':>6}",
        file=file,
    )
    for lab in labels:
        per = {s: summarize(rows[s][lab]) for s in sets}
        mean = {k: sum(p[k] for p in per.values()) / len(per) for k in ("kl", "top1", "recomputed", "cost")}
        for s in sets:
            out["sets"].setdefault(s, {})[lab] = per[s]
        out["mean"][lab] = mean
        cells = " ".join(f"{per[s]['kl']:7.4f}+-{per[s]['kl_se']:.3f}" for s in sets)
        print(
            f"{lab:<40} {cells} {mean['kl']:8.4f} {mean['top1']:9.1f} {mean['recomputed']:8.1f} {mean['cost']:6.1f}",
            file=file,
        )
    if args.out:
        out["rows"] = rows
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16, help="questions per set, from its tune part (default: %(default)s)")
    ap.add_argument("--sets", default=",".join(DATASETS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT),
        help=f"STRATEGY[@ENCODING], comma-separated; encodings: {', '.join(ENCODINGS)} (default: %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    labels = args.variants.split(",")
    variants = {lab: parse_variant(lab) for lab in labels}
    torch.set_num_threads(args.threads)
    engines = {
        enc: LazyEngine.from_pretrained(None, device="cpu", **ENCODINGS[enc])
        for enc in dict.fromkeys(v[1] for v in variants.values())
    }
    e = next(iter(engines.values()))  # full prefill's reference: the encoding changes no full prefill
    sets = args.sets.split(",")
    rows = {s: {lab: [] for lab in labels} for s in sets}
    t0 = time.time()
    for s in sets:
        items = load_dataset(s, default_data(s), args.n, split="tune", shuffle=s == "hotpotqa")
        for i, it in enumerate(items):
            for engine in engines.values():
                engine.cache.clear()
            layout = e.build_prompt(it["question"], it["chunks"])
            chunk_tokens = sum(map(len, layout.chunk_ids))
            answer, ref = full_greedy(e, layout, args.answer_tokens)
            if not answer:
                continue
            for engine in engines.values():
                engine.encode_chunks(layout.chunk_ids, layout.encoding_prefix)
            pref = ref.exp()
            for lab, (strategy, enc) in variants.items():
                lp, rec, cost = teacher_forced(engines[enc], layout, strategy, answer)
                kl = (pref * (ref - lp)).sum(-1)  # [A]
                rows[s][lab].append(
                    {
                        "kl": float(kl.mean()),
                        "top1": float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
                        "recomputed": rec / chunk_tokens,
                        "cost": cost / chunk_tokens,
                    }
                )
            print(f"{s} {i + 1}/{len(items)} {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        report(args, labels, rows, time.time() - t0, file=sys.stderr)
    report(args, labels, rows, time.time() - t0)


if __name__ == "__main__":
    main()
