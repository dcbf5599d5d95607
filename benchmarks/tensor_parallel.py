"""Tensor parallelism side by side (issue 33): TTFT of a lazy request over cached documents and decode ms/token at
each tensor-parallel size, Llama shapes with random weights (speed does not depend on their values), against the
weight-read floor per GPU (the bytes of weights one rank reads per step over ``--bandwidth-tbs``).

Each size runs in a process of its own (this script starts itself with ``--size N``; that process is rank 0 and
``LazyEngine.from_config(..., tensor_parallel_size=N)`` starts the other N - 1 ranks, one GPU each), then the rows
are merged into one table and one JSON, with ratios to the smallest size.

    python benchmarks/tensor_parallel.py --shape 8b --sizes 1,2 --out benchmarks/results/tp_h200x2_8b.json
    python benchmarks/tensor_parallel.py --shape 70b --sizes 4,8 --out benchmarks/results/tp_h200x8_70b.json
    python benchmarks/tensor_parallel.py --shape tiny --device cpu --sizes 1,2 --reps 2 --decode-tokens 4  # gloo
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# not this folder (its kernels.py would shadow the ``kernels`` package transformers imports), the repository root
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

SHAPES = {  # LlamaConfig fields; 8b and 70b are Llama-3.1's (RoPE scaling left out: it does not change speed)
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": dict(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def llama_config(shape: str, layers: int | None):
    from transformers import LlamaConfig

    fields = dict(
        SHAPES[shape],
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    if layers:
        fields["num_hidden_layers"] = layers
    return LlamaConfig(**fields)


def measure(args) -> dict:
    """One size, in this process (rank 0): the engine, documents cached once, then timed requests."""
    import torch

    from lazyrag.engine import LazyEngine, SamplingParams
    from lazyrag.prompt import PromptLayout

    config = llama_config(args.shape, args.layers)
    on_gpu = args.device == "cuda"
    t0 = time.perf_counter()
    engine = LazyEngine.from_config(
        config,
        None,
        seed=0,
        device=args.device,
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        kv_budget=args.kv_budget_gib << 30,
        tensor_parallel_size=args.size,
    )
    start_s = time.perf_counter() - t0
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(10, config.vocab_size - 10) for _ in range(n)]  # noqa: E731
    prefix, docs, question = ids(32), [ids(args.doc_tokens) for _ in range(args.docs)], ids(args.question_tokens)
    layout = PromptLayout(prefix, docs, question)
    one = SamplingParams(max_new_tokens=1, strategy="lazy")
    engine.submit(layout, one).result()  # encodes and caches the documents (and warms the graphs)
    ttft = []
    for i in range(args.reps + 2):
        order = docs[:]
        rng.shuffle(order)  # each request places the cached documents in a new order
        r = engine.submit(PromptLayout(prefix, order, question), one).result()
        assert r.stats.chunks_missed == 0, r.stats
        if i >= 2:
            ttft.append(r.ttft_s)
    gen = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True, strategy="lazy")
    decode = []
    for _ in range(max(2, args.reps // 2)):
        r = engine.submit(layout, gen).result()
        decode.append((r.total_s - r.ttft_s) / max(1, len(r.token_ids) - 1))
    # what one rank reads per decode step: its weights but the embedding table (one row of it)
    read = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters() if not n.startswith("embed."))
    floor_ms = 1e3 * read / (args.bandwidth_tbs * 1e12)
    row = {
        "tensor_parallel_size": args.size,
        "ttft_ms": 1e3 * statistics.median(ttft),
        "decode_ms_per_token": 1e3 * statistics.median(decode),
        "weight_bytes_per_rank": read,
        "weight_read_floor_ms": floor_ms,
        "start_s": start_s,
        "ttft_all_ms": [1e3 * t for t in ttft],
        "decode_all_ms": [1e3 * t for t in decode],
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
    }
    engine.close()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick look)")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--device", default="cuda", help="cuda (NCCL, one GPU a rank) or cpu (gloo)")
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kv-budget-gib", type=int, default=8, help="each rank's KV pool (default: %(default)s GiB)")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM read bandwidth for the floor (H200: 4.3)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tensor_parallel.json"))
    ap.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)  # one size, in this process
    args = ap.parse_args(argv)
    if args.size is not None:
        args.out.write_text(json.dumps(measure(args)))
        return 0
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            part = Path(tmp) / f"tp{size}.json"
            cmd = [
                sys.executable,
                __file__,
                *(argv if argv is not None else sys.argv[1:]),
                "--size",
                str(size),
                "--out",
                str(part),
            ]
            p = subprocess.run(cmd)
            if p.returncode != 0:
                print(
                    f"tensor-parallel size {size} failed (exit {p.returncode}); the rows before it are kept",
                    file=sys.stderr,
                )
                break
            rows.append(json.loads(part.read_text()))
    base = rows[0] if rows else None
    print(
        f"{args.shape} shape, {args.docs} x {args.doc_tokens} cached docs + {args.question_tokens}-token question, "
        f"{rows[0]['device'] if rows else args.device}"
    )
    print(
        f"{'TP':>3} {'TTFT ms':>9} {'decode ms/tok':>14} {'floor ms':>9} {'decode/floor':>13} {'TTFT vs first':>14} "
        f"{'decode vs first':>16}"
    )
    for r in rows:
        print(
            f"{r['tensor_parallel_size']:>3} {r['ttft_ms']:>9.2f} {r['decode_ms_per_token']:>14.2f} "
            f"{r['weight_read_floor_ms']:>9.2f} {r['decode_ms_per_token'] / r['weight_read_floor_ms']:>13.2f} "
            f"{r['ttft_ms'] / base['ttft_ms']:>14.2f} {r['decode_ms_per_token'] / base['decode_ms_per_token']:>16.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/tensor_parallel.py "
                + " ".join(argv if argv is not None else sys.argv[1:]),
                "shape": args.shape,
                "layers": args.layers or SHAPES[args.shape]["num_hidden_layers"],
                "seconds": round(time.perf_counter() - t0, 1),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0 if rows and len(rows) == len(args.sizes.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
