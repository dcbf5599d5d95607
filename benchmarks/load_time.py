"""How long the embedded model takes to become usable (issue 43 item 2, "a 3-second load"), each in a fresh process:

* ``from_pretrained``: ``LazyEngine.from_pretrained()`` alone (after ``import lazyrag``), with a cold model cache
  (the GGUF converted: ``from_pretrained_cold``) and a warm one (the converted folder read), with and without the
  warm-up; the same process then answers two requests over new chunks, to show whether the first is as fast as
  the second (the warm-up's job; the first also encodes the shared prefix, which the second finds cached);
* ``ask``: the whole ``lazyrag ask ... --max-new-tokens 8`` command, wall clock;
* ``serve``: ``lazyrag serve`` from its start until ``/health`` answers.

Each runs with the model cache off (before: every load reads the GGUF through transformers) and on (after), in a
temporary cache folder, so "cold" really converts. The load average is recorded with every run: another process
on a 2-core machine slows these several-fold, and the numbers are only worth reading where it stayed near 0-1.

    .venv/bin/python benchmarks/load_time.py --reps 3     # CPU; writes benchmarks/results/load_time_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION, CHUNK = (
    "Who discovered penicillin?",
    "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London.",
)
OTHER = ("When did tea reach Britain?", "Tea reached Britain in 1662, brought by Catherine of Braganza.")

# run in the child: the load, then two requests over chunks never seen (first and second after the load)
LOAD = f"""
import json, sys, time
from lazyrag import LazyEngine
t = time.perf_counter()
engine = LazyEngine.from_pretrained(warmup=sys.argv[1] == "1")
load_s = time.perf_counter() - t
requests = []
for q, c in [({QUESTION!r}, {CHUNK!r}), {OTHER!r}]:
    r = engine.generate(q, [c], max_new_tokens=16, ignore_eos=True)
    requests.append({{"ttft_s": r.ttft_s, "decode_ms_per_token": 1e3 * (r.total_s - r.ttft_s) / 15,
                     "tokens_prefilled": r.stats.tokens_prefilled}})
print(json.dumps({{"load_s": load_s, "requests": requests}}))
"""


def run_load(env: dict, warmup: bool) -> dict:
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", LOAD, "1" if warmup else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t}


def run_ask(env: dict) -> dict:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "lazyrag", "ask", QUESTION, "--chunk", CHUNK, "--max-new-tokens", "8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return {"wall_s": time.perf_counter() - t}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(env: dict) -> dict:
    port = free_port()
    t = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "lazyrag", "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"lazyrag serve exited: {p.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return {"ready_s": time.perf_counter() - t}
            except OSError:
                time.sleep(0.05)
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def measured(fn, *args) -> dict:
    """``fn``'s result with the 1-minute load average before and after it (another process's work shows there)."""
    before = os.getloadavg()[0]
    out = fn(*args)
    return {**out, "loadavg_before": before, "loadavg_after": os.getloadavg()[0]}


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


CONFIGS = {"before": ("before (cache off)", "0"), "after": ("after (cache on)", "1")}


def run_all(reps: int, configs: list[str]) -> dict:
    results = {}
    for label, cache in (CONFIGS[c] for c in configs):
        with tempfile.TemporaryDirectory() as cache_dir:
            env = dict(
                os.environ,
                LAZYRAG_MODEL_CACHE=cache,
                LAZYRAG_CACHE_DIR=cache_dir,
                TQDM_DISABLE="1",
                PYTHONPATH=str(ROOT),
            )
            r = results[label] = {}
            if cache == "1":
                # the first load converts the GGUF: the cold-cache load (with the cache off, every load is)
                r["from_pretrained_cold"] = [measured(run_load, env, True)]
            r["from_pretrained"] = [measured(run_load, env, True) for _ in range(reps)]
            r["from_pretrained_no_warmup"] = [measured(run_load, env, False) for _ in range(reps)]
            r["ask"] = [measured(run_ask, env) for _ in range(reps)]
            r["serve"] = [measured(run_serve, env) for _ in range(reps)]
            print_table(label, r)
    return results


def print_table(label: str, r: dict) -> None:
    def first_second(runs):
        ttft = [f"{median([x['requests'][i] for x in runs], 'ttft_s'):.2f}" for i in (0, 1)]
        dec = [f"{median([x['requests'][i] for x in runs], 'decode_ms_per_token'):.0f}" for i in (0, 1)]
        return f"TTFT 1st/2nd {'/'.join(ttft)} s, decode 1st/2nd {'/'.join(dec)} ms/token"

    print(f"\n{label} (medians; seconds)")
    for key in ("from_pretrained_cold", "from_pretrained", "from_pretrained_no_warmup"):
        if key not in r:
            continue
        runs = r[key]
        print(
            f"  {key:<32} load {median(runs, 'load_s'):6.2f}  process {median(runs, 'process_s'):6.2f}  "
            f"{first_second(runs)}"
        )
    print(f"  {'ask (wall)':<32} {median(r['ask'], 'wall_s'):6.2f}")
    print(f"  {'serve ready (/health)':<32} {median(r['serve'], 'ready_s'):6.2f}")
    print(
        f"  load average: {min(x['loadavg_before'] for v in r.values() for x in v):.2f}-"
        f"{max(x['loadavg_after'] for v in r.values() for x in v):.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="runs of each warm measurement (the medians are reported)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "load_time_cpu.json")
    ap.add_argument("--configs", default="before,after", help="which of before (cache off), after (cache on) to run")
    args = ap.parse_args()
    results = run_all(args.reps, args.configs.split(","))
    args.out.write_text(
        json.dumps(
            {"command": " ".join(["python", *sys.argv]), "device": f"cpu ({os.cpu_count()} cores)", "results": results},
            indent=1,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
