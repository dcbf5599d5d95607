"""What one ``lazy+recover`` blend dispatches, on the CPU: a proxy for its GPU launches and host syncs.

    .venv/bin/python benchmarks/recover_ops.py [--layers 4,8] [--path kernels|reference] \
        [--blend-from FILE] [--out benchmarks/results/recover_ops_cpu.json]

A tiny random Llama (Llama-3-like GQA: 8 query heads over 2 KV heads, head dim 32) with ``--docs`` documents cached;
one request in a new order runs ``engine/blend.py: selective_recompute`` with the named recovery's options
(``RECOVER_AS``), once to warm up and once measured. Counted, for each depth in ``--layers``:

* ops: the aten ops dispatched (under a ``TorchDispatchMode``: what the code asks for once composite ops are
  decomposed, not the CPU kernels' own inner calls), views, allocations and metadata left out: about one GPU launch
  each; each Triton kernel (``--path kernels``, the GPU's path: stood in by its reference) as one. Per layer is the
  difference between the two depths over their difference in layers;
* syncs: the calls that wait for the GPU when their tensor is on it: ``aten::_local_scalar_dense`` (``item``,
  ``int()``, ``float()``), ``aten::nonzero``, ``aten::unique``, ``aten::masked_select``, ``aten::repeat_interleave``
  without an output size, and ``Tensor.tolist`` / ``.cpu()`` / ``.numpy()`` called from lazyrag. On the CPU every
  tensor is a host one, so this counts every call that would sync if its tensor lived on the device (an upper
  bound); each is listed with its line;
* fp32 context bytes: the fp32 tensors the blend allocates that are at least a layer's context K
  (``N x Hkv x D``), and every context-sized tensor's bytes (``--dtype``: the pool's, bf16 as on the GPU).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import random
import sys
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[0] = str(Path(__file__).resolve().parents[1])

REPO = str(Path(__file__).resolve().parents[1])
# ops that launch no kernel: views, allocations, metadata
NO_LAUNCH = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::transpose",
    "aten::permute",
    "aten::t",
    "aten::select",
    "aten::slice",
    "aten::expand",
    "aten::as_strided",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::split",
    "aten::split_with_sizes",
    "aten::chunk",
    "aten::unbind",
    "aten::alias",
    "aten::detach",
    "aten::lift_fresh",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::flatten",
    "aten::view_as",
    "aten::expand_as",
    "aten::numpy_T",
    "aten::result_type",
    "aten::_reshape_alias",
    "aten::as_strided_",
    "aten::resize_",
    "aten::detach_",
    "aten::set_",
    "aten::is_nonzero",
}
# composite ops that copy or not: a launch when their output is not a view of their input
MAYBE_COPY = {"to", "contiguous", "reshape", "flatten", "type_as"}
HOST_METHODS = ("tolist", "cpu", "numpy")


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def tiny_llama(layers: int, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    from benchmarks.e2e_gpu import llama31_8b_config

    config = llama31_8b_config(
        layers,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.normal_(0, 0.1)
    return hf.to(dtype)


OURS = [f"{REPO}/lazyrag/"]  # the kernels included; and --blend-from's file


def _ours(filename: str) -> bool:
    return filename.startswith(tuple(OURS))


def _site(stack) -> str:
    """The innermost frame of ``stack`` in lazyrag (engine/blend.py, kernels/...), as ``file:line (function)``."""
    for frame in reversed(stack):
        if _ours(frame.filename):
            return f"{frame.filename.replace(REPO + '/', '')}:{frame.lineno} ({frame.name})"
    return "?"


class _IdSet:
    """Tensors by identity, held weakly (a ``WeakSet`` compares tensors by value)."""

    def __init__(self, items=()):
        self.refs: dict[int, weakref.ref] = {}
        for t in items:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        key = id(t)
        self.refs[key] = weakref.ref(t, lambda _, key=key: self.refs.pop(key, None))

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self.refs.get(id(t))
        return ref is not None and ref() is t


class DeviceTaint(TorchDispatchMode):
    """Which tensors would live on the GPU, and every call that would then wait for it.

    On the CPU every tensor is a host one. Marked as on the device: the model's weights, the pool, the RoPE tables,
    what ``.to(device)`` or a factory given ``device=`` the model's device (that object: ``x.device`` of a host
    tensor is not it) returns from the repository's code, and every op's output
    with a marked input. A sync is a marked tensor read by the host: ``item`` / ``int()`` / ``bool()``
    (``aten::_local_scalar_dense``), an op whose output size depends on its values (``nonzero``, ``unique``,
    ``masked_select``, ``repeat_interleave`` by a tensor, indexing by a boolean mask), or ``.tolist()`` / ``.cpu()``
    / ``.numpy()`` / ``.to("cpu")`` called from lazyrag. Also counted: host-to-device copies (``h2d``), and the
    bytes of the non-view outputs that are context-sized (a dim of ``N`` context rows, at least ``N x Hkv x D``
    elements), fp32 apart."""

    FACTORIES = ("zeros", "ones", "full", "arange", "tensor", "empty", "as_tensor", "randn")

    def __init__(self, roots, device: torch.device, n_ctx: tuple[int, ...], threshold: int):
        super().__init__()
        self.device = device  # the model's device object: ``device=`` it (not ``x.device`` of a host tensor) marks
        self.dev = _IdSet(roots)
        self.n_ctx, self.threshold = set(n_ctx), threshold
        self.syncs: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self.h2d = self.fp32 = self.any = self.fp32_count = 0
        self.paused = 0
        self.saved: list = []

    def _sync(self, what: str) -> None:
        self.syncs[f"{what} {_site(traceback.extract_stack())}"] += 1

    def _ours(self) -> bool:
        return not self.paused and _ours(sys._getframe(2).f_code.co_filename)

    def __enter__(self):
        for name in HOST_METHODS:
            self._patch(torch.Tensor, name, self._host_method(name))
        self._patch(torch.Tensor, "to", self._to)
        for name in self.FACTORIES:
            self._patch(torch, name, self._factory)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)
        self.saved.clear()
        return super().__exit__(*exc)

    def _patch(self, owner, name, make):
        orig = getattr(owner, name)
        self.saved.append((owner, name, orig))
        setattr(owner, name, make(orig))

    def _host_method(self, name):
        def make(orig):
            def hooked(t, *a, **kw):
                if self._ours() and t in self.dev:
                    self._sync(f"{name}()")
                out = orig(t, *a, **kw)
                if out is t:  # a host copy, not marked
                    self.paused += 1
                    out = out.clone()
                    self.paused -= 1
                return out

            return hooked

        return make

    def _to(self, orig):
        def hooked(t, *a, **kw):
            target = kw.get("device", next((x for x in a if isinstance(x, (torch.device, str))), None))
            out = orig(t, *a, **kw)
            if target is not self.device or not self._ours():
                return out
            if t not in self.dev:
                self.h2d += 1
                out = out.clone() if out is t else out  # its own tensor, as a copy to the GPU would be
                self.dev.add(out)
            return out

        return hooked

    def _factory(self, orig):
        def hooked(*a, **kw):
            out = orig(*a, **kw)
            if kw.get("device") is self.device and self._ours():
                if orig.__name__ in ("tensor", "as_tensor"):
                    self.h2d += 1
                self.dev.add(out)
            return out

        return hooked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        copied = name in MAYBE_COPY and isinstance(out, torch.Tensor) and first is not None and not _shares(out, first)
        if copied or (not func.is_view and f"aten::{name}" not in NO_LAUNCH and name not in MAYBE_COPY):
            self.ops[f"aten::{name}"] += 1
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        on_dev = any(a in self.dev for a in flat)
        if on_dev:
            bool_index = name in ("index", "index_put", "index_put_") and any(
                a.dtype in (torch.bool, torch.uint8) for a in flat[1:]
            )
            by_tensor = name == "repeat_interleave" and kwargs.get("output_size") is None and len(flat) == 2
            if name in ("_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive") or (
                name == "masked_select" or bool_index or by_tensor
            ):
                self._sync(f"aten::{name}")
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            if on_dev:
                self.dev.add(t)
            allocated = not func.is_view and not func._schema.is_mutable and (name not in MAYBE_COPY or copied)
            if allocated and self.n_ctx & set(t.shape) and t.numel() >= self.threshold:
                self.any += t.numel() * t.element_size()
                if t.dtype == torch.float32:
                    self.fp32 += t.numel() * t.element_size()
                    self.fp32_count += 1
        return out


def _stand_in_kernels(blend, path: str, pausers: list, calls: collections.Counter) -> None:
    """Each Triton kernel blend.py calls as one launch (``triton::name``). ``kernels`` (the GPU's path): the kernels
    taken as checked and stood in by their references in the kernel's output dtype (Triton's interpreter computes
    bf16 wrong), their own work not counted."""
    from lazyrag.kernels.reference import gather_rotated_reference, prefix_attention_reference

    refs = {
        "prefix_attention": lambda q, k, v, limit, s: prefix_attention_reference(q, k, v, limit, s).to(q.dtype),
        "gather_rotated": gather_rotated_reference,
    }
    owners = dict.fromkeys(refs, blend)
    if path == "kernels":
        from lazyrag.kernels import elementwise
        from lazyrag.model import llama

        blend.KERNEL_ON_CPU = True
        blend._kernel_checked = lambda *a: True
        for name in ("rms_norm", "add_rms_norm", "silu_mul"):
            refs[name], owners[name] = getattr(llama, name), elementwise
    for name, ref in refs.items():

        def wrapped(*a, _ref=ref, _name=name):
            if not pausers[0].paused:
                calls[_name] += 1
            for p in pausers:
                p.paused += 1
            try:
                return _ref(*a)
            finally:
                for p in pausers:
                    p.paused -= 1

        wrapped.__module__ = owners[name].__name__
        setattr(owners[name], name, wrapped)


def count(layers: int, args) -> dict:
    from lazyrag.engine import LazyEngine, SamplingParams, blend
    from lazyrag.prompt import PromptLayout
    from lazyrag.strategy_names import RECOVER_AS, lazy_options

    dtype = getattr(torch, args.dtype)
    hf = tiny_llama(layers, dtype)
    engine = LazyEngine.from_hf(hf, None, device="cpu", dtype=dtype, kv_budget=256 << 20)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, 4000) for _ in range(n)]  # noqa: E731
    prefix, docs, question = ids(32), [ids(args.doc_tokens) for _ in range(args.docs)], ids(16)
    engine.submit(PromptLayout(prefix, docs, question), SamplingParams(max_new_tokens=1)).result()  # docs cached
    opts = lazy_options(RECOVER_AS)
    kw = dict(
        first=opts.get("recompute_first", 0),
        selection=opts.get("blend_select", "global"),
        per_chunk=opts.get("blend_budget", "global") == "chunk",
        attn_from=opts.get("attn_from", 0.0),
    )
    runner, pool = engine.runner, engine.cache.pool
    hkv, hd = pool.k.shape[-2:]
    n_ctx = len(prefix) + sum(map(len, docs))
    roots = [*runner.model.parameters(), *runner.model.buffers(), pool.k, pool.v, runner.rope_cos, runner.rope_sin]
    assert runner.device is pool.device
    taint = DeviceTaint(roots, runner.device, (n_ctx, n_ctx + len(question)), n_ctx * hkv * hd)
    kernel_calls: collections.Counter = collections.Counter()
    if args.blend_from:  # another version of engine/blend.py, e.g. an older commit's
        OURS.append(str(Path(args.blend_from).resolve()))
        spec = importlib.util.spec_from_file_location("blend_under_test", args.blend_from)
        assert spec is not None and spec.loader is not None
        blend = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = blend
        spec.loader.exec_module(blend)
    _stand_in_kernels(blend, args.path, [taint], kernel_calls)
    if args.path == "kernels":  # the GPU engine's runner: Triton norms and silu*up (stood in, one launch each)
        runner.ops = runner.ops.with_triton_kernels()
        getattr(blend, "_triton_dense_ops", functools.lru_cache(lambda: None)).cache_clear()
    lazy = engine.core.planner["lazy"]

    def one(seed: int, hook=None):
        order = docs[:]
        random.Random(seed).shuffle(order)
        layout = PromptLayout(prefix, order, question)
        plan, owned = lazy.plan(layout), []

        def allocate(n):
            owned.extend(engine.cache.allocate(n))
            return owned[-n:]

        def run():
            return blend.selective_recompute(
                runner,
                plan.context,
                [None, *layout.chunk_ids],
                opts["blend"],
                allocate,
                question=list(layout.question_ids),
                question_start=layout.question_start,
                **kw,
            )

        try:
            return run() if hook is None else hook(run), layout
        finally:
            pool.decref(owned)
            lazy.release(plan)

    one(1)  # warm-up
    kernel_calls.clear()

    def tainted(run):
        with taint:
            return run()

    b, layout = one(2, tainted)
    taint.ops.update({f"triton::{k}": v for k, v in kernel_calls.items()})
    return {
        "layers": layers,
        "context_tokens": n_ctx,
        "chunk_tokens": sum(map(len, layout.chunk_ids)),
        "selected": len(b.selected),
        "ops": sum(taint.ops.values()),
        "syncs": sum(taint.syncs.values()),
        "h2d_copies": taint.h2d,
        "sync_sites": dict(taint.syncs.most_common()),
        "ops_by_name": dict(taint.ops.most_common()),
        "fp32_context_bytes": taint.fp32,
        "fp32_context_tensors": taint.fp32_count,
        "context_sized_bytes": taint.any,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,8", help="two depths (per layer: the difference)")
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=100)  # 532 context tokens: no other dim is that
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--path", choices=("kernels", "reference"), default="kernels", help="kernels: the GPU's path")
    ap.add_argument("--label", default="")
    ap.add_argument("--blend-from", help="measure this file as engine/blend.py (git show REV:lazyrag/engine/blend.py)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/recover_ops_cpu.json"))
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    runs = [count(n, args) for n in depths]
    lo, hi = runs[0], runs[-1]
    span = max(1, hi["layers"] - lo["layers"])
    per_layer = {"ops": (hi["ops"] - lo["ops"]) / span, "syncs": (hi["syncs"] - lo["syncs"]) / span}
    print(f"{args.label or 'tree'}: lazy+recover ({args.path}, {args.dtype}), {lo['context_tokens']} context tokens")
    print(f"{'layers':>6} {'ops':>6} {'syncs':>6} {'fp32 ctx MB':>12} {'ctx-sized MB':>13} {'selected':>9}")
    for r in runs:
        print(
            f"{r['layers']:>6} {r['ops']:>6} {r['syncs']:>6} {r['fp32_context_bytes'] / 2**20:>12.2f} "
            f"{r['context_sized_bytes'] / 2**20:>13.2f} {r['selected']:>9}"
        )
    print(f"per layer: {per_layer['ops']:.1f} ops, {per_layer['syncs']:.1f} syncs")
    print(f"sync sites at {hi['layers']} layers:")
    for site, n in hi["sync_sites"].items():
        print(f"  {n:4d}  {site}")
    print(
        f"top ops at {hi['layers']} layers: " + ", ".join(f"{k} x{v}" for k, v in list(hi["ops_by_name"].items())[:12])
    )
    res = {"label": args.label, "command": "python " + " ".join(sys.argv), "per_layer": per_layer, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
