"""What the stored KV dtype costs (issue 34): store bytes, logit error and answers, per dtype, side by side.

For each QA set (the eval's loaders: gold + distractor chunks) every question's chunks are pre-cached
into one corpus store per stored dtype (``precache``; chunks kept whole), and an engine with each store
attached answers every question with ``lazy``; or, ``--via host``, an engine per stored dtype keeps
chunk KV in a host-RAM tier of that dtype (each batch's chunks encoded, then pushed out of the pool into
the tier, so every request reads them back from it; no FAISS or embedder needed). Either way all chunk KV
is read back from the stored copy (misses are counted and must be 0), and we compare with float32, which
holds the engine's KV exactly: the first token's logit error (max |difference| over the logits' spread),
KL(float32 || dtype) and top-1 agreement, greedy answers identical to float32's, and accuracy / F1 with the paired
difference and its standard error. Separately, a store of the first ``--passages`` NQ passages (the issue's
300-passage example) is built in each dtype for its size on disk.

    python benchmarks/stored_kv.py --sets nq:200,hotpotqa:100,squad:100 --out benchmarks/results/stored_kv_cpu.json
    python benchmarks/stored_kv.py --via host --device cuda --dtype float32 --attention torch ... # the CPU's arithmetic
    python benchmarks/stored_kv.py --device cuda --stored auto,int8 ...  # a bf16 engine (auto = bf16)

Prints one table per set and writes JSON (every number, per question).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_sets import paired  # noqa: E402

from lazyrag.engine import LazyEngine, SamplingParams  # noqa: E402
from lazyrag.eval import accuracy, default_data, f1, load_dataset  # noqa: E402
from lazyrag.kv.formats import resolve_stored_dtype  # noqa: E402
from lazyrag.store.build import PrecacheConfig, precache  # noqa: E402
from lazyrag.store.retriever import load_embedder  # noqa: E402

REFERENCE = "float32"


def build_store(engine, embedder, inputs: list[str], out: Path, stored: str, limit: int | None = None) -> dict:
    t0 = time.perf_counter()
    # chunks kept whole (up to 2048 tokens), so every eval chunk is one stored chunk
    report = precache(
        engine,
        PrecacheConfig(
            inputs, str(out), chunk_tokens=2048, overlap=0, limit=limit, progress=False, stored_kv_dtype=stored
        ),
        embedder,
    )
    kv = sum(f.stat().st_size for f in (out / "kv").iterdir())
    return {
        "chunks": report.chunks,
        "tokens": report.tokens_encoded,
        "store_bytes": report.store_bytes,
        "kv_bytes": kv,
        "kv_bytes_per_token": kv / max(report.tokens_encoded, 1),
        "seconds": time.perf_counter() - t0,
    }


def answer_all(
    engine, items: list[dict], max_new_tokens: int, batch: int, via_host: bool
) -> tuple[list[torch.Tensor], list[str], int]:
    """First-token logits and greedy answers of ``lazy`` for every item, and the chunk misses (must be 0)."""
    logits, answers, missed = [], [], 0
    layouts = [engine.build_prompt(it["question"], it["chunks"]) for it in items]
    for s in range(0, len(layouts), batch):
        group = layouts[s : s + batch]
        if via_host:  # encode the group's chunks, then evict them: demoted into the host tier, encoded
            engine.encode_chunks([c for layout in group for c in layout.chunk_ids], group[0].encoding_prefix)
            engine.cache.clear()
        for layout in group:
            logits.append(engine.layout_logits(layout))
            if via_host:
                engine.cache.clear()  # every layout reads its chunks back from the tier
        reqs = [engine.add_request(layout, SamplingParams(max_new_tokens, strategy="lazy")) for layout in group]
        while engine.has_unfinished_requests():
            engine.step()
        for r in reqs:
            res = r.result()
            answers.append(res.text.strip())
            missed += res.stats.chunks_missed
    return logits, answers, missed


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    spread = float(ref.max() - ref.min())
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return {
        "rel_err": float((got - ref).abs().max()) / spread,
        "kl": float((p.exp() * (p - q)).sum()),
        "top1": float(ref.argmax() == got.argmax()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="nq:200,hotpotqa:100,squad:100", help="NAME:N,... (eval's datasets)")
    ap.add_argument(
        "--stored",
        default="float32,auto,bfloat16,int8",
        help="stored dtypes, the reference first; NAME#2 runs NAME again (a control: how far a rerun moves)",
    )
    ap.add_argument("--via", default="store", choices=["store", "host"], help="where the stored copy lives (see above)")
    ap.add_argument("--host-gib", type=float, default=8.0, help="--via host: the host tier's budget")
    ap.add_argument("--passages", type=int, default=300, help="NQ passages in the size-only store (0: none)")
    ap.add_argument(
        "--data", type=Path, default=None, help="a folder holding the nq and hotpotqa files (default: ../shared/data)"
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--dtype", default=None, help="the engine's compute dtype (default: float32 on CPU, bfloat16 on CUDA)"
    )
    ap.add_argument("--attention", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    kw = {k: v for k, v in (("device", args.device), ("dtype", args.dtype), ("attention", args.attention)) if v}
    if args.attention == "torch":
        kw.update(cuda_graphs=False, triton_elementwise=False, fused_kv_store=False, gemv=False)
    dtypes = [d.strip() for d in args.stored.split(",")]
    via_host = args.via == "host"
    if via_host:  # an engine per stored dtype, each with a host tier of that dtype
        from lazyrag.kv.cache import CacheConfig

        engines = {
            d: LazyEngine.from_pretrained(
                args.model,
                cache=CacheConfig(host_bytes=int(args.host_gib * 2**30), stored_kv_dtype=d.split("#")[0]),
                **kw,
            )
            for d in dtypes
        }
        engine, embedder = engines[dtypes[0]], None
        args.passages = 0  # store sizes need a store
    else:
        engine, embedder = LazyEngine.from_pretrained(args.model, **kw), load_embedder()
    compute = str(engine.dtype).removeprefix("torch.")
    resolved = {d: resolve_stored_dtype(d.split("#")[0], engine.dtype) for d in dtypes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    reference = dtypes[0]
    print(
        f"engine: {engine.model_name} on {engine.device}, {compute}; stored: "
        + ", ".join(f"{d} = {r}" for d, r in resolved.items())
        + f"; reference {reference}"
    )
    result = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else platform.processor() or "cpu",
        "engine_dtype": compute,
        "via": args.via,
        "stored": resolved,
        "reference": reference,
        "sets": {},
        "passages_store": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.passages:
            nq = default_data("nq") if args.data is None else args.data / default_data("nq").name
            for d in dtypes:
                result["passages_store"][d] = build_store(
                    engine, embedder, [str(nq)], tmp / f"nq{args.passages}-{d}", d.split("#")[0], limit=args.passages
                )
            print(f"\nstore of the first {args.passages} NQ passages:")
            for d, r in result["passages_store"].items():
                print(
                    f"  {d:<10} {r['store_bytes'] / 2**30:6.3f} GiB  "
                    f"({r['kv_bytes_per_token'] / 1024:5.1f} KiB KV a token, "
                    f"{r['kv_bytes'] / result['passages_store'][reference]['kv_bytes']:.3f}x {reference})"
                )
        for spec in args.sets.split(","):
            name, n = spec.split(":")
            path = default_data(name)
            if args.data is not None and name in ("nq", "hotpotqa"):
                path = args.data / path.name
            items = load_dataset(name, path, int(n))
            chunks = sorted({c for it in items for c in it["chunks"]})
            docs = tmp / f"{name}.jsonl"
            docs.write_text("".join(json.dumps({"id": f"{name}-{i}", "text": c}) + "\n" for i, c in enumerate(chunks)))
            per = {}
            for d in dtypes:
                t0 = time.perf_counter()
                if via_host:
                    e = engines[d]
                    logits, answers, missed = answer_all(e, items, args.max_new_tokens, args.batch, True)
                    host = e.cache.tiers[0]
                    held = host.held_tokens  # what the LRU budget still holds
                    size = {"kv_bytes": host.nbytes, "kv_bytes_per_token": host.nbytes / max(held, 1)}
                    e.cache.clear()
                else:
                    size = build_store(engine, embedder, [str(docs)], tmp / f"{name}-{d}", d.split("#")[0])
                    engine.cache.clear()
                    store = engine.attach_store(tmp / f"{name}-{d}")
                    try:
                        logits, answers, missed = answer_all(engine, items, args.max_new_tokens, args.batch, False)
                    finally:
                        engine.cache.tiers.remove(store)
                        engine.cache.clear()
                per[d] = {
                    "size": size,
                    "logits": logits,
                    "answers": answers,
                    "missed": missed,
                    "seconds": time.perf_counter() - t0,
                }
                print(
                    f"{name} {d}: {len(items)} questions, {missed} chunk misses, {per[d]['seconds']:.0f} s", flush=True
                )
            ref = per[reference]
            scores = {
                d: {
                    "acc": [accuracy(a, it["answers"]) for a, it in zip(per[d]["answers"], items)],
                    "f1": [f1(a, it["answers"]) for a, it in zip(per[d]["answers"], items)],
                }
                for d in dtypes
            }
            quality = paired(scores, reference)
            rows = {}
            for d in dtypes:
                cmp = [compare(a, b) for a, b in zip(ref["logits"], per[d]["logits"])]
                errs = sorted(c["rel_err"] for c in cmp)
                rows[d] = {
                    **quality[d],
                    "stored": resolved[d],
                    "chunk_misses": per[d]["missed"],
                    "kv_bytes_per_token": per[d]["size"]["kv_bytes_per_token"],
                    "kv_bytes_vs_reference": per[d]["size"]["kv_bytes_per_token"] / ref["size"]["kv_bytes_per_token"],
                    "logit_rel_err_median": statistics.median(errs),
                    "logit_rel_err_max": errs[-1],
                    "kl_mean": statistics.fmean(c["kl"] for c in cmp),
                    "top1_agree": statistics.fmean(c["top1"] for c in cmp),
                    "answers_identical": statistics.fmean(a == b for a, b in zip(per[d]["answers"], ref["answers"])),
                    "per_question": [
                        {"question": it["question"], "answer": a, "acc": s, **c}
                        for it, a, s, c in zip(items, per[d]["answers"], scores[d]["acc"], cmp)
                    ],
                }
            result["sets"][name] = rows
            # after every set: a run stopped in time keeps what it did
            args.out.write_text(json.dumps(result, indent=1))
            print(f"\n{name} (n={len(items)}), against {reference} ({args.via}):")
            print(
                f"{'stored':<10}{'KV B/tok':>9}{'size':>7}{'err med':>10}{'err max':>10}{'KL mean':>10}{'top1':>7}"
                f"{'same ans':>9}{'acc':>7}{'acc diff':>16}{'F1 diff':>16}"
            )
            for d, r in rows.items():
                print(
                    f"{d:<10}{r['kv_bytes_per_token']:>9.0f}{r['kv_bytes_vs_reference']:>7.3f}"
                    f"{r['logit_rel_err_median']:>10.1e}{r['logit_rel_err_max']:>10.1e}{r['kl_mean']:>10.1e}"
                    f"{100 * r['top1_agree']:>6.1f}%{100 * r['answers_identical']:>8.1f}%{r['accuracy']:>7.1f}"
                    f"{r[f'accuracy_minus_{reference}']:>+9.2f} ± {r[f'accuracy_minus_{reference}_se']:.2f}"
                    f"{r[f'f1_minus_{reference}']:>+9.2f} ± {r[f'f1_minus_{reference}_se']:.2f}"
                )
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")
    bad = {name: d for name, rows in result["sets"].items() for d, r in rows.items() if r["chunk_misses"]}
    if bad:
        print(
            f"warning: chunk misses (KV not read from the store) in {bad}: those rows measure recomputed KV",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
