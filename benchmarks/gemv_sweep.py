"""The one-token projections of a model family, timed for every GEMV config (issue 46: per-parameter decode).

Each decode projection at batch 1 as the engine runs it (``kernels/gemv.py``: the norm or silu*up folded into the
load of x) for every candidate config of ``tuned_configs.json`` plus the one-shot and K-loop configs sized to this
K, against the unfused path (the engine's Triton elementwise kernel, then cuBLAS). Each weight is cycled through
copies well over the 50 MB L2, as the layers of a real model are, and every call is replayed from a CUDA graph.
The fastest config per ``N,K,prologue`` lands in ``gemv_adopt``, the table ``e2e_gpu.py --gemv-configs`` reads
(and ``tuned_configs.json``'s ``gemv.shapes`` holds).

    python benchmarks/gemv_sweep.py --shapes qwen2.5-7b,qwen3-8b --out $OUT/gemv_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DT = torch.bfloat16


def projections(config) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, prologue) of one decoder layer's four projections (kernels/gemv.py's prologue codes)."""
    from lazyrag.kernels import gemv as G

    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return {
        "wqkv": (qkv, hidden, G.ADD_NORM),
        "wo": (hidden, config.num_attention_heads * head_dim, G.PLAIN),
        "gate_up": (2 * inter, hidden, G.ADD_NORM),
        "down": (hidden, inter, G.SILU),
    }


def graph_us(fn, reps: int) -> float:
    """Device time per call (µs): ``reps`` calls captured in one graph, replayed, median of 5."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[2]


def weight_copies(n: int, k: int, total_bytes: float = 6e8) -> list[torch.Tensor]:
    """Distinct copies of one weight shape: together well over the L2, so each call reads HBM."""
    copies = max(2, min(16, int(total_bytes // (n * k * 2)) + 1))
    return [torch.randn(n, k, device="cuda", dtype=DT) * k**-0.5 for _ in range(copies)]


def per_weight_us(fn, ws) -> float:
    return graph_us(lambda: [fn(w) for w in ws], reps=4) / len(ws)


def tbps(n: int, k: int, us: float) -> float:
    return round(n * k * 2 / us / 1e6, 2)


def configs_for(k: int) -> list[tuple[int, int, int, int]]:
    """The tuned file's candidates, plus one-shot at 1-8 rows and K loops whose tile divides this K, as launches."""
    from lazyrag.kernels import gemv as G

    extra = [(bn, k, w, 1) for bn in (1, 2, 4, 8) for w in (4, 8)]
    extra += [(bn, bk, w, 3) for bn in (2, 4, 8) for bk in (1024, 2048) for w in (4, 8)]
    dev = torch.device("cuda")
    return list(dict.fromkeys(G.resolve(tuple(c), k) for c in [*G.candidates(dev), *extra]))


def sweep(name: str, n: int, k: int, pro: int, bias: bool) -> dict:
    from lazyrag.kernels import elementwise as E, gemv as G

    ws = weight_copies(n, k)
    b = torch.randn(n, device="cuda", dtype=DT) if bias else None
    x = torch.randn(1, 2 * k if pro == G.SILU else k, device="cuda", dtype=DT)
    r, nw, eps = torch.randn(1, k, device="cuda", dtype=DT), (1 + 0.2 * torch.randn(k, device="cuda")).to(DT), 1e-6
    if pro == G.ADD_NORM:
        unfused = lambda w: F.linear(E.add_rms_norm(x, r, nw, eps)[1], w, b)  # noqa: E731
    elif pro == G.SILU:
        unfused = lambda w: F.linear(E.silu_mul(x, k), w, b)  # noqa: E731
    else:
        unfused = lambda w: F.linear(x, w, b)  # noqa: E731

    def fused(w, cfg):
        got = G.gemv(x, w, b, prologue=pro, residual=r, norm_weight=nw, eps=eps, config=cfg)
        return got[1] if pro == G.ADD_NORM else got

    ref = unfused(ws[0]).float()
    row: dict = {"n": n, "k": k, "prologue": pro, "unfused_us": round(per_weight_us(unfused, ws), 2)}
    row["default"] = list(G.resolve(G.config_for(n, k, pro, torch.device("cuda")), k))
    candidates = {}
    for cfg in configs_for(k):
        key = str(list(cfg))
        try:
            err = float((fused(ws[0], cfg).float() - ref).norm() / ref.norm())
            us = per_weight_us(lambda w, cfg=cfg: fused(w, cfg), ws) if err < 1e-2 else math.nan
            candidates[key] = {"us": round(us, 2), "tbps": tbps(n, k, us), "rel_err": round(err, 5)}
        except Exception as e:  # e.g. out of shared memory or registers for this tile
            candidates[key] = {"error": repr(e)[:160]}
    ok = {c: v["us"] for c, v in candidates.items() if "us" in v and not math.isnan(v["us"])}
    best = min(ok, key=ok.__getitem__)
    row.update(candidates=candidates, best=json.loads(best), best_us=ok[best], best_tbps=tbps(n, k, ok[best]))
    row["default_us"] = ok.get(str(row["default"]))
    print(
        f"{name:8s} {n:6d}x{k:<6d} unfused {row['unfused_us']:7.2f} us | default {row['default']} "
        f"{row['default_us']} us | best {row['best']} {row['best_us']:.2f} us ({row['best_tbps']} TB/s)",
        flush=True,
    )
    return row


def main() -> int:
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_gpu", Path(__file__).with_name("e2e_gpu.py"))
    e2e_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e_gpu)
    SHAPES = e2e_gpu.SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.1-8b,qwen2.5-7b,qwen3-8b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--all", action="store_true", help="also the shapes tuned_configs.json already has a config for")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gemv_sweep.json"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv), "shapes": {}}
    adopt: dict = {}
    from lazyrag.kernels import gemv as G

    known = G.tuned_shapes(torch.device("cuda"))
    for shape in args.shapes.split(","):
        config = SHAPES[shape][0](1)
        bias = bool(getattr(config, "model_type", "") == "qwen2")  # q/k/v bias on the qkv projection only
        rows = {}
        for name, (n, k, pro) in projections(config).items():
            key = f"{n},{k},{pro}"
            if (n, k, pro) in known and not args.all:
                print(f"{shape} {name}: {key} already tuned ({list(known[n, k, pro])}), skipped", flush=True)
                continue
            rows[name] = sweep(f"{shape} {name}", n, k, pro, bias and name == "wqkv")
            adopt.setdefault(key, rows[name]["best"])
        res["shapes"][shape] = rows
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**res, "gemv_adopt": adopt}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
