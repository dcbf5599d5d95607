"""Benchmark the LazyAttention kernels on a GPU (Llama-3.1-8B attention shapes, bf16).

Fair by construction: "lazy" and "off" run on the *same* shuffled paged layout (same block
table, same physical blocks); for "off" every block's K was re-rotated in place beforehand and
the kernel runs with rotation off, so the two differ only in the deferred rotation. Prefill is
also compared with torch SDPA (flash backend) on a contiguous re-rotated copy; decode with a
measured device-to-device copy. Every timing is given eager (host launch cost included, what a
caller without CUDA graphs pays) and replayed from a CUDA graph (device time). Each row logs
the kernel config, registers, spills, shared memory, programs per SM and waves.

    python benchmarks/kernels.py [--out PATH] [--quick] [--sweep [--sweep-only decode|prefill]] [--no-grid]

``--sweep`` first times the tuned candidates and rotation schedules on a few shapes (to choose
the defaults; ``--adopt`` then passes the fastest to the grid's calls as ``tuned=`` overrides, the layout of
kernels/tuned_configs.json, and writes them to kernel_defaults.json); on a Hopper GPU the prefill sweep also
times the Gluon kernel (kernels/prefill_wgmma.py, rows ``mode=wgmma`` / ``wgmma off``), which the
grid's prefill rows use wherever ``lazy_prefill`` picks it (unsplit prefills). Writes JSON (default
benchmarks/results/kernels.json, or $OUT/kernels.json) and a PNG.

What a forward pass pays, not what one lonely call pays: CUDA-graph timings share one tile table
(built once per forward for all layers; 1/32 of its build is added), a decode graph holds at least
4 calls on 4 KV copies, and compared variants are timed in alternating rounds (median ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import triton

from lazyrag.kernels import prefill_wgmma
from lazyrag.kernels.common import pack_block_meta, unpack_block_meta
from lazyrag.kernels.decode import lazy_decode
from lazyrag.kernels.kvloop import ROTATION_MODES, kernel_resources, last_launch, tile_table
from lazyrag.kernels.prefill import lazy_prefill
from lazyrag.kernels.reference import apply_rotary, lazy_decode_reference, lazy_prefill_reference, rope_tables
from lazyrag.kernels.tuned import tuned as tuned_table

HQ, HKV, D, BS = 32, 8, 128, 16
DT = torch.bfloat16
MAX_POS = 1 << 16
L2_BYTES = 60 * 2**20
LAYERS = 32  # Llama-3.1-8B: one tile table per forward pass serves this many attention calls
ROUNDS = 5  # alternating timing rounds per compared set (paired_graph_ms)
MIN_SETS = 4  # decode: KV copies (and calls per CUDA graph) at the least


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def make_case(gen, batch, ctx, n_docs, dev):
    """Each sequence: n_docs documents of random lengths summing to ctx, each padded to whole
    blocks at shuffled physical ids, each with a random delta."""
    seqs = []
    for _ in range(batch):
        cuts = torch.sort(torch.randperm(ctx - 1, generator=gen)[: n_docs - 1] + 1).values.tolist()
        bounds = [0] + cuts + [ctx]
        seqs.append([bounds[i + 1] - bounds[i] for i in range(n_docs)])
    nblk = [sum((n + BS - 1) // BS for n in s) for s in seqs]
    total = sum(nblk)
    perm = torch.randperm(total, generator=gen)
    width = max(nblk)
    meta = torch.zeros(batch, width, dtype=torch.int64)
    pos = 0
    for b, s in enumerate(seqs):
        ids, dl, vl = [], [], []
        for n in s:
            nb = (n + BS - 1) // BS
            ids += perm[pos : pos + nb].tolist()
            pos += nb
            dl += [int(torch.randint(0, MAX_POS // 2, (1,), generator=gen))] * nb
            vl += [BS] * (nb - 1) + [n - (nb - 1) * BS]
        meta[b, : len(ids)] = pack_block_meta(torch.tensor(ids), torch.tensor(dl), torch.tensor(vl))
    k = torch.randn(total, BS, HKV, D, device=dev, dtype=DT)
    v = torch.randn(total, BS, HKV, D, device=dev, dtype=DT)
    return k, v, meta.to(dev), torch.tensor(nblk, dtype=torch.int32, device=dev)


def rotated_in_place(k, meta, nblk, cos, sin):
    """The same pool with every used block's K re-rotated by its delta (each block belongs to one
    document here): the rotation-off kernel on it computes what the lazy kernel computes on k."""
    ids, dl, _ = unpack_block_meta(meta)
    used = torch.arange(meta.shape[1], device=meta.device)[None, :] < nblk[:, None].long()
    ids, dl = ids[used], dl[used]
    kk = k.clone()
    for i in range(0, ids.numel(), 4096):  # bounded fp32 temporaries
        bi, di = ids[i : i + 4096], dl[i : i + 4096]
        kk[bi] = apply_rotary(k[bi].float(), cos[di][:, None, None, :], sin[di][:, None, None, :]).to(k.dtype)
    return kk


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def copy_bandwidth(dev):
    x = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device=dev).normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / (ms * 1e-3) / 1e12  # TB/s, read + write


def share_tables(cache):
    """Let CUDA-graph captures use the tile tables already built for this block table. A forward pass of the
    engine builds one table and every layer's attention reads it; replaying the build with each timed call would
    charge one layer the whole forward's table (its device time is reported on its own, and a 1/LAYERS share is
    added to the overhead)."""
    if cache is not None:
        for (pages, block_size, capturing, packed), v in list(cache.items()):
            if not capturing:
                cache[(pages, block_size, True, packed)] = v


def capture(fn, calls=1, cache=None):
    fn()
    torch.cuda.synchronize()
    share_tables(cache)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def graph_ms(fn, calls=1, cache=None):
    """Median ms of one call replayed from a CUDA graph holding ``calls`` calls."""
    g = capture(fn, calls, cache)
    ms = bench(g.replay) / calls
    del g
    return ms


def paired_graph_ms(fns, calls=1, cache=None, rounds=ROUNDS):
    """Device ms of each of ``fns`` (CUDA graphs), timed in alternating rounds (A B C A B C ...) so that drift
    (clocks, temperature, the machine's other tenants) hits every variant alike: (median ms of each, median over
    rounds of each one's ratio to the first). A difference under the rounds' spread is noise."""
    graphs = [capture(fn, calls, cache) for fn in fns]
    per = [[] for _ in fns]
    for _ in range(rounds):
        for g, p in zip(graphs, per):
            p.append(triton.testing.do_bench(g.replay, warmup=10, rep=40, return_mode="median") / calls)
    del graphs
    med = [statistics.median(p) for p in per]
    ratio = [statistics.median(a / b for a, b in zip(p, per[0])) for p in per]
    spread = [(max(p) - min(p)) / statistics.median(p) for p in per]
    return med, ratio, spread


def table_graph_ms(meta, nblk, pages, packed=False):
    """Device time of one tile-table build (what a forward pass pays once for all its layers)."""
    return graph_ms(lambda: tile_table(meta, nblk, pages, BS, packed=packed))


def launch_info(kind):
    """The last launch's kernel name, splits, resources, programs and waves."""
    name, grid, splits = last_launch[kind]
    res = dict(kernel_resources.get(name, {}))
    programs = int(grid[0] * grid[1] * grid[2])
    bps = res.get("blocks_per_sm")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return dict(kernel=name, splits=splits, programs=programs, waves=programs / (sms * bps) if bps else None, **res)


def fmt_info(i):
    return (
        f"{i['kernel']} splits={i['splits']} regs={i.get('regs')} spills={i.get('spills')} "
        f"smem={i.get('shared')} blk/SM={i.get('blocks_per_sm')} waves={i['waves'] and round(i['waves'], 2)}"
    )


class PrefillCase:
    def __init__(self, gen, dev, cos, sin, batch, ctx, n_docs, n_new, tuned=None):
        self.batch, self.ctx, self.docs, self.new = batch, ctx, n_docs, n_new
        self.k, self.v, self.meta, self.nblk = make_case(gen, batch, ctx, n_docs, dev)
        self.kk = rotated_in_place(self.k, self.meta, self.nblk, cos, sin)
        T = batch * n_new
        self.q = torch.randn(T, HQ, D, device=dev, dtype=DT)
        self.kn = torch.randn(T, HKV, D, device=dev, dtype=DT)
        self.vn = torch.randn(T, HKV, D, device=dev, dtype=DT)
        self.cu = torch.arange(0, T + 1, n_new, device=dev, dtype=torch.int32)
        self.cos, self.sin, self.scale = cos, sin, D**-0.5
        self.cache = {}  # tile tables, built once (the engine builds them once per forward, for all layers)
        self.tuned = tuned  # adopted defaults (kernel options' ``tuned``)

    def lazy(self, **kw):
        kw.setdefault("tuned", self.tuned)
        return lambda: lazy_prefill(
            self.q,
            self.kn,
            self.vn,
            self.cu,
            self.k,
            self.v,
            self.meta,
            self.nblk,
            self.cos,
            self.sin,
            self.scale,
            max_seqlen_q=self.new,
            tile_cache=self.cache,
            **kw,
        )

    def off(self, **kw):
        kw.setdefault("tuned", self.tuned)
        return lambda: lazy_prefill(
            self.q,
            self.kn,
            self.vn,
            self.cu,
            self.kk,
            self.v,
            self.meta,
            self.nblk,
            self.cos,
            self.sin,
            self.scale,
            max_seqlen_q=self.new,
            apply_rotation=False,
            **kw,
        )

    def flops(self):
        return 4 * self.batch * HQ * D * self.new * (self.ctx + (self.new + 1) / 2)


def run_prefill(gen, dev, cos, sin, batch, ctx, n_docs, n_new, tuned=None):
    c = PrefillCase(gen, dev, cos, sin, batch, ctx, n_docs, n_new, tuned)
    out = c.lazy()()
    err = rel(out, lazy_prefill_reference(c.q, c.kn, c.vn, c.cu, c.k, c.v, c.meta, c.nblk, cos, sin, c.scale))
    err_off = rel(c.off()(), out)
    # SDPA baseline on a contiguous re-rotated copy (valid tokens only) + the new tokens
    ids, _, vl = unpack_block_meta(c.meta)
    keep = torch.arange(BS, device=dev)[None, None, :] < vl[:, :, None]  # [B, W, BS]
    kc = c.kk[ids][keep].view(batch, ctx, HKV, D)
    vc = c.v[ids][keep].view(batch, ctx, HKV, D)
    ks = torch.cat((kc, c.kn.view(batch, n_new, HKV, D)), 1).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vs = torch.cat((vc, c.vn.view(batch, n_new, HKV, D)), 1).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    qs = c.q.view(batch, n_new, HQ, D).transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(n_new, ks.shape[2])
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=c.scale)  # noqa
    lazy_e = (bench(c.lazy()), bench(c.lazy()))
    info = launch_info("prefill")
    off_e = (bench(c.off()), bench(c.off()))
    info_off = launch_info("prefill")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if dev.type == "cuda" else SDPBackend.MATH):
        sdpa_err = rel(sdpa().transpose(1, 2).reshape(-1, HQ, D), out)
        sdpa_e = (bench(sdpa), bench(sdpa))
        (of_g, lz_g, sd_g), (_, ratio, _), spread = paired_graph_ms([c.off(), c.lazy(), sdpa], cache=c.cache)
    del ks, vs, kc, vc
    ns_g = graph_ms(c.lazy(num_splits=1), cache=c.cache) if info["splits"] > 1 else None
    table_ms = table_graph_ms(c.meta, c.nblk, info_pages(info), packed="packed=True" in info["kernel"])
    lz_fwd = lz_g + table_ms / LAYERS  # the kernel plus its share of the forward's one tile table
    fl = c.flops()
    lz, of, sd = min(lazy_e), min(off_e), min(sdpa_e)
    return dict(
        kind="prefill",
        batch=batch,
        ctx=ctx,
        docs=n_docs,
        new=n_new,
        err=err,
        err_off=err_off,
        err_sdpa=sdpa_err,
        ms_lazy=lz,
        ms_off=of,
        ms_sdpa=sd,
        ms_lazy_runs=lazy_e,
        ms_off_runs=off_e,
        ms_sdpa_runs=sdpa_e,
        ms_lazy_graph=lz_g,
        ms_off_graph=of_g,
        ms_sdpa_graph=sd_g,
        ms_lazy_graph_with_table_share=lz_fwd,
        graph_spread=spread,
        ms_lazy_nosplit_graph=ns_g,
        ms_tile_table_graph=table_ms,
        tflops_lazy=fl / lz / 1e9,
        tflops_sdpa=fl / sd / 1e9,
        tflops_lazy_graph=fl / lz_fwd / 1e9,
        tflops_sdpa_graph=fl / sd_g / 1e9,
        overhead_pct=100 * (lz / of - 1),
        overhead_graph_pct=100 * (ratio + table_ms / LAYERS / of_g - 1),
        overhead_graph_table_per_call_pct=100 * (ratio + table_ms / of_g - 1),
        lazy_kernel=info,
        off_kernel=info_off,
    )


