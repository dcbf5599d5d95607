"""What the compiler makes of the attention kernels, without a GPU: compile them for sm_90a (H200) and report
registers, spilled bytes, shared memory, MMA instructions and how many tiles ahead the context loop's K/V copies
run; optionally dump TTGIR / PTX / SASS for a closer look or a before/after diff.

Use the Triton version the GPU machine has (3.6 there): e.g. ``python -m venv /tmp/t36 && /tmp/t36/bin/pip install
triton==3.6.0 torch`` and run this script with that Python from the repository root. The launch's specialisations
are reproduced (16-divisible pointers and strides, an unsplit grid's ``NUM_SPLITS`` = 1), so the registers and
spills match what ``benchmarks/kernels.py`` records on the device.

    python benchmarks/compile_report.py [--kernel prefill|decode] [--variants JSON] [--dump DIR] [--out PATH]

``--variants``: a JSON list of overrides of the default variant, e.g.
``'[{"ROT": 5}, {"ROT": 5, "num_stages": 2}, {"ROT": 7, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}]'``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import decode, prefill, prefill_wgmma  # noqa: E402  (the source tree: lazyrag.kernels once installed)

ARG_TYPES = {"qk_scale": "fp32", "META": "*i64", "CU_SEQLENS": "*i32", "NUM_CTX": "*i32", "NUM_BLOCKS": "*i32",
             "TILES": "*i32", "NUM_TILES": "*i32", "COUNTERS": "*i32", "COS": "*fp32", "SIN": "*fp32",
             "PART_ACC": "*fp32", "PART_ML": "*fp32", "NUM_SPLITS": "i32"}  # other upper-case names: bf16 tensors
KERNELS = {
    "prefill": (prefill._lazy_prefill_kernel,
                dict(G=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=128, SPLIT=False, ROT=5, IEEE=False,
                     MERGE=False, ASM_INDEX=True, num_warps=8, num_stages=3)),
    "decode": (decode._lazy_decode_kernel,
               dict(G=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=64, SPLIT=True, ROT=5, IEEE=False,
                    MERGE=False, ASM_INDEX=True, num_warps=4, num_stages=3, maxnreg=128)),
    "prefill_wgmma": (prefill_wgmma._lazy_prefill_wgmma_kernel,
                      dict(G=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=128, STAGES=3, ROTATE=True,
                           num_warps=8)),
    "prefill_ws": (prefill_wgmma._lazy_prefill_ws_kernel,
                   dict(G=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=64, STAGES=6, ROTATE=True,
                        PINGPONG=True, CONSUMER_REGS=216, PRODUCER_REGS=72, KEY_CHUNK=16,
                        num_warps=4)),
}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_variant(kind: str, overrides: dict):
    fn, defaults = KERNELS[kind]
    cfg = {**defaults, **overrides}
    options = {k: cfg.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in cfg}
    if not cfg.get("SPLIT", True):
        cfg["NUM_SPLITS"] = 1  # an int argument equal to 1 is specialised as a constant at launch
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cfg:
            sig[name] = "constexpr"
            continue
        sig[name] = ARG_TYPES.get(name, "*bf16" if name.isupper() else "i32")
        if sig[name].startswith("*") or (name.startswith("stride") and name != "stride_tb") or name == "Hq":
            attrs[(i,)] = [["tt.divisibility", 16]]  # tile-table rows are (W + 1) * 4 int32: not 16-divisible
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        cfg["num_warps"] = options["num_warps"]  # a Gluon kernel reads it as a constexpr argument
        src = GluonASTSource(fn, {**sig, "num_warps": "constexpr"}, constexprs=cfg, attrs=attrs)
    else:
        src = ASTSource(fn, sig, constexprs=cfg, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def kv_copies_ahead(ttgir: str) -> int:
    """Tiles of K/V copied before the context loop starts (its pipeline depth)."""
    head = ttgir.split("scf.for", 1)[0]
    if "scf.while" in head:  # a loop nest (ROT 3 / 7): the copies between the segment loop and its inner loop
        head = head.split("scf.while", 1)[1]
    return len(re.findall(r"async_copy_global_to_local[^\n]*x128xbf16", head)) // 2


def report(kind: str, overrides: dict, dump: str | None) -> dict:
    k = compile_variant(kind, overrides)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout if dump else ""
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    row = dict(kernel=kind, **overrides, registers=regs, spilled_bytes=stack, shared=k.metadata.shared,
               wgmma=k.asm["ptx"].count("wgmma.mma_async"), kv_tiles_ahead=kv_copies_ahead(k.asm["ttgir"]))
    if dump:
        name = "_".join(f"{a}{b}" for a, b in overrides.items()) or "default"
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ttgir", k.asm["ttgir"]), ("ptx", k.asm["ptx"]), ("sass", sass)):
            with open(os.path.join(dump, f"{kind}_{name}.{ext}"), "w") as f:
                f.write(re.sub(r"/\*[0-9a-f]{4,}\*/", "", text) if ext == "sass" else text)  # addresses out
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="prefill")
    ap.add_argument("--variants", default='[{"ROT": 2, "num_stages": 2}, {"ROT": 5}, {"ROT": 6}, {"ROT": 7}]')
    ap.add_argument("--dump", help="write each variant's TTGIR, PTX and SASS (addresses stripped) here")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90a, {a.kernel}; defaults {KERNELS[a.kernel][1]}")
    print(f"{'variant':<48} {'regs':>4} {'spill B':>7} {'smem':>7} {'wgmma':>5} {'K/V ahead':>9}")
    rows = []
    for v in json.loads(a.variants):
        try:
            r = report(a.kernel, v, a.dump)
        except Exception as e:  # noqa: BLE001  e.g. out of shared memory
            print(f"{json.dumps(v):<48} failed: {str(e).splitlines()[0][:80]}")
            continue
        rows.append(r)
        print(f"{json.dumps(v):<48} {r['registers']:>4} {r['spilled_bytes']:>7} {r['shared']:>7} {r['wgmma']:>5} "
              f"{r['kv_tiles_ahead']:>9}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(triton=triton.__version__, target="sm_90a", command=" ".join(sys.argv), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
