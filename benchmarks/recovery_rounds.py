"""Recompute in rounds with a stop on the question's output distribution (issue 30): does spending the recompute
where the answer still moves beat one fixed share for every question, on every set's tune part?

``lazy:blend=S:select=attn_dev:upto=U:stop_kl=K`` recomputes rounds of S (a share of the chunk tokens) up to U in
all, and stops once a round moved the question's next-token distribution by less than K nats (engine/blend.py
``recompute_in_rounds``). The rounds are nested (round k+1 starts from round k's context, and a threshold only
decides where to stop), so one pass per item measures every threshold at once: per item, the state after k rounds
(k = 0 is plain lazy, k = 1..U/S) is run teacher-forced with ``stop_kl=0``; its KL to full prefill (recovery_proxy.py's
per-token KL over full's greedy answer) and its first-token distribution, whose change from round k-1 to k is what
the stop reads. A threshold K then stops each item at its first round k >= 1 whose change is below K.

Two ways to run the rounds ("chains"): ``rounds`` is recompute_in_rounds (round k+1 adds its tokens to round k's
context, so earlier tokens read the stale K/V of those recomputed later); ``restart`` recomputes all of round k's
share again in one round (``lazy:blend=k*S:select=attn_dev``, which at 0.15 is ``lazy+recover``), paying every
round before it again: a stop there saves compute only where it stops at round 1.

Printed and written: per set and on the mean over sets, for each chain the fixed shares (every item stopped after k
rounds), the threshold sweep (mean share recomputed, mean compute, mean KL), ``lazy+recover`` for reference, and
the threshold chosen (the lowest mean KL whose mean share over the sets is <= --budget), with a PNG of KL against
share.

    .venv/bin/python benchmarks/recovery_rounds.py --n 16 --step 0.075 --upto 0.3 \\
        --out benchmarks/results/recovery_rounds_cpu.json
"""
import argparse
import importlib.util
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
from lazyrag.eval import DATASETS, default_data, load_dataset  # noqa: E402
from lazyrag.strategy_names import RECOVER, RECOVER_AS  # noqa: E402

_spec = importlib.util.spec_from_file_location("recovery_proxy", Path(__file__).with_name("recovery_proxy.py"))
proxy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proxy)


def rounds_strategy(step: float, upto: float, stop_kl: float) -> str:
    return f"lazy:blend={step:g}:select=attn_dev:upto={upto:g}:stop_kl={stop_kl:g}"


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) of two log-prob vectors."""
    return float((p.exp() * (p - q)).sum())


def stopped_at(moves: list[float], threshold: float) -> int:
    """The round an item stops after: the first k >= 1 whose change (moves[k - 1]) is below the threshold."""
    return next((k for k, m in enumerate(moves, start=1) if m < threshold), len(moves))


def policy(items: list[dict], chain: str, threshold: float | None = None, k: int | None = None) -> dict:
    """Mean KL to full and mean share recomputed when every item stops after k rounds, or where the threshold says."""
    chains = [it[chain] for it in items]
    at = [k if threshold is None else stopped_at(c["moves"], threshold) for c in chains]
    kls = torch.tensor([c["kl"][a] for c, a in zip(chains, at)])
    n = len(items)
    return {"kl": float(kls.mean()), "kl_se": float(kls.std() / math.sqrt(n)) if n > 1 else float("nan"),
            "recomputed": 100 * sum(c["recomputed"][a] for c, a in zip(chains, at)) / n,
            "cost": 100 * sum(c["cost"][a] for c, a in zip(chains, at)) / n, "rounds": sum(at) / n}


# rounds: recompute_in_rounds (each round adds tokens to the last one's context); restart: each round recomputes
# all its tokens again in one round (the one-round strategy at k x step, its cost summed over the rounds run)
CHAINS = ("rounds", "restart")


def analyse(rows: dict, sets: list[str], budget: float) -> dict:
    def mean_over_sets(per: dict) -> dict:
        return {key: sum(p[key] for p in per.values()) / len(per) for key in next(iter(per.values())) if key != "kl_se"}

    out = {"budget": budget}
    for chain in [c for c in CHAINS if chain_in(rows, sets, c)]:
        K = len(rows[sets[0]][0][chain]["kl"]) - 1
        moves = sorted({m for s in sets for it in rows[s] for m in it[chain]["moves"]})
        thresholds = sorted({0.0, math.inf, *(moves[int(q * (len(moves) - 1))] for q in torch.linspace(0, 1, 41).tolist())})
        res = {"fixed": {}, "thresholds": {}}
        for k in range(K + 1):
            per = {s: policy(rows[s], chain, k=k) for s in sets}
            res["fixed"][k] = {"sets": per, "mean": mean_over_sets(per)}
        for t in thresholds:
            per = {s: policy(rows[s], chain, threshold=t) for s in sets}
            res["thresholds"][f"{t:.6g}"] = {"sets": per, "mean": mean_over_sets(per)}
        # does a round that moved the question's next token little mean the next round gains little (what a stop assumes)?
        items = [it[chain] for s in sets for it in rows[s]]
        res["move_vs_next_gain"] = {k: spearman([c["moves"][k - 1] for c in items], [c["kl"][k] - c["kl"][k + 1] for c in items])
                                    for k in range(1, K)}
        fits = {t: r for t, r in res["thresholds"].items() if r["mean"]["recomputed"] <= budget}
        res["chosen"] = min(fits, key=lambda t: fits[t]["mean"]["kl"]) if fits else None
        out[chain] = res
    per = {s: proxy.summarize([it["recover"] for it in rows[s]]) for s in sets}
    out["recover"] = {"sets": per, "mean": mean_over_sets(per)}
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists."""
    ra, rb = (torch.tensor(x).argsort().argsort().double() for x in (a, b))
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def chain_in(rows: dict, sets: list[str], chain: str) -> bool:
    return all(chain in it for s in sets for it in rows[s])


