"""Where a `lazyrag tune` step spends its time on the GPU: the teacher's answers (per step), then optimiser steps
timed one by one, then a few under torch.profiler (the step's named ranges — teacher, lazy forward, full forward,
backward, optimizer — and the top kernels and host ops).

    python benchmarks/tune_step_gpu.py --model FOLDER --data nq=FILE --data hotpotqa=FILE --out results/tune_step.json

Speed does not depend on the weights: a random-weight folder of the model's shape (``--random-from CONFIG_FOLDER``:
its config.json and tokenizer, weights drawn here) needs no checkpoint to travel. Answers of a random model run to
``--answer-tokens``; real ones are shorter, so the teacher's share is an upper bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# the repository's root first; not this folder, whose kernels.py would shadow the 'kernels' that transformers imports
sys.path[0] = str(Path(__file__).resolve().parents[1])


def random_model(config_folder: Path, out: Path) -> Path:
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(config_folder)).save_pretrained(out)
    for f in config_folder.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


@contextlib.contextmanager
def _variant(name: str):
    """The settings a ``--variants`` entry names, for the steps inside the block."""
    from torch.nn.attention import SDPBackend

    from lazyrag.tune import forward

    parts = set(name.split("+")) - {"default"}
    unknown = parts - {"keep", "cudnn"}
    if unknown:
        raise SystemExit(f"unknown variant part(s) {', '.join(sorted(unknown))}: keep, cudnn")
    backends = forward.ATTENTION_BACKENDS
    if "cudnn" in parts:  # as before the tune forward left cuDNN out: it comes first where it is allowed
        forward.ATTENTION_BACKENDS = [*backends, SDPBackend.CUDNN_ATTENTION]
    try:
        with forward.activation_checkpointing("keep" not in parts):
            yield
    finally:
        forward.ATTENTION_BACKENDS = backends


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a local Llama folder or .gguf (default: the embedded model)")
    ap.add_argument("--random-from", type=Path, help="a folder with config.json and tokenizer files: random weights")
    ap.add_argument("--data", action="append", default=[], help="SET=FILE, as lazyrag tune's")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument(
        "--variants",
        default="default",
        help="comma-separated, timed one after another on the same batches: default (lazyrag tune's settings); "
        "keep (activations kept, no layer recomputed in the backward); cudnn (attention may run on cuDNN, as before "
        "the tune forward left it out); keep+cudnn",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tune_step_gpu.json"))
    args = ap.parse_args()
    from lazyrag.tune.train import TuneConfig, Tuner

    work = Path(tempfile.mkdtemp(prefix="tune_step_"))
    model = str(random_model(args.random_from, work / "model")) if args.random_from else args.model
    data = dict(d.split("=", 1) for d in args.data)
    total = 2 + args.steps + args.profile_steps
    tuner = Tuner(
        TuneConfig(
            model=model,
            out=str(work / "adapter"),
            data=data,
            max_steps=total,
            prompts_per_step=args.prompts_per_step,
            answer_tokens=args.answer_tokens,
        )
    )
    tuner.out.mkdir(parents=True)
    sync = torch.cuda.synchronize if tuner.device.type == "cuda" else (lambda: None)
    t = time.perf_counter()
    tuner.teacher_engine()
    draws = tuner.train_draws(0, total)
    answers = tuner.teacher_answers(draws)
    teacher_s = time.perf_counter() - t
    student = tuner.build_student()
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batches = [tuner.examples(tuner.train_draws(i, i + 1), answers) for i in range(total)]
    tokens = [sum(e.layout.num_tokens + len(e.answer_ids) for e in b) for b in batches]
    variants = {}
    for variant in args.variants.split(","):
        seconds = []
        torch.cuda.reset_peak_memory_stats() if tuner.device.type == "cuda" else None
        with _variant(variant):
            for i in range(2 + args.steps):
                sync()
                t = time.perf_counter()
                tuner.train_step(student, optimizer, scheduler, batches[i])
                sync()
                if i >= 2:
                    seconds.append(time.perf_counter() - t)
        variants[variant] = {
            "step_s_median": statistics.median(seconds),
            "step_s": seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if tuner.device.type == "cuda" else None,
        }
        print(
            f"{variant:>14}: step {statistics.median(seconds):.3f} s median, peak {variants[variant]['peak_gib']} GiB",
            flush=True,
        )
    first = variants[args.variants.split(",")[0]]
    res = {
        "device": torch.cuda.get_device_name() if tuner.device.type == "cuda" else "cpu",
        "model": model,
        "command": "python " + " ".join(sys.argv),
        "prompts_per_step": args.prompts_per_step,
        "teacher_s_per_step": teacher_s / total,
        "step_s_median": first["step_s_median"],
        "step_s": first["step_s"],
        "variants": variants,
        "tokens_per_step_median": statistics.median(tokens[2 : 2 + args.steps]),
        "peak_gib": first["peak_gib"],
    }
    print(
        f"teacher answers {res['teacher_s_per_step']:.2f} s/step; step {res['step_s_median']:.2f} s median "
        f"({res['tokens_per_step_median']:.0f} prompt+answer tokens); peak {res['peak_gib']} GiB",
        flush=True,
    )
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tuner.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for b in batches[2 + args.steps :]:
            tuner.train_step(student, optimizer, scheduler, b)
        sync()
    rows = prof.key_averages()
    ranges = {
        e.key: {"cpu_ms": e.cpu_time_total / 1e3, "gpu_ms": e.device_time_total / 1e3}
        for e in rows
        if e.key.startswith("tune.")
    }
    gpu = sorted(
        (e for e in rows if e.device_time_total > 0 and not e.key.startswith("tune.")),
        key=lambda e: -e.device_time_total,
    )
    host = sorted(rows, key=lambda e: -e.self_cpu_time_total)
    res["profile"] = {
        "steps": args.profile_steps,
        "ranges": ranges,
        "gpu_top": [(e.key[:90], e.count, round(e.device_time_total / 1e3, 2)) for e in gpu[:25]],
        "host_top": [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in host[:25]],
    }
    print(f"profile of {args.profile_steps} steps: named ranges (wall on the host / GPU kernels inside)")
    for k, v in ranges.items():
        print(f"  {k:18s} host {v['cpu_ms']:9.1f} ms  gpu {v['gpu_ms']:9.1f} ms")
    for k, c, t in res["profile"]["gpu_top"][:15]:
        print(f"  gpu  {t:9.2f} ms  x{c:<6} {k}")
    for k, c, t in res["profile"]["host_top"][:12]:
        print(f"  host {t:9.2f} ms  x{c:<6} {k}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
