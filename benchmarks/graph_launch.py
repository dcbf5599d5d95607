"""What replaying a CUDA graph costs before the device starts: graphs of n tiny kernels, timed three ways.

For each n: the host time of ``graph.replay()`` with the device idle; the replay's device time from an event
recorded just before it to one just after (the device waits for the launch); the same graph replayed back to back
(the device never waits). Their difference is the start latency a lone request pays (round 7's TTFT timeline read
0.13-0.21 ms for the engine's first stage). Also n = 337 (the 8B prefill's node count) as one graph and as three
staged graphs (13, 84, 240 nodes), as the engine replays it.

    python benchmarks/graph_launch.py --out benchmarks/results/graph_launch_h200.json
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/graph_launch_h200.json"))
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "command": "python " + " ".join(sys.argv), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