def print_tables(res: dict, sets: list[str], file=sys.stdout) -> None:
    head = f"{'policy':<40} " + " ".join(f"{s:>16}" for s in sets) + f" {'mean KL':>8} {'recomp %':>8} {'cost %':>7} {'rounds':>6}"
    print(head, file=file)

    def line(label: str, r: dict) -> None:
        cells = " ".join(f"{r['sets'][s]['kl']:.4f} @{r['sets'][s]['recomputed']:4.1f}%" for s in sets)
        m = r["mean"]
        print(f"{label:<40} {cells} {m['kl']:8.4f} {m['recomputed']:8.1f} {m['cost']:7.1f} {m.get('rounds', 1):6.2f}", file=file)

    line(f"one round: {RECOVER}", res["recover"])
    for chain in CHAINS:
        if chain not in res:
            continue
        for k, r in res[chain]["fixed"].items():
            line(f"{chain}: {k} round(s), every item", r)
        for t, r in res[chain]["thresholds"].items():
            line(f"{chain}: stop_kl={t}" + (" (chosen)" if t == res[chain]["chosen"] else ""), r)
        print(f"{chain}: rank correlation of round k's move with round k+1's KL gain, over all items: "
              + ", ".join(f"k={k}: {c:+.2f}" for k, c in res[chain]["move_vs_next_gain"].items()), file=file)


