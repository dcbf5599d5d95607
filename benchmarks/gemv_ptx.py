"""What the compiler makes of kernels/gemv.py's candidates on sm_90, without a GPU.

For each Llama-3.1-8B projection and each candidate (deduplicated by ``gemv.resolve``), compiles the kernel
as a real bf16 launch specialises it (pointers, N, K and the row stride divisible by 16; without that the
loads come out as scalar ``ld.global.b16``) and prints static counts from the PTX (16-byte ``ld.global.v4``,
``cp.async`` of the pipelined loop, ``bar.sync``), the shared memory, the registers a thread takes (cuobjdump
on the cubin; ``n_regs`` itself needs a driver) and the order ptxas issues the loads in (``issue_order``).
The local Triton may differ from the device's.

    python benchmarks/gemv_ptx.py                 # every candidate
    python benchmarks/gemv_ptx.py 2,4096,4,1 ...  # these configs
    python benchmarks/gemv_ptx.py --sass wqkv 2,4096,4,1   # the memory / barrier instructions of one kernel
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lazyrag.kernels import gemv as G

SHAPES = {"wqkv": (6144, 4096, G.ADD_NORM), "wo": (4096, 4096, G.PLAIN), "gate_up": (28672, 4096, G.ADD_NORM),
          "down": (4096, 14336, G.SILU)}
POINTERS = ("X", "R", "NW", "W", "B", "Y", "H_OUT")


def compile_config(k: int, prologue: int, config):
    block_n, block_k, warps, stages = G.resolve(config, k)
    constexprs = dict(NORMED=prologue in (G.NORM, G.ADD_NORM), ADD=prologue == G.ADD_NORM, GATED=prologue == G.SILU,
                      HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k, K_PAD=triton.next_power_of_2(k),
                      ONE_SHOT=block_k >= k, NUM_STAGES=stages)
    signature = {**{p: "*bf16" for p in POINTERS}, "N": "i32", "K": "i32", "stride_w": "i32", "eps": "fp32",
                 **{c: "constexpr" for c in constexprs}}
    names = G._gemv_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in (*POINTERS, "N", "K", "stride_w")}
    src = ASTSource(fn=G._gemv_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True).stdout


_ORDER = {"LDGSTS": "A", "LDG": "L", "DEPBAR": "W", "BAR.SYNC": "B", "LDS": "s", "BRA": "|"}


def issue_order(sass: str) -> str:
    """The SASS as one letter per instruction that matters for loads in flight: L an LDG (to registers), A an
    LDGSTS (cp.async to shared), W a wait on cp.async, B a CTA barrier, s a shared load, | a branch, F a run of
    float math. An F between two Ls is a round trip in series: the math waits for its loads before the next issue."""
    out = []
    for line in sass.splitlines():
        m = re.search(r"\b(LDGSTS|LDG|DEPBAR|BAR\.SYNC|LDS|BRA|FFMA|FMUL|FADD)\b", line)
        if m:
            out.append(_ORDER.get(m.group(1), "F"))
    return re.sub(r"F+", "F", "".join(out))


def stats(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    regs = re.search(r"REG:(\d+)", _cuobjdump(kernel, "-res-usage"))
    return {"ld.global.v4": len(re.findall(r"ld\.global[.\w]*\.v4", ptx)), "ld.global": len(re.findall(r"ld\.global", ptx)),
            "cp.async": len(re.findall(r"cp\.async\.c[ag]", ptx)), "bar.sync": len(re.findall(r"bar\.sync", ptx)),
            "shared_B": kernel.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "sass_order": issue_order(_cuobjdump(kernel, "-sass"))}


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--sass"]:
        n, k, prologue = SHAPES[args[1]]
        sass = _cuobjdump(compile_config(k, prologue, tuple(int(v) for v in args[2].split(","))), "-sass")
        print("\n".join(line.split(";")[0].strip() + " ;" for line in sass.splitlines()
                        if re.search(r"\b(LDG|LDGSTS|STG|LDS|BAR|MUFU|DEPBAR)", line)))
        return 0
    configs = [tuple(int(v) for v in a.split(",")) for a in args] or G.CANDIDATES
    for name, (n, k, prologue) in SHAPES.items():
        seen = set()
        for config in configs:
            launch = G.resolve(config, k)
            if launch not in seen:
                seen.add(launch)
                print(name, launch, stats(compile_config(k, prologue, config)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