def info_pages(info):
    bn = int(info["kernel"].split(" bn=")[1].split()[0])
    return bn // BS


class DecodeCase:
    def __init__(self, gen, dev, cos, sin, batch, ctx, n_docs, tuned=None):
        self.batch, self.ctx, self.docs = batch, ctx, n_docs
        self.k, self.v, self.meta, self.nblk = make_case(gen, batch, ctx, n_docs, dev)
        self.kk = rotated_in_place(self.k, self.meta, self.nblk, cos, sin)
        self.q = torch.randn(batch, HQ, D, device=dev, dtype=DT)
        self.cos, self.sin, self.scale = cos, sin, D**-0.5
        self.kv_bytes = 2 * int(self.nblk.sum()) * BS * HKV * D * 2
        # small problems fit in L2: rotate among copies so timings read HBM, not cache; and at least MIN_SETS calls
        # per CUDA graph, so that the graph's own launch (several µs after do_bench's L2 flush) is not charged whole
        # to one ~80 µs call: in a forward pass the kernel runs back to back with the others
        self.n_sets = max(MIN_SETS, min(8, math.ceil(4 * L2_BYTES / self.kv_bytes)))
        self.sets = [(self.k, self.v, self.kk)] + [
            (self.k.clone(), self.v.clone(), self.kk.clone()) for _ in range(self.n_sets - 1)
        ]
        self.cache = {}
        self.tuned = tuned
        self.i = 0

    def _next(self):
        self.i = (self.i + 1) % self.n_sets
        return self.sets[self.i]

    def lazy(self, **kw):
        kw.setdefault("tuned", self.tuned)

        def f():
            k, v, _ = self._next()
            return lazy_decode(
                self.q, k, v, self.meta, self.nblk, self.cos, self.sin, self.scale, tile_cache=self.cache, **kw
            )

        return f

    def off(self, **kw):
        kw.setdefault("tuned", self.tuned)

        def f():
            _, v, kk = self._next()
            return lazy_decode(
                self.q, kk, v, self.meta, self.nblk, self.cos, self.sin, self.scale, apply_rotation=False, **kw
            )

        return f

    def bytes_moved(self):
        return self.kv_bytes + 2 * self.q.numel() * 2 + self.meta.numel() * 8


