"""Bring trained weights back from the device machine, whose calls return at most 8 files of 16 MiB (64 MiB in all).

On the machine, after ``tune_gpu.sh train`` (the folder stays under /tmp/t while the machine is warm):

    python3 benchmarks/device_weights.py pack /tmp/t/r64_lr1e-3 $OUT            # call 0: parts 0-3 and the rest
    python3 benchmarks/device_weights.py pack /tmp/t/full_2e-5 $OUT --call 1    # a full model: one call per 4 parts

Here, with every call's files (``files_at`` folders) given in any order:

    python3 benchmarks/device_weights.py unpack /work/.device/7 /work/.device/8 --out lazyrag/data/adapters/NAME

Weights are stored in float16 (as the shipped adapter is: a rank-64 LoRA of the embedded model goes from 78 to 39 MB),
cut into 15 MiB parts; ``weights.json`` names each file's parts and the sha256 of the joined file, and ``unpack``
refuses a missing or damaged part. The folder's small files (adapter_config.json, lazyrag_tune.json, log.jsonl,
config.json, the tokenizer's) travel in ``small.tgz`` with the first call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
from pathlib import Path

PART = 15 << 20
PARTS_PER_CALL = 4  # 60 MiB of weights, and weights.json and small.tgz beside them: within 8 files and 64 MiB


def _fp16_bytes(path: Path) -> bytes:
    from safetensors.torch import load_file, save

    tensors = {k: v.half() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    return save(tensors, metadata={"format": "pt"})


def pack(folder: Path, out: Path, call: int) -> None:
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        sys.exit(f"no *.safetensors in {folder}")
    index, parts = {}, []
    for w in weights:
        data = _fp16_bytes(w)
        names = [f"{w.name}.{i:03d}" for i in range(0, -(-len(data) // PART))]
        index[w.name] = {"sha256": hashlib.sha256(data).hexdigest(), "parts": names}
        parts += [(n, data[i * PART : (i + 1) * PART]) for i, n in enumerate(names)]
    mine = parts[call * PARTS_PER_CALL : (call + 1) * PARTS_PER_CALL]
    if not mine:
        sys.exit(f"call {call}: no parts left ({len(parts)} in all, {PARTS_PER_CALL} a call)")
    out.mkdir(parents=True, exist_ok=True)
    for name, chunk in mine:
        (out / name).write_bytes(chunk)
    if call == 0:
        (out / "weights.json").write_text(json.dumps(index, indent=1))
        with tarfile.open(out / "small.tgz", "w:gz") as tar:
            for f in sorted(folder.iterdir()):
                if f.is_file() and f.suffix != ".safetensors" and f.stat().st_size < (4 << 20):
                    tar.add(f, arcname=f.name)
    left = len(parts) - (call + 1) * PARTS_PER_CALL
    more = f"; {left} left (--call {call + 1})" if left > 0 else "; none left"
    print(f"{folder}: parts {[n for n, _ in mine]} written{more}")


def unpack(dirs: list[Path], out: Path) -> None:
    found = {p.name: p for d in dirs for p in d.iterdir() if p.is_file()}
    if "weights.json" not in found or "small.tgz" not in found:
        sys.exit("weights.json and small.tgz come with call 0's files: pass that folder too")
    index = json.loads(found["weights.json"].read_text())
    missing = [n for entry in index.values() for n in entry["parts"] if n not in found]
    if missing:
        sys.exit(f"missing parts {missing}: pass every call's folder")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(found["small.tgz"]) as tar:
        small = tar.getnames()
        tar.extractall(out, filter="data")
    for name, entry in index.items():
        data = b"".join(found[n].read_bytes() for n in entry["parts"])
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            sys.exit(f"{name}: the joined parts do not match their sha256 (a damaged or foreign part)")
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(out / name)
    print(f"{out}: {', '.join(index)} and {', '.join(small)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="on the device: a trained folder's weights in parts into OUT")
    p.add_argument("folder", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--call", type=int, default=0, help="which call's parts (4 a call)")
    u = sub.add_parser("unpack", help="here: the parts of every call joined into a folder")
    u.add_argument("dirs", type=Path, nargs="+")
    u.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.folder, args.out, args.call)
    else:
        unpack(args.dirs, args.out)


if __name__ == "__main__":
    main()
