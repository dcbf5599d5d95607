"""Multi-token, teacher-forced proxy for answer quality: how far each quality-recovery variant's answer
distribution is from full prefill's, over full prefill's own greedy answer (issue 14).

Per item: full prefill generates its greedy answer (``--answer-tokens``, default 12). Each variant then
runs the question and that answer as new tokens over its context (lazy, blended, ...), teacher-forced, and
we compare its next-token distribution with full's at every answer position: mean per-token
KL(full || variant), first-token KL (blend_kl.py's proxy) and top-1 agreement (the variant's argmax is
full's greedy token). Chunks are encoded once per item and shared by every variant. Recompute is counted
as in eval.py: tokens recomputed / chunk tokens, and compute (selection passes included) / chunk tokens.

    python benchmarks/recovery_kl.py --n 40 [--dataset hotpotqa --shuffle] [--variants lazy,blend15,...]
        [--data /work/shared/data] [--out benchmarks/results/recovery_kl_nq40.json]

Variants are named in VARIANTS below: a strategy name plus experiment knobs (engine/blend.py's module
constants, and APE-style attention temperature/scaling on the chunks for the new tokens, which is an
experiment here only: APEAttention below, torch path).
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lazyrag.engine.blend as blend  # noqa: E402
from lazyrag.engine import LazyEngine  # noqa: E402
from lazyrag.engine.runner import SeqState  # noqa: E402
from lazyrag.eval import DATA, load_hotpotqa, load_nq  # noqa: E402
from lazyrag.kernels import reference  # noqa: E402
from lazyrag.kv.block_pool import blocks_for  # noqa: E402
from lazyrag.model.attention import TorchAttention  # noqa: E402


class APEAttention(TorchAttention):
    """APE (Yang et al., ICLR'25) for the new tokens: their attention logits to chunk keys (every context
    key past the first ``prefix_blocks`` blocks) are divided by ``temperature`` and the chunks' weights
    multiplied by ``scale`` before the joint softmax: p ~ [exp(l_prefix), S * exp(l_chunk / T), exp(l_new)]."""

    def __init__(self, prefix_blocks: int, temperature: float, scale: float):
        self.prefix_blocks, self.t, self.s = prefix_blocks, temperature, scale

    def __call__(self, q, k, v, k_cache, v_cache, meta, rope_cos, rope_sin, sm_scale):
        assert not meta.is_decode and meta.block_meta.shape[0] == 1
        width = int(meta.num_ctx_blocks.max())
        kc, vc, ok = reference.gather_contexts(k_cache, v_cache, meta.block_meta[:, :width], meta.num_ctx_blocks, rope_cos, rope_sin)
        kc, vc, ok = kc[0], vc[0], ok[0]
        bs = k_cache.shape[1]
        chunk = torch.arange(len(ok), device=ok.device) >= self.prefix_blocks * bs
        n = q.shape[0]  # the new tokens: not in the context rows (the forward passes no own tokens)
        kc = torch.where(chunk[:, None, None], kc / self.t, kc)
        bias = torch.where(chunk, math.log(self.s), 0.0).masked_fill(~ok, float("-inf"))
        causal = torch.zeros(n, n, device=q.device).masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        mask = torch.cat((bias[None].expand(n, -1), causal), 1)  # [n, N + n] additive
        group = q.shape[1] // k.shape[1]
        keys = torch.cat((kc, k.float())).repeat_interleave(group, 1)
        vals = torch.cat((vc, v.float())).repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                                               vals.transpose(0, 1)[None], attn_mask=mask[None, None], scale=sm_scale)
        return out[0].transpose(0, 1).to(q.dtype)


# label: (strategy, knobs). Knobs: layer (SELECTION_LAYER), attn_layers (ATTN_LAYERS), factor (GRADUAL_FACTOR),
# ape (temperature, scale)
VARIANTS = {
    "lazy": ("lazy", {}),
    "first=32": ("lazy:first=32", {}),
    "blend=0.1": ("lazy:blend=0.1", {}),
    "blend=0.15": ("lazy:blend=0.15", {}),
    "blend=0.2": ("lazy:blend=0.2", {}),
    "blend=0.3": ("lazy:blend=0.3", {}),
    "attn 0.15": ("lazy:blend=0.15:select=attn", {}),
    "attn 0.15 L0-10": ("lazy:blend=0.15:select=attn", {"attn_layers": (0, 10)}),
    "attn 0.15 L10-20": ("lazy:blend=0.15:select=attn", {"attn_layers": (10, 20)}),
    "attn 0.15 L20-30": ("lazy:blend=0.15:select=attn", {"attn_layers": (20, 30)}),
    "attn 0.15 L1-2": ("lazy:blend=0.15:select=attn", {"attn_layers": (1, 2)}),
    "attn 0.1": ("lazy:blend=0.1:select=attn", {}),
    "attn 0.2": ("lazy:blend=0.2:select=attn", {}),
    "attn*dev 0.15": ("lazy:blend=0.15:select=attn_dev", {}),
    "attn*dev 0.1": ("lazy:blend=0.1:select=attn_dev", {}),
    "attn*dev 0.2": ("lazy:blend=0.2:select=attn_dev", {}),
    "attn*dev 0.15 L20-30": ("lazy:blend=0.15:select=attn_dev", {"attn_layers": (20, 30)}),
    "first=4 attn*dev 0.12": ("lazy:first=4:blend=0.12:select=attn_dev", {}),
    "attn*dev 0.15 ape S0.8": ("lazy:blend=0.15:select=attn_dev", {"ape": (1.0, 0.8)}),
    "gradual 0.15": ("lazy:blend=0.15:select=gradual", {}),
    "gradual 0.15 x3": ("lazy:blend=0.15:select=gradual", {"factor": 3.0}),
    "first=8 blend=0.1": ("lazy:first=8:blend=0.1", {}),
    "first=4 blend=0.12": ("lazy:first=4:blend=0.12", {}),
    "first=4 attn 0.12": ("lazy:first=4:blend=0.12:select=attn", {}),
    "ape T1 (check)": ("lazy", {"ape": (1.0, 1.0)}),
    "ape T0.9": ("lazy", {"ape": (0.9, 1.0)}),
    "ape T0.8": ("lazy", {"ape": (0.8, 1.0)}),
    "ape T0.7": ("lazy", {"ape": (0.7, 1.0)}),
    "ape S0.8": ("lazy", {"ape": (1.0, 0.8)}),
    "ape T0.9 S0.8": ("lazy", {"ape": (0.9, 0.8)}),
    "ape S0.6": ("lazy", {"ape": (1.0, 0.6)}),
    "ape T1.1": ("lazy", {"ape": (1.1, 1.0)}),
}
DEFAULT = ["lazy", "blend=0.15", "blend=0.2", "attn 0.15", "attn*dev 0.15", "gradual 0.15", "first=8 blend=0.1",
           "first=4 blend=0.12", "ape T0.9", "ape T0.8"]


@torch.inference_mode()
def teacher_forced(e: LazyEngine, layout, strategy: str, answer: list[int], ape=None):
    """Log-probs [A, V] of each answer token's position given the prompt and the answer before it; the plan."""
    runner = e.runner
    strat = e.scheduler.planner[strategy]
    plan = strat.plan(layout)
    blocks = []
    saved = runner.attention
    try:
        new = list(plan.new_ids) + answer[:-1]
        bs = e.cache.pool.shape.block_size
        blocks = e.cache.allocate(blocks_for(len(new), bs))
        seq = SeqState(context=plan.context, blocks=blocks, next_pos=plan.new_start)
        meta = runner._metadata([seq], [0], [len(new)], is_decode=False)
        if ape is not None and plan.context:
            runner.attention = APEAttention(len(plan.context[0].segment.blocks), *ape)
        ids = torch.tensor(new, device=runner.device)
        positions = torch.arange(plan.new_start, plan.new_start + len(new), device=runner.device)
        hidden = runner.model(ids, positions, runner._runtime(meta))
        logp = runner.model.logits(hidden[-len(answer):]).log_softmax(-1).cpu()
        return logp, plan.tokens_recomputed, plan.recompute_cost
    finally:
        runner.attention = saved
        if blocks:
            e.cache.pool.decref(blocks)
        strat.release(plan)


