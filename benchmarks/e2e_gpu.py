"""End to end on one GPU: a Llama-3.1-8B-shaped model with random bf16 weights.

TTFT for 5 cached documents of 512 tokens plus a 64-token question, and decode ms/token at
batch 1, for lazyrag (Triton kernels, CUDA graphs) against transformers' full prefill and
transformers' question-only prefill over a ready KV cache, measured in the same run, on the
same weights. Speed does not depend on the weight values.

    python benchmarks/e2e_gpu.py --out results/e2e_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def llama31_8b_config(layers: int = 32, **fields):
    """Llama-3.1-8B's config with ``layers`` layers; ``fields`` set any other field otherwise (e.g. a small model
    of the same architecture, GQA and RoPE scaling)."""
    from transformers import LlamaConfig

    config = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    return LlamaConfig(**{**config, **fields})


def qwen25_7b_config(layers: int = 28):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=layers,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def qwen3_8b_config(layers: int = 36):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


# --shape: (config builder, its full depth, parameters in billions, the name printed)
SHAPES = {
    "llama3.1-8b": (llama31_8b_config, 32, 8.03, "Llama-3.1-8B"),
    "qwen2.5-7b": (qwen25_7b_config, 28, 7.62, "Qwen2.5-7B"),
    "qwen3-8b": (qwen3_8b_config, 36, 8.19, "Qwen3-8B"),
}


def crop_to(past, length: int) -> None:
    """Drop cached tokens past ``length`` (transformers releases differ in how crop is called)."""
    extra = past.get_seq_length() - length
    if extra > 0:
        try:
            past.crop(-extra)
        except ValueError:
            past.crop(length)


def cuda_time(fn, warmup: int, reps: int) -> list[float]:
    """Seconds per call, host-synchronised (what a user waits for), after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def profile_request(engine, layout, SamplingParams, top: int = 30) -> dict:
    """GPU kernel time of one lazy request (TTFT) and of 16 decode steps, top kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for what, n in (("ttft", 1), ("decode16", 17)):
        engine.submit(layout, SamplingParams(max_new_tokens=n)).result()  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r = engine.submit(layout, SamplingParams(max_new_tokens=n)).result()
            torch.cuda.synchronize()
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        out[what] = {
            "gpu_us_total": sum(e.device_time_total for e in rows if e.device_time_total > 0),
            "kernels": sum(e.count for e in rows if e.device_time_total > 0),
            "wall_ms_under_profiler": 1e3 * (r.ttft_s if n == 1 else r.total_s - r.ttft_s),
            "top": [(e.key[:90], e.count, round(e.device_time_total, 1)) for e in rows[:top]],
        }
        print(
            f"profile {what}: {out[what]['gpu_us_total'] / 1e3:.2f} ms of GPU kernels in {out[what]['kernels']} "
            f"launches (wall {out[what]['wall_ms_under_profiler']:.2f} ms under the profiler); top:"
        )
        for k, c, t in out[what]["top"]:
            print(f"  {t / 1e3:8.3f} ms  x{c:<5} {k}")
    return out


def timeline(engine, layout, SamplingParams, reps: int = 10, decode_tokens: int = 64) -> dict:
    """Where the time goes (medians, ms after the request's arrival, or durations). TTFT of a lazy request, host
    marks: planning (``plan_start``/``plan_end``), building the batch (``batch_start``/``batch_end``), entering
    and leaving the graph runner (``launch``/``launched``), the first token's stamp (``ttft``); device: the input
    copy plus the replay (``graph_device``: kernels and the gaps between them, CUDA events), then the argmax and
    the token's copy to the host (``tokens_device``). Decode: wall time per token against each step's replay."""
    import lazyrag.engine.scheduler as sched_mod

    graphs, runner = engine.runner.graphs, engine.runner
    run, batch_fn, launch_tokens = graphs.run, runner._batch, sched_mod.launch_tokens
    calls, marks, token_events = [], {}, []
    clock = engine.scheduler.clock

    def timed_run(batch, *rest):
        marks.setdefault("launch", clock())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run(batch, *rest)
        end.record()
        marks.setdefault("launched", clock())
        calls.append((batch.is_decode, start, end))
        return out

    def timed_batch(*a, **k):
        marks.setdefault("batch_start", clock())
        out = batch_fn(*a, **k)
        marks.setdefault("batch_end", clock())
        return out

    def timed_launch_tokens(*a, **k):
        out = launch_tokens(*a, **k)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        token_events.append(done)
        return out

    graphs.run, runner._batch, sched_mod.launch_tokens = timed_run, timed_batch, timed_launch_tokens
    ttft, decode = [], []
    try:
        for i in range(reps + 2):
            calls.clear(), marks.clear(), token_events.clear()
            stream = engine.submit(layout, SamplingParams(max_new_tokens=1))
            r = stream.result()
            t0 = stream.request.arrival
            _, start, end = calls[-1]
            if i >= 2:
                row = {k: 1e3 * (v - t0) for k, v in marks.items()}
                row.update(
                    plan_start=1e3 * r.stats.queue_s,
                    plan_end=1e3 * (r.stats.queue_s + r.stats.plan_s),
                    ttft=1e3 * r.ttft_s,
                    graph_device=start.elapsed_time(end),
                    tokens_device=end.elapsed_time(token_events[-1]),
                )
                ttft.append(row)
        # the last prefill's graph replayed back to back (its inputs unchanged: it rewrites the same K/V into blocks
        # its request gave back): device time without the host in between, so graph_device minus this is launch latency
        prefill_graph = next(g for key, g in graphs.graphs.items() if not key[0])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            prefill_graph.graph.replay()
        end.record()
        end.synchronize()
        back_to_back = start.elapsed_time(end) / 20
        for _ in range(3):
            calls.clear()
            r = engine.submit(layout, SamplingParams(max_new_tokens=decode_tokens)).result()
            steps = [s.elapsed_time(e) for is_decode, s, e in calls if is_decode]
            decode.append(
                {
                    "wall_per_token": 1e3 * (r.total_s - r.ttft_s) / max(1, len(r.token_ids) - 1),
                    "graph_device_per_step": statistics.median(steps),
                }
            )
    finally:
        graphs.run, runner._batch, sched_mod.launch_tokens = run, batch_fn, launch_tokens
    for row in ttft:
        row["graph_back_to_back"] = back_to_back
    out = {}
    for name, rows in (("ttft", ttft), ("decode", decode)):
        out[name] = {k: round(statistics.median(x[k] for x in rows), 3) for k in rows[0]}
        print(f"{name} timeline (medians, ms): " + ", ".join(f"{k} {v}" for k, v in out[name].items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="llama3.1-8b",
        help="the model's shapes (random bf16 weights): Llama-3.1-8B, Qwen2.5-7B (q/k/v bias) or Qwen3-8B (q/k norms)",
    )
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's own depth)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_h200.json"))
    ap.add_argument(
        "--kernel-defaults",
        type=Path,
        help="JSON from benchmarks/kernels.py --adopt: attention kernel defaults to use (the backend's "
        "KernelOptions.tuned)",
    )
    ap.add_argument(
        "--gemv-configs",
        type=Path,
        help="JSON from benchmarks/e2e_sweep.py (archived at 32eec34): its gemv_adopt and skinny_adopt tables "
        "(config per shape) are used (as a tuned-config file, LAZYRAG_TUNED_CONFIGS)",
    )
    ap.add_argument("--no-gemv", action="store_true", help="the engine without the fused one-token GEMVs")
    ap.add_argument("--profile", action="store_true", help="also record the top GPU kernels of one lazy request")
    ap.add_argument(
        "--ab",
        default="",
        help="comma list of variants to also time (lazy TTFT, decode) on the same engine: "
        "'unfused' (rotation then index_copy_ K/V; compiles rotate_qk), 'cublaslt' (torch's BLAS choice), "
        "'prefill_splits=N', 'decode_splits=N' (the attention kernels' split count forced), "
        "'gemv=none' or 'gemv=wqkv+wo' (which one-token projections run as fused GEMVs), "
        "'skinny=wqkv+wo+gate_up+down' or 'skinny=none' (which 2-64 token projections run as skinny Triton GEMMs), "
        "'prefill_config=BM:BN:W:S' / "
        "'decode_config=BN:W:S:MAXNREG' and 'prefill_rot=R' / 'decode_rot=R' (the kernels' config and rotation "
        "schedule forced), 'prefill_blas=cublas|cublaslt', 'wo_blas=cublas' (a prefill's wo GEMM alone through "
        "that library), 'elementwise=compiled' (torch.compile's norms and silu*up, not kernels/elementwise.py), "
        "'merge=ROWS:WARPS' (the split merge's rows per program and warps), "
        "'sync' (no async scheduling), 'base' (no change); parts joined by '&' combine",
    )
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"

    if args.gemv_configs:  # a tuned-config file for this device, read by the kernels' first lookup (kernels/tuned.py)
        sweep = json.loads(args.gemv_configs.read_text())
        shapes = {}
        for key, cfg in sweep.get("gemv_adopt", {}).items():
            n, k, pro = (int(v) for v in key.split(","))
            shapes[key] = cfg
            if pro == 2:  # ADD_NORM: the first layer's NORM (1, not swept) takes its config
                shapes[f"{n},{k},1"] = cfg
        adopted = {
            torch.cuda.get_device_name(): {
                "gemv": {"shapes": shapes},
                "gemm": {"shapes": dict(sweep.get("skinny_adopt", {}))},
            }
        }
        path = args.out.parent / "adopted_tuned_configs.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(adopted, indent=1))
        os.environ["LAZYRAG_TUNED_CONFIGS"] = os.pathsep.join(
            p for p in (os.environ.get("LAZYRAG_TUNED_CONFIGS"), str(path)) if p
        )

    from transformers import AutoModelForCausalLM

    from lazyrag.engine import LazyEngine
    from lazyrag.kernels import tuned as tuned_mod
    from lazyrag.kernels.kvloop import KernelOptions

    kernel_options = KernelOptions()
    if args.kernel_defaults:  # the sweep's adopted defaults, as the attention backend's options
        kernel_options = KernelOptions(tuned=json.loads(args.kernel_defaults.read_text()))
    from lazyrag.engine import SamplingParams
    from lazyrag.prompt import PromptLayout

    build, depth, billions, shape_name = SHAPES[args.shape]
    args.layers = args.layers or depth
    config = build(args.layers)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config).eval()
    torch.set_default_dtype(torch.float32)
    engine = LazyEngine.from_hf(hf, None, device="cuda", dtype=torch.bfloat16, kv_budget=8 << 30, gemv=not args.no_gemv)
    engine.runner.attention.options = kernel_options
    used = tuned_mod.tuned(torch.device("cuda"), kernel_options.tuned)

    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 120000) for _ in range(n)]  # noqa: E731
    prefix, docs, question = ids(32), [ids(args.doc_tokens) for _ in range(args.docs)], ids(args.question_tokens)
    layout = PromptLayout(prefix, docs, question)
    n_prompt = layout.num_tokens
    res: dict = {
        "prompt_tokens": n_prompt,
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "question_tokens": args.question_tokens,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
        "kernel_defaults": {
            "prefill": [used["prefill"]["config"], used["prefill"]["rotation_mode"]],
            "decode": [used["decode"]["config"], used["decode"]["rotation_mode"]],
        },
        "gemv_layers": sorted(engine.runner.ops.gemv),
        "gemv_configs": used["gemv"]["shapes"],
    }

    # -- transformers: full prefill, and question-only prefill over a ready cache
    full_ids = torch.tensor([layout.full_ids()], device="cuda")
    ctx_ids, q_ids = full_ids[:, : n_prompt - len(question)], full_ids[:, n_prompt - len(question) :]
    with torch.inference_mode():
        hf_full = cuda_time(lambda: hf(full_ids, use_cache=False).logits[:, -1].argmax(-1).item(), 3, args.reps)
        past = hf(ctx_ids, use_cache=True).past_key_values
        ctx_len = ctx_ids.shape[1]

        def question_only():
            out = hf(q_ids, past_key_values=past, use_cache=True).logits[:, -1].argmax(-1).item()
            crop_to(past, ctx_len)
            return out

        hf_q = cuda_time(question_only, 3, args.reps)
        # transformers' eager decode step over the cache (batch 1)
        tok = q_ids[:, -1:]
        past = hf(full_ids, use_cache=True).past_key_values

        def hf_step():
            hf(tok, past_key_values=past, use_cache=True).logits[:, -1].argmax(-1).item()
            crop_to(past, n_prompt)

        hf_decode = cuda_time(hf_step, 3, args.reps)
    past = None  # drops the cache (not `del`: the closures above read the name, ruff's F821 then misfires)
    torch.cuda.empty_cache()

    # -- lazyrag: documents cached once; each timed request places them in a new order
    def measure(
        engine, strategies=("lazy", "lazy+recover", "position_aware", "full"), decode_runs: int = 5
    ) -> tuple[dict, list[float]]:
        one = SamplingParams(max_new_tokens=1)
        engine.submit(layout, one).result()  # encodes and caches the documents
        ttft = {s: [] for s in strategies}
        plan = []
        for strategy in ttft:
            for i in range(args.reps + 3):
                order = docs[:]
                rng.shuffle(order)
                r = engine.submit(PromptLayout(prefix, order, question), replace(one, strategy=strategy)).result()
                if i >= 3:
                    ttft[strategy].append(r.ttft_s)
                    if strategy == "lazy":
                        plan.append(r.stats.plan_s)
                if strategy == "lazy" and i >= 3:
                    assert r.stats.chunks_missed == 0 and r.stats.tokens_prefilled == len(question)
        gen = SamplingParams(max_new_tokens=args.decode_tokens)
        decode = []
        for _ in range(decode_runs):
            r = engine.submit(layout, gen).result()
            decode.append((r.total_s - r.ttft_s) / max(1, len(r.token_ids) - 1))
        res.setdefault("lazyrag_lazy_plan_ms", 1e3 * statistics.median(plan))
        return ttft, decode

    try:
        ttft, decode = measure(engine)
        res["cuda_graphs"] = True
    except Exception:  # report eager numbers rather than nothing
        import traceback

        traceback.print_exc()
        engine = LazyEngine.from_hf(
            hf, None, device="cuda", dtype=torch.bfloat16, kv_budget=8 << 30, cuda_graphs=False, gemv=not args.no_gemv
        )
        engine.runner.attention.options = kernel_options
        ttft, decode = measure(engine)
        res["cuda_graphs"] = False
    # written now too, so a run cut short after this point still leaves the headline numbers
    early = {
        "lazyrag_ttft_ms": {k: 1e3 * statistics.median(v) for k, v in ttft.items()},
        "lazyrag_decode_ms_per_token": 1e3 * statistics.median(decode),
    }
    print(f"lazyrag: {early}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write_partial():  # a run cut short keeps what it measured so far
        args.out.write_text(json.dumps({**res, **early, "partial": True}, indent=2))

    write_partial()
    if args.ab and res["cuda_graphs"]:
        from dataclasses import replace as dc_replace

        runner, ab = engine.runner, {}
        fused_ops, backend = runner.ops, runner.attention
        blas0 = runner.short_prefill_blas

        def options(**kw):  # the attention kernels' options, through the backend (kvloop.KernelOptions)
            backend.options = dc_replace(backend.options, **kw)

        def wo_blas_ops(ops, lib: str):
            """``ops`` with its prefills' wo GEMM run through BLAS library ``lib`` (``base_gemm`` and ``lib`` bound
            here, not in setup's loop over the parts, where a later part could rebind them)."""
            import dataclasses

            from lazyrag.engine.runner import blas_library

            base_gemm = type(ops)._gemm

            class WoBlasOps(type(ops)):
                def _gemm(self, name, x, linear):
                    if name == "wo" and x.shape[0] > 1:
                        with blas_library(lib):
                            return base_gemm(self, name, x, linear)
                    return base_gemm(self, name, x, linear)

            return WoBlasOps(**{f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)})

        def reset():
            backend.options = kernel_options
            runner.ops = fused_ops
            runner.short_prefill_blas = blas0
            engine.scheduler.async_scheduling = True
            torch.backends.cuda.preferred_blas_library("cublas")

        def setup(name):
            """A variant is one or more of these, joined by '&' (e.g. 'decode_merge&decode_splits=8')."""
            reset()
            for part in name.split("&"):
                key, _, value = part.partition("=")
                if part == "unfused":
                    runner.ops = dc_replace(runner.ops, rotate_qk_store=None)
                elif part == "cublaslt":
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                elif key in ("prefill_splits", "decode_splits"):  # the split count the heuristic would choose, forced
                    options(**{key: int(value)})
                elif key == "prefill_blas":  # the library short prefills run their GEMMs with
                    runner.short_prefill_blas = value
                elif key in ("prefill_config", "decode_config"):  # e.g. prefill_config=128:64:8:3 (tile, warps, stages)
                    options(**{key: tuple(None if x == "none" else int(x) for x in value.split(":"))})
                elif key in ("prefill_rot", "decode_rot"):
                    options(**{key.replace("_rot", "_rotation_mode"): int(value)})
                elif key == "wo_blas":  # a prefill's wo GEMM through this BLAS library, the other GEMMs as before
                    runner.ops = wo_blas_ops(runner.ops, value)
                elif key == "merge":  # the split merge's rows per program and warps, e.g. merge=4:4
                    options(merge=tuple(int(x) for x in value.split(":")))
                elif part == "sync":  # each step's tokens read before the next step is launched (no async scheduling)
                    engine.scheduler.async_scheduling = False
                elif part == "base":  # the engine as built, measured again among the variants
                    pass
                elif part == "elementwise=compiled":
                    # torch.compile's norms and silu*up instead of kernels/elementwise.py
                    from lazyrag.model.llama import ElementwiseOps

                    c = ElementwiseOps.compiled()
                    runner.ops = dc_replace(
                        runner.ops, rms_norm=c.rms_norm, add_rms_norm=c.add_rms_norm, silu_mul=c.silu_mul
                    )
                elif key in ("gemv", "skinny"):  # which projections run as one-token GEMVs / skinny GEMMs
                    runner.ops = dc_replace(
                        runner.ops, **{key: frozenset() if value == "none" else frozenset(value.split("+"))}
                    )
                else:
                    raise ValueError(part)

        for name in [v for v in args.ab.split(",") if v]:
            key = name if name not in ab else f"{name}#{sum(k.split('#')[0] == name for k in ab) + 1}"  # repeats kept
            try:
                setup(name)
                runner.graphs.clear()
                t, d = measure(engine, ("lazy",), 3)
                ab[key] = {
                    "lazy_ttft_ms": 1e3 * statistics.median(t["lazy"]),
                    "decode_ms_per_token": 1e3 * statistics.median(d),
                }
            except Exception as e:
                ab[key] = {"error": repr(e)}
            print(f"A/B {key}: {ab[key]}", flush=True)
            res["ab"] = ab
            write_partial()
        reset()
        runner.graphs.clear()
        res["ab"] = ab

    # last, on the engine as built: once torch.profiler has run, launches stay slower in this process (round 7: a
    # prefill graph's launch read 0.4-0.9 ms of host time after it, 0.06 ms without it), so nothing is timed after it
    if args.profile:
        line = (
            timeline(engine, PromptLayout(prefix, docs[::-1], question), SamplingParams) if res["cuda_graphs"] else None
        )
        res["profile"] = profile_request(engine, PromptLayout(prefix, docs[::-1], question), SamplingParams)
        res["profile"]["timeline"] = line

    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    res.update(
        {
            "hf_full_prefill_ms": med(hf_full),
            "hf_question_only_prefill_ms": med(hf_q),
            "hf_decode_ms_per_token": med(hf_decode),
            "lazyrag_ttft_ms": {k: med(v) for k, v in ttft.items()},
            "lazyrag_decode_ms_per_token": med(decode),
            "goals": {"ttft_ms": 6.0, "decode_ms_per_token": 4.5},
        }
    )
    res.update({"shape": args.shape, "layers": args.layers, "billions_of_parameters": billions})
    print(f"\n{shape_name} shapes ({args.layers} layers), random bf16 weights, {torch.cuda.get_device_name()}")
    print(f"prompt: {args.docs} docs x {args.doc_tokens} + {args.question_tokens}-token question = {n_prompt} tokens")
    print(f"{'what':<48}{'median ms':>10}")
    rows = [
        ("transformers full prefill (TTFT)", res["hf_full_prefill_ms"]),
        ("transformers question-only prefill, ready cache", res["hf_question_only_prefill_ms"]),
        ("lazyrag TTFT lazy (cached docs, new order)", res["lazyrag_ttft_ms"]["lazy"]),
        ("  of which host planning (lookups, metadata)", res["lazyrag_lazy_plan_ms"]),
        ("lazyrag TTFT lazy+recover (15% recomputed)", res["lazyrag_ttft_ms"]["lazy+recover"]),
        ("lazyrag TTFT position_aware (copy per position)", res["lazyrag_ttft_ms"]["position_aware"]),
        ("lazyrag TTFT full prefill", res["lazyrag_ttft_ms"]["full"]),
        ("transformers decode, ms/token", res["hf_decode_ms_per_token"]),
        (
            "lazyrag decode, ms/token" + (" (CUDA graphs)" if res["cuda_graphs"] else " (eager)"),
            res["lazyrag_decode_ms_per_token"],
        ),
    ]
    for name, v in rows:
        print(f"{name:<48}{v:>10.2f}")
    for name, v in res.get("ab", {}).items():
        print(f"A/B {name}: {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