def run_decode(gen, dev, cos, sin, batch, ctx, n_docs, copy_tbs, tuned=None):
    c = DecodeCase(gen, dev, cos, sin, batch, ctx, n_docs, tuned)
    out = lazy_decode(c.q, c.k, c.v, c.meta, c.nblk, cos, sin, c.scale, tuned=tuned)
    err = rel(out, lazy_decode_reference(c.q, c.k, c.v, c.meta, c.nblk, cos, sin, c.scale))
    err_off = rel(
        lazy_decode(c.q, c.kk, c.v, c.meta, c.nblk, cos, sin, c.scale, apply_rotation=False, tuned=tuned), out
    )
    lazy_e = (bench(c.lazy()), bench(c.lazy()))
    info = launch_info("decode")
    off_e = (bench(c.off()), bench(c.off()))
    info_off = launch_info("decode")
    (of_g, lz_g), (_, ratio), spread = paired_graph_ms([c.off(), c.lazy()], c.n_sets, cache=c.cache)
    table_ms = table_graph_ms(c.meta, c.nblk, info_pages(info), packed="packed=True" in info["kernel"])
    lz_fwd = lz_g + table_ms / LAYERS
    lz, of = min(lazy_e), min(off_e)
    bm = c.bytes_moved()
    tbs = lambda ms: bm / (ms * 1e-3) / 1e12  # noqa: E731
    return dict(
        kind="decode",
        batch=batch,
        ctx=ctx,
        docs=n_docs,
        err=err,
        err_off=err_off,
        ms_lazy=lz,
        ms_off=of,
        ms_lazy_runs=lazy_e,
        ms_off_runs=off_e,
        ms_lazy_graph=lz_g,
        ms_off_graph=of_g,
        ms_lazy_graph_with_table_share=lz_fwd,
        graph_spread=spread,
        ms_tile_table_graph=table_ms,
        tbs_lazy=tbs(lz),
        tbs_lazy_graph=tbs(lz_fwd),
        bw_frac=tbs(lz) / copy_tbs,
        bw_frac_graph=tbs(lz_fwd) / copy_tbs,
        bw_frac_off=tbs(of) / copy_tbs,
        bw_frac_off_graph=tbs(of_g) / copy_tbs,
        overhead_pct=100 * (lz / of - 1),
        overhead_graph_pct=100 * (ratio + table_ms / LAYERS / of_g - 1),
        overhead_graph_table_per_call_pct=100 * (ratio + table_ms / of_g - 1),
        l2_sets=c.n_sets,
        lazy_kernel=info,
        off_kernel=info_off,
    )


