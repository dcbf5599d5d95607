"""What replaying a CUDA graph costs before the device starts: graphs of n tiny kernels, timed three ways.

For each n: the host time of ``graph.replay()`` with the device idle; the replay's device time from an event
recorded just before it to one just after (the device waits for the launch); the same graph replayed back to back
(the device never waits). Their difference is the start latency a lone request pays. Also n = 337 (the 8B prefill's
node count) as one graph and as three graphs (13, 84, 240 nodes): round 7 tried capturing a forward in such stages,
after a TTFT timeline taken with torch.profiler run before it in the same process (whose launches it slows) had read
0.6 ms to launch the prefill graph; without the profiler there was nothing to win (benchmarks/NOTES.md).

    python benchmarks/graph_launch.py --out benchmarks/results/graph_launch_h200.json

``--engine``: also the engine's own prefill graph (Llama-3.1-8B shapes, random weights, the e2e prompt), each
part of ``GraphRunner.run`` timed on the host with the device idle: waiting for the previous copy, filling the
staging buffer, the copy, the replay; and the replay's device time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def capture(n: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1.0)
    return g


def time_replays(graphs: list[torch.cuda.CUDAGraph], reps: int) -> dict:
    host, device = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        for g in graphs:
            g.replay()
        host.append(1e6 * (time.perf_counter() - t))
        end.record()
        end.synchronize()
        device.append(1e3 * start.elapsed_time(end))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for g in graphs:
            g.replay()
    end.record()
    end.synchronize()
    back = 1e3 * start.elapsed_time(end) / reps
    dev = statistics.median(device)
    return {"host_us": round(statistics.median(host), 1), "device_us": round(dev, 1),
            "back_to_back_us": round(back, 1), "start_latency_us": round(dev - back, 1)}


def engine_replay_parts(reps: int) -> dict:
    """Medians (µs, host) of each part of the engine's prefill ``GraphRunner.run`` for the e2e prompt."""
    import random

    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e_gpu import llama31_8b_config

    from lazyrag.engine import LazyEngine, SamplingParams
    from lazyrag.prompt import PromptLayout

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(llama31_8b_config()).eval()
    torch.set_default_dtype(torch.float32)
    engine = LazyEngine.from_hf(hf, None, device="cuda", dtype=torch.bfloat16, kv_budget=8 << 30)
    del hf
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 120000) for _ in range(n)]  # noqa: E731
    layout = PromptLayout(ids(32), [ids(512) for _ in range(5)], ids(64))
    graphs, batches = engine.runner.graphs, []
    run = graphs.run

    def keep_batch(batch, *rest):
        batches.append(batch)
        return run(batch, *rest)

    graphs.run = keep_batch
    for _ in range(3):
        engine.submit(layout, SamplingParams(max_new_tokens=1)).result()
    graphs.run = run
    batch = batches[-1]
    g = next(g for key, g in graphs.graphs.items() if not key[0])
    parts = {k: [] for k in ("copied_synchronize", "fill", "copy", "replays", "whole_run", "replays_device")}
    clock = time.perf_counter
    with torch.inference_mode():  # the staging buffers are inference tensors
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = clock()
            g.copied.synchronize()
            t1 = clock()
            batch.fill(g.host_np, *g.shape, graphs.scratch_slot)
            t2 = clock()
            g.dev.copy_(g.host, non_blocking=True)
            g.copied.record()
            t3 = clock()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.graph.replay()
            end.record()
            t4 = clock()
            torch.cuda.synchronize()
            parts["replays_device"].append(1e3 * start.elapsed_time(end))
            t5 = clock()
            run(batch)
            t6 = clock()
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5)):
                parts[k].append(1e6 * v)
    med = {k: round(statistics.median(v), 1) for k, v in parts.items()}
    print("engine prefill replay, host µs: " + ", ".join(f"{k} {v}" for k, v in med.items()))
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/graph_launch_h200.json"))
    ap.add_argument("--engine", action="store_true", help="also time the parts of the 8B engine's prefill graph replay")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    x = torch.zeros(1 << 10, device="cuda")
    rows = {}
    for n in (1, 4, 16, 64, 128, 337):
        rows[f"one graph, {n} kernels"] = time_replays([capture(n, x)], args.reps)
    rows["three graphs, 13 + 84 + 240 kernels"] = time_replays([capture(n, x) for n in (13, 84, 240)], args.reps)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'graphs':<40}{'host µs':>10}{'device µs':>12}{'back to back':>14}{'start latency':>15}")
    for name, r in rows.items():
        print(f"{name:<40}{r['host_us']:>10}{r['device_us']:>12}{r['back_to_back_us']:>14}{r['start_latency_us']:>15}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
           "rows": rows}
    if args.engine:
        out["engine_prefill_replay_us"] = engine_replay_parts(args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