@torch.inference_mode()
def full_greedy(e: LazyEngine, layout, n: int):
    """Full prefill's greedy answer (up to ``n`` tokens, EOS excluded) and its log-probs [A, V] at each answer
    position: the prompt prefilled once, then decode steps (the teacher-forced reference, at no extra cost)."""
    runner, bs = e.runner, e.cache.pool.shape.block_size
    ids = layout.full_ids()
    blocks = e.cache.allocate(blocks_for(len(ids) + n, bs))
    try:
        seq = SeqState(context=[], blocks=blocks, next_pos=0)
        logits = runner.prefill([seq], [ids])
        answer, logps = [], []
        eos = e._end_tokens()
        while True:
            lp = logits[0].float().log_softmax(-1).cpu()
            tok = int(lp.argmax())
            if tok in eos or len(answer) == n:
                break
            answer.append(tok)
            logps.append(lp)
            logits = runner.decode([seq], [tok])
        return answer, torch.stack(logps) if logps else None
    finally:
        e.cache.pool.decref(blocks)


def report(args, labels, rows, seconds, file=sys.stdout):
    """The table (and, with --out, the JSON) over the items done so far."""
    n = len(rows[labels[0]])
    header = f"{args.dataset}{' shuffled' if args.shuffle else ''}, seed {args.seed}, n={n}, {args.answer_tokens} answer tokens, {seconds:.0f} s"
    print(header, file=file)
    print(f"{'variant':<24} {'KL/token':>8} {'+-se':>6} {'KL first':>8} {'top1 %':>6} {'recomp %':>8} {'cost %':>6}", file=file)
    summary = {}
    for lab in labels:
        r = rows[lab]
        kl = torch.tensor([x["kl"] for x in r])
        s = {"strategy": VARIANTS[lab][0], "knobs": {k: list(v) if isinstance(v, tuple) else v for k, v in VARIANTS[lab][1].items()},
             "kl": float(kl.mean()), "kl_se": float(kl.std() / math.sqrt(len(kl))),
             "kl_first": sum(x["kl0"] for x in r) / n, "top1": 100 * sum(x["top1"] for x in r) / n,
             "recomputed": 100 * sum(x["recomputed"] for x in r) / n, "cost": 100 * sum(x["cost"] for x in r) / n}
        summary[lab] = s
        print(f"{lab:<24} {s['kl']:8.4f} {s['kl_se']:6.4f} {s['kl_first']:8.4f} {s['top1']:6.1f} {s['recomputed']:8.1f} {s['cost']:6.1f}", file=file)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "header": header, "summary": summary, "rows": rows}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--dataset", default="nq", choices=("nq", "hotpotqa"))
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--variants", default=",".join(DEFAULT), help="labels of VARIANTS, comma-separated; 'all'")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out")
    args = ap.parse_args()
    labels = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    for lab in labels:
        assert lab in VARIANTS, f"unknown variant {lab!r}: {', '.join(VARIANTS)}"
    torch.set_num_threads(2)
    e = LazyEngine.from_pretrained(None, device="cpu")
    data = Path(args.data)
    if args.dataset == "nq":
        items = load_nq(data / "nq_open_oracle_2655.jsonl.gz", args.n, 4, args.seed)
    else:
        items = load_hotpotqa(data / "hotpotqa_dev_500.jsonl", args.n, args.shuffle, args.seed)
    defaults = (blend.SELECTION_LAYER, blend.ATTN_LAYERS, blend.GRADUAL_FACTOR)
    rows = {lab: [] for lab in labels}
    t0 = time.time()
    for i, it in enumerate(items):
        e.cache.clear()
        e.precache(it["chunks"])
        lay = e.build_prompt(it["question"], it["chunks"])
        chunk_tokens = sum(map(len, lay.chunk_ids))
        answer, ref = full_greedy(e, lay, args.answer_tokens)
        if not answer:
            continue
        pref = ref.exp()
        for lab in labels:
            strategy, knobs = VARIANTS[lab]
            blend.SELECTION_LAYER = knobs.get("layer", defaults[0])
            blend.ATTN_LAYERS = knobs.get("attn_layers", defaults[1])
            blend.GRADUAL_FACTOR = knobs.get("factor", defaults[2])
            lp, rec, cost = teacher_forced(e, lay, strategy, answer, knobs.get("ape"))
            kl = (pref * (ref - lp)).sum(-1)  # [A]
            rows[lab].append({"kl": float(kl.mean()), "kl0": float(kl[0]), "top1": float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
                              "recomputed": rec / chunk_tokens, "cost": cost / chunk_tokens, "chunk_tokens": chunk_tokens})
        blend.SELECTION_LAYER, blend.ATTN_LAYERS, blend.GRADUAL_FACTOR = defaults
        print(f"item {i + 1}/{len(items)} {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        if (i + 1) % 2 == 0:  # a partial table (and JSON) every 2 items, so a slow run still reports
            report(args, labels, rows, time.time() - t0, file=sys.stderr)
    report(args, labels, rows, time.time() - t0)

if __name__ == "__main__":
    main()