SWEEP_DECODE = [(64, 8192, 10), (32, 8192, 10), (8, 32768, 10), (8, 8192, 10), (8, 8192, 1)]  # (batch, ctx, docs)
# (..., new tokens); round 10 added B=8 at 8k with 10 and 1 documents (the 0.87x row; the 1-document control)
SWEEP_PREFILL = [(1, 2048, 10, 64), (1, 8192, 10, 64), (8, 2048, 10, 512), (8, 8192, 10, 512), (8, 8192, 1, 512)]


def sweep(gen, dev, cos, sin, copy_tbs, log, kinds=("decode", "prefill")):
    """Configs x rotation schedules (x split counts for short prefills) per shape, all variants of a shape timed
    in alternating rounds from CUDA graphs (tile tables shared as in a forward pass). Mode "R off" is schedule R's
    loop with the rotation off, on K re-rotated in place; ``ratio`` is each variant's time over the shape's first
    variant."""
    rows = []

    def run_shape(label, variants, calls, cache, err_of, extra):
        ok = []
        for v in variants:
            try:
                e = err_of(v)
            except Exception as ex:  # noqa: BLE001  e.g. out of shared memory
                log(f"{label} {v['desc']} failed: {repr(ex)[:200]}")
                continue
            v["info"] = launch_info(v["kind"])
            v["err"] = e
            ok.append(v)
        (meds, ratios, spreads) = paired_graph_ms([v["fn"] for v in ok], calls, cache=cache, rounds=3)
        for v, ms, r, sp in zip(ok, meds, ratios, spreads):
            row = dict(
                kind=v["kind"],
                desc=v["desc"],
                config=list(v["cfg"]),
                mode=v["mode"],
                splits_forced=v.get("splits"),
                ms_graph=ms,
                ratio_to_first=r,
                spread=sp,
                err_vs_ref=v["err"],
                **extra,
                **v["info"],
            )
            rows.append(row)
            log(
                f"  {label} {v['desc']:<38}: {1e3 * ms:7.1f} us  x{r:5.3f}  spread {100 * sp:4.1f}%  err "
                f"{v['err']:.1e}  {fmt_info(v['info'])}"
            )

    for batch, ctx, docs in SWEEP_DECODE if "decode" in kinds else ():
        c = DecodeCase(gen, dev, cos, sin, batch, ctx, docs)
        dt = tuned_table(dev)["decode"]
        ref = lazy_decode(
            c.q, c.kk, c.v, c.meta, c.nblk, cos, sin, c.scale, apply_rotation=False, config=tuple(dt["config"])
        )
        variants = []
        cands = [tuple(x) for x in dt["candidates"]]
        for cfg in (cands[0], cands[2]):
            for mode in ROTATION_MODES if cfg == cands[0] else (2,):
                for lazy in (True, False):
                    for splits in (None, 4, 16) if batch <= 8 and mode == 2 and cfg == cands[0] else (None,):
                        kw = dict(config=cfg, rotation_mode=mode, num_splits=splits)
                        fn = c.lazy(**kw) if lazy else c.off(**kw)
                        label = mode if lazy else f"{mode} off"
                        variants.append(
                            dict(
                                kind="decode",
                                cfg=cfg,
                                mode=label,
                                splits=splits,
                                fn=fn,
                                desc=f"cfg={cfg} mode={label} splits={splits}",
                            )
                        )
        # an eager call of the timed function checks it (its KV copies hold the same values)
        run_shape(
            f"decode B={batch:2} {ctx // 1024:2}k d={docs:2}",
            variants,
            c.n_sets,
            c.cache,
            lambda v, ref=ref: rel(v["fn"](), ref),
            dict(batch=batch, ctx=ctx, docs=docs, bytes=c.bytes_moved(), copy_tbs=copy_tbs),
        )
        del c
        torch.cuda.empty_cache()
    for batch, ctx, docs, new in SWEEP_PREFILL if "prefill" in kinds else ():
        c = PrefillCase(gen, dev, cos, sin, batch, ctx, docs, new)
        ref = lazy_prefill_reference(c.q, c.kn, c.vn, c.cu, c.k, c.v, c.meta, c.nblk, cos, sin, c.scale)
        variants = []
        short = new <= 64 and batch == 1
        pt = tuned_table(dev)["prefill"]
        cands = [tuple(x) for x in pt["candidates"]]
        default = tuple(pt["config"])
        for cfg in cands if short else cands[:2]:
            for mode in ROTATION_MODES if cfg == default or not short else (5, 7):
                for lazy in (True, False):
                    for splits in (None, 8, 16) if short else (None,):
                        kw = dict(config=cfg, num_splits=splits, rotation_mode=mode)
                        fn = c.lazy(**kw) if lazy else c.off(**kw)
                        label = mode if lazy else f"{mode} off"
                        variants.append(
                            dict(
                                kind="prefill",
                                cfg=cfg,
                                mode=label,
                                splits=splits,
                                fn=fn,
                                desc=f"cfg={cfg} mode={label} splits={splits}",
                            )
                        )
        wgmma_default = tuple(tuned_table(dev)["prefill_wgmma"]["config"])
        if not short and prefill_wgmma.supported(c.q.dtype, D, dev, BS, wgmma_default[1]):  # the Gluon kernel
            for cfg in (wgmma_default, (128, 128, 12, 3)):
                for lazy in (True, False):
                    fn = (c.lazy if lazy else c.off)(kernel="wgmma", config=cfg)
                    mode = "wgmma" if lazy else "wgmma off"
                    variants.append(dict(kind="prefill", cfg=cfg, mode=mode, fn=fn, desc=f"cfg={cfg} mode={mode}"))
        run_shape(
            f"prefill B={batch} {ctx // 1024}k d={docs:2} new={new:3}",
            variants,
            1,
            c.cache,
            lambda v, ref=ref: rel(v["fn"](), ref),
            dict(batch=batch, ctx=ctx, docs=docs, new=new, flops=c.flops()),
        )
        del c
        torch.cuda.empty_cache()
    return rows