def plot(res: dict, sets: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True)
    for ax, s in zip(axes.flat, sets + ["mean"]):
        get = (lambda r: r["mean"]) if s == "mean" else (lambda r, s=s: r["sets"][s])
        for chain, style in zip(CHAINS, ("C0", "C1")):
            if chain not in res:
                continue
            fx = [get(r) for r in res[chain]["fixed"].values()]
            th = sorted((get(r) for r in res[chain]["thresholds"].values()), key=lambda r: r["recomputed"])
            ax.plot([r["recomputed"] for r in fx], [r["kl"] for r in fx], "o-", color=style, label=f"{chain}: every item k rounds")
            ax.plot([r["recomputed"] for r in th], [r["kl"] for r in th], ".:", color=style, label=f"{chain}: stop on the question's KL")
            if res[chain]["chosen"] is not None:
                c = get(res[chain]["thresholds"][res[chain]["chosen"]])
                ax.plot([c["recomputed"]], [c["kl"]], "s", color=style, ms=8, label=f"{chain}: chosen stop_kl={res[chain]['chosen']}")
        rec = get(res["recover"])
        ax.plot([rec["recomputed"]], [rec["kl"]], "k*", ms=12, label="lazy+recover")
        ax.axvline(res["budget"], color="grey", lw=0.8, ls=":")
        ax.set_title("mean over the sets" if s == "mean" else f"{s} (tune part)")
        ax.set_xlabel("chunk tokens recomputed, %")
        ax.set_ylabel("KL to full per answer token")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16, help="questions per set, from its tune part (default: %(default)s)")
    ap.add_argument("--sets", default=",".join(DATASETS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--step", type=float, default=0.075, help="a round's share of the chunk tokens (default: %(default)s)")
    ap.add_argument("--upto", type=float, default=0.3, help="the most recomputed in all (default: %(default)s)")
    ap.add_argument("--budget", type=float, default=15.0, help="mean %% recomputed the chosen threshold may use (default: %(default)s)")
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="JSON (with the per-item rows); a PNG beside it")
    ap.add_argument("--from-json", help="re-analyse the rows of an earlier --out instead of running")
    args = ap.parse_args()
    sets = args.sets.split(",")
    t0 = time.time()
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())["rows"]
        sets = [s for s in sets if rows.get(s)]
    else:
        rows = run(args, sets)
    res = analyse(rows, sets, args.budget)
    print_tables(res, sets)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args), "seconds": round(time.time() - t0),
                                              **res, "rows": rows}, indent=1))
        plot(res, sets, str(Path(args.out).with_suffix(".png")))


def run(args, sets: list[str]) -> dict:
    torch.set_num_threads(args.threads)
    e = LazyEngine.from_pretrained(None, device="cpu")
    K = round(args.upto / args.step)
    shares = [min(args.upto, k * args.step) for k in range(1, K + 1)]
    strategies = {"rounds": ["lazy"] + [rounds_strategy(args.step, u, 0) for u in shares],
                  # round 1 of both chains is the same strategy
                  "restart": ["lazy", rounds_strategy(args.step, shares[0], 0)] + [f"lazy:blend={u:g}:select=attn_dev" for u in shares[1:]]}
    recover = next((x for x in strategies["restart"] if x == RECOVER_AS), RECOVER)
    rows, t0 = {s: [] for s in sets}, time.time()
    for s in sets:
        items = load_dataset(s, default_data(s), args.n, split="tune", shuffle=s == "hotpotqa")
        for i, it in enumerate(items):
            e.cache.clear()
            layout = e.build_prompt(it["question"], it["chunks"])
            chunk_tokens = sum(map(len, layout.chunk_ids))
            answer, ref = proxy.full_greedy(e, layout, args.answer_tokens)
            if not answer:
                continue
            e.encode_chunks(layout.chunk_ids, layout.encoding_prefix)
            pref, measured = ref.exp(), {}
            for strategy in dict.fromkeys([*strategies["rounds"], *strategies["restart"], recover]):
                lp, rec, cost = proxy.teacher_forced(e, layout, strategy, answer)
                measured[strategy] = ({"kl": float((pref * (ref - lp)).sum(-1).mean()),
                                       "top1": float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
                                       "recomputed": rec / chunk_tokens, "cost": cost / chunk_tokens}, lp[0])
            row = {"recover": measured[recover][0]}
            for chain, names in strategies.items():
                got = [measured[x] for x in names]
                cost = [m["cost"] for m, _ in got]
                row[chain] = {"kl": [m["kl"] for m, _ in got], "recomputed": [m["recomputed"] for m, _ in got],
                              # a restart runs every round before it in full
                              "cost": cost if chain == "rounds" else [sum(cost[: k + 1]) for k in range(len(cost))],
                              "moves": [kl(got[k][1], got[k - 1][1]) for k in range(1, len(got))]}
            rows[s].append(row)
            print(f"{s} {i + 1}/{len(items)} {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        done = [x for x in sets if rows[x]]
        print_tables(analyse(rows, done, args.budget), done, file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