def adopt_sweep(rows, log):
    """The fastest lazy (config, rotation mode) of the sweep, by the geometric mean of its times over the sweep's
    shapes, per kernel: a ``tuned`` override (kernels/tuned_configs.json's layout) for the rest of the run."""
    chosen = {}
    for kind in ("decode", "prefill"):
        score = {}
        for r in rows:
            if r["kind"] == kind and r["mode"] in ROTATION_MODES and not r.get("splits_forced"):
                score.setdefault((tuple(r["config"]), r["mode"]), []).append(math.log(r["ms_graph"]))
        if not score:  # this kernel was not swept
            continue
        n = max(len(v) for v in score.values())
        best = min((sum(v) / n, k) for k, v in score.items() if len(v) == n)[1]
        chosen[kind] = dict(config=list(best[0]), rotation_mode=best[1])
        log(f"adopted for {kind}: config {best[0]}, rotation mode {best[1]}")
    return chosen


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    pre = [r for r in results if r["kind"] == "prefill"]
    dec = [r for r in results if r["kind"] == "decode"]
    lab = [f"b{r['batch']} {r['ctx'] // 1024}k d{r['docs']} n{r['new']}" for r in pre]
    x = range(len(pre))
    ax[0].bar([i - 0.2 for i in x], [r["tflops_lazy_graph"] for r in pre], 0.4, label="lazy")
    ax[0].bar([i + 0.2 for i in x], [r["tflops_sdpa_graph"] for r in pre], 0.4, label="SDPA flash (re-rotated copy)")
    ax[0].set_xticks(list(x), lab, rotation=90, fontsize=6)
    ax[0].set_ylabel("TFLOP/s (CUDA graph)")
    ax[0].set_title("prefill")
    ax[0].legend(fontsize=7)
    ax[1].bar([i - 0.2 for i in x], [r["overhead_graph_pct"] for r in pre], 0.4, color="C2", label="CUDA graph")
    ax[1].bar([i + 0.2 for i in x], [r["overhead_pct"] for r in pre], 0.4, color="C3", label="eager")
    ax[1].axhline(2, color="r", ls="--", lw=1)
    ax[1].axhline(5, color="r", ls=":", lw=1)
    ax[1].set_xticks(list(x), lab, rotation=90, fontsize=6)
    ax[1].set_ylabel("rotation overhead % (same layout)")
    ax[1].set_title("prefill: lazy vs rotation off (goals 2% / 5%)")
    ax[1].legend(fontsize=7)
    labd = [f"b{r['batch']} {r['ctx'] // 1024}k d{r['docs']}" for r in dec]
    xd = range(len(dec))
    ax[2].bar([i - 0.2 for i in xd], [100 * r["bw_frac_graph"] for r in dec], 0.4, label="lazy bandwidth % of copy")
    ax[2].bar([i + 0.2 for i in xd], [10 * r["overhead_graph_pct"] for r in dec], 0.4, label="overhead % x10")
    ax[2].axhline(85, color="r", ls="--", lw=1)
    ax[2].axhline(10, color="k", ls=":", lw=1)
    ax[2].set_xticks(list(xd), labd, rotation=90, fontsize=6)
    ax[2].set_title("decode (CUDA graph)\ngoals: >= 85% of copy; overhead <= 1% (10 on this axis)")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    ap.add_argument("--out", default=os.path.join(default_dir, "kernels.json"), help="JSON to write (a PNG beside it)")
    ap.add_argument("--quick", action="store_true", help="only the first 3 prefill and 3 decode shapes of the grid")
    ap.add_argument("--sweep", action="store_true", help="time every config and rotation schedule first")
    ap.add_argument("--no-grid", action="store_true", help="only the sweep")
    ap.add_argument("--sweep-only", choices=("decode", "prefill"), help="sweep one kernel's shapes only")
    ap.add_argument(
        "--adopt",
        action="store_true",
        help="after --sweep, run the grid with the sweep's fastest "
        "lazy config and rotation mode as defaults (written to kernel_defaults.json beside --out)",
    )
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: start no new row after this")
    a = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    cos, sin = (t.to(dev) for t in rope_tables(inv_freq, MAX_POS))
    copy_tbs = copy_bandwidth(dev)
    t0 = time.time()
    summary = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        copy_tbs=copy_tbs,
        command="python " + " ".join(sys.argv),
        autotune=os.environ.get("LAZYRAG_KERNEL_AUTOTUNE", "0"),
        results=[],
        sweep=[],
    )
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def save():
        summary["seconds"] = time.time() - t0
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)

    def log(msg):
        print(msg, flush=True)

    log(f"device {torch.cuda.get_device_name()}  copy bandwidth {copy_tbs:.2f} TB/s")
    adopted = None  # the sweep's choices, passed to every call of the grid as the kernel options' ``tuned``
    if a.sweep:
        summary["sweep"] = sweep(
            gen, dev, cos, sin, copy_tbs, log, (a.sweep_only,) if a.sweep_only else ("decode", "prefill")
        )
        if a.adopt:
            summary["adopted"] = adopted = adopt_sweep(summary["sweep"], log)
            with open(os.path.join(os.path.dirname(os.path.abspath(a.out)), "kernel_defaults.json"), "w") as f:
                json.dump(summary["adopted"], f)
        save()
    used = tuned_table(dev, adopted)
    summary["defaults_used"] = dict(
        prefill=[used["prefill"]["config"], used["prefill"]["rotation_mode"]],
        prefill_kernel=[used["prefill"]["kernel"], used["prefill_wgmma"]["config"]],
        decode=[used["decode"]["config"], used["decode"]["rotation_mode"]],
    )
    if a.no_grid:
        return 0
    results = summary["results"]
    pre_grid = [
        (b, c, d, n)
        for n in (64, 512)
        for c in (2048, 8192, 32768)
        for d in (1, 10)
        for b in (1, 8)
        if b * c <= 8 * 8192 and (c < 32768 or n == 512)
    ]
    dec_grid = [(b, c, d) for b in (1, 8, 32, 64) for c in (8192, 32768) for d in (1, 10) if b * c <= 64 * 8192]
    if a.quick:
        pre_grid, dec_grid = pre_grid[:3], dec_grid[:3]
    log(
        "prefill: eager ms (graph ms in brackets: the kernel plus 1/32 of the forward's tile table, whose device us is "
        "the 'table' column); overhead = lazy / off - 1 on the same layout, graph ratios paired over rounds"
    )
    log(
        f"{'B':>3} {'ctx':>6} {'docs':>4} {'new':>4} {'lazy':>15} {'off':>15} {'ovh%':>11} {'sdpa':>15} "
        f"{'lazy/sdpa':>11} {'err':>7} {'table':>5} kernel"
    )
    for b, c, d, n in pre_grid:
        if time.time() - t0 > a.budget:
            log(f"budget spent: skipping prefill {(b, c, d, n)}")
            continue
        r = run_prefill(gen, dev, cos, sin, b, c, d, n, tuned=adopted)
        results.append(r)
        log(
            f"{b:3} {c:6} {d:4} {n:4} {r['ms_lazy']:7.3f} [{r['ms_lazy_graph_with_table_share']:5.3f}] "
            f"{r['ms_off']:7.3f} [{r['ms_off_graph']:5.3f}] {r['overhead_pct']:5.1f} [{r['overhead_graph_pct']:4.1f}] "
            f"{r['ms_sdpa']:7.3f} [{r['ms_sdpa_graph']:5.3f}] {r['tflops_lazy'] / r['tflops_sdpa']:5.2f} "
            f"[{r['tflops_lazy_graph'] / r['tflops_sdpa_graph']:4.2f}] {r['err']:7.1e} "
            f"{1e3 * r['ms_tile_table_graph']:5.1f} {fmt_info(r['lazy_kernel'])}"
        )
        save()
        torch.cuda.empty_cache()
    log("decode: eager us (graph us in brackets, with 1/32 of the tile table); bandwidth as % of the copy")
    log(
        f"{'B':>3} {'ctx':>6} {'docs':>4} {'lazy':>15} {'off':>15} {'ovh%':>11} {'%copy':>11} {'%copy off':>11} "
        f"{'err':>7} {'table':>5} kernel"
    )
    for b, c, d in dec_grid:
        if time.time() - t0 > a.budget:
            log(f"budget spent: skipping decode {(b, c, d)}")
            continue
        r = run_decode(gen, dev, cos, sin, b, c, d, copy_tbs, tuned=adopted)
        results.append(r)
        log(
            f"{b:3} {c:6} {d:4} {1e3 * r['ms_lazy']:7.1f} [{1e3 * r['ms_lazy_graph_with_table_share']:5.1f}] "
            f"{1e3 * r['ms_off']:7.1f} "
            f"[{1e3 * r['ms_off_graph']:5.1f}] {r['overhead_pct']:5.1f} [{r['overhead_graph_pct']:4.1f}] "
            f"{100 * r['bw_frac']:5.1f} [{100 * r['bw_frac_graph']:4.1f}] {100 * r['bw_frac_off']:5.1f} "
            f"[{100 * r['bw_frac_off_graph']:4.1f}] {r['err']:7.1e} {1e3 * r['ms_tile_table_graph']:5.1f} "
            f"{fmt_info(r['lazy_kernel'])}"
        )
        save()
        torch.cuda.empty_cache()
    bad = [r for r in results if not (r["err"] < 2e-2 and r["err_off"] < 2e-2)]
    summary["n_bad"] = len(bad)
    save()
    plot(results, os.path.splitext(a.out)[0] + ".png")
    log(f"wrote {a.out}; {len(bad)} configs failed the correctness check; {time.time() - t0:.0f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
