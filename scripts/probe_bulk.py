"""How close state pages moved by bulk copies come to the copy bandwidth (issue 35's
question for a TMA-staged KDA decode: is the access pattern itself the ceiling?).

``BulkPages``: one persistent CTA per SM over a contiguous range of (request, head) items,
as KdaPipe splits them. Each item's page (64 KB fp32 or 32 KB bf16) is read whole into a
shared-memory stage by ``cp.async.bulk`` (one thread issues it, an mbarrier's transaction
count says it landed) and written to the item's target page by one bulk store from that
stage; the stage is refilled ``stages`` items ahead once the store has read it
(``cp.async.bulk.wait_group.read``). ``mode="regs"``: between the two, the CTA's 128
threads read the stage into registers (a value row's worth each, as a row-per-thread
recurrence would hold it) and write it back (``fence.proxy.async`` before the store).
Outputs: the target pages equal the source pages (checked once per row).

Timed as ``bench_kda.py`` times kernels (CUDA graphs of launches over rotated slot tables,
past L2), beside the copy bandwidth measured in the run; bytes: 2 pages per item.

    python3 scripts/probe_bulk.py [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402

from tpcomm.cuteutil import launch, smem_tensor  # noqa: E402

THREADS = 128
SMEM_LIMIT = 227 * 1024
CHUNK = 16 * 1024  # bytes per bulk load instruction


def bulk_load(shared: Int32, source: Int64, size: int, bar: Int32):
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
        f" [{{$r0}}], [{{$r1}}], {int(size)}, [{{$r2}}];",
        read_only_args=[shared, source, bar],
    )


def bulk_store(target: Int64, shared: Int32, size: int):
    cute.arch.inline_ptx(
        f"cp.async.bulk.global.shared::cta.bulk_group [{{$r0}}], [{{$r1}}], {int(size)};",
        read_only_args=[target, shared],
    )


def ld_shared_v4(shared: Int32):
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[cutlass.Uint32] * 4,
        read_only_args=[shared],
    )


def st_shared_v4(shared: Int32, words):
    cute.arch.inline_ptx(
        "st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[shared, *words],
    )


class BulkPages:
    def __init__(self, page_bytes, stages, mode, ctas):
        if stages * page_bytes + 1024 > SMEM_LIMIT or stages < 2:
            raise ValueError(f"stages must be >= 2 and fit; got {stages} of {page_bytes} B")
        if mode not in ("bulk", "regs"):
            raise ValueError(f"mode must be bulk or regs; got {mode!r}")
        self.page, self.stages, self.mode, self.ctas = page_bytes, stages, mode, ctas

    @cute.jit
    def __call__(self, pool: cute.Tensor, src: cute.Tensor, dst: cute.Tensor, stream):
        launch(self.kernel(pool, src, dst), (self.ctas, 1, 1), (THREADS, 1, 1), stream)

    @cute.jit
    def load(self, base, src, item, stage0, bars, s):
        bar = bars + s
        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.page)
        source = base + Int64(src[item]) * self.page
        for c in cutlass.range_constexpr(self.page // CHUNK):
            bulk_load(
                stage0 + s * self.page + c * CHUNK,
                source + c * CHUNK,
                CHUNK,
                Int32(bar.toint()),
            )

    @cute.kernel
    def kernel(self, pool, src, dst):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        items = src.shape[0]
        first = cta * items // self.ctas
        count = (cta + 1) * items // self.ctas - first
        smem = cutlass.memory.SmemAllocator()
        stage = smem_tensor(smem, cutlass.Uint8, (self.stages * self.page,), align=128)
        bar_t = smem_tensor(smem, cutlass.Int64, (self.stages,), align=8)
        bars = bar_t.iterator
        stage0 = Int32(stage.iterator.toint())
        base = Int64(pool.iterator.toint())
        if tid == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(bars + s, 1)
            cute.arch.mbarrier_init_fence()
            for s in cutlass.range_constexpr(self.stages):
                if s < count:
                    self.load(base, src, first + s, stage0, bars, s)
        cute.arch.sync_threads()
        n = Int32(0)
        while n < count:
            s = n % self.stages
            phase = (n // self.stages) % 2
            here = stage0 + s * self.page
            if cutlass.const_expr(self.mode == "regs"):
                cute.arch.mbarrier_wait(bars + s, phase)
                words = []
                for j in cutlass.range_constexpr(self.page // 16 // THREADS):
                    words.append(ld_shared_v4(here + (j * THREADS + tid) * 16))
                for j in cutlass.range_constexpr(self.page // 16 // THREADS):
                    st_shared_v4(here + (j * THREADS + tid) * 16, words[j])
                cute.arch.inline_ptx("fence.proxy.async.shared::cta;")
                cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
            if tid == 0:
                if cutlass.const_expr(self.mode == "bulk"):
                    cute.arch.mbarrier_wait(bars + s, phase)
                target = base + Int64(dst[first + n]) * self.page
                for c in cutlass.range_constexpr(self.page // CHUNK):
                    bulk_store(target + c * CHUNK, here + c * CHUNK, CHUNK)
                cute.arch.inline_ptx("cp.async.bulk.commit_group;")
                # refill the stage of item n - 1 once its store has read it
                if (n >= 1) & (n - 1 + self.stages < count):
                    cute.arch.inline_ptx("cp.async.bulk.wait_group.read 1;")
                    prev = (n - 1) % self.stages
                    self.load(base, src, first + n - 1 + self.stages, stage0, bars, prev)
            n = n + 1
        if tid == 0:
            cute.arch.inline_ptx("cp.async.bulk.wait_group 0;")


def compile_probe(page_bytes, stages, mode, ctas, arch=None, tensors=None):
    """The compiled probe (``tensors``: runtime (pool, src, dst); None: fake ones)."""
    from tpcomm.cuteutil import fake_like_runtime, to_cute

    kernel = BulkPages(page_bytes, stages, mode, ctas)
    if tensors is None:
        import cuda.bindings.driver as cuda

        args = (
            fake_like_runtime(cutlass.Uint8, 1),
            fake_like_runtime(Int32, 1),
            fake_like_runtime(Int32, 1),
            cuda.CUstream(0),
        )
    else:
        args = tuple(to_cute(t) for t in tensors[:3]) + (tensors[3],)
    options = None if arch is None else f"--gpu-arch {arch}"
    return cute.compile(kernel, *args, options=options)


def launch_all(fn, args):
    """The compiled probe over every slot table, on the current stream."""
    import cuda.bindings.driver as cuda
    import torch

    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    for pool, src, dst in args:
        fn(pool, src, dst, stream)


ROWS = [(96, 128), (12, 128), (6, 128), (12, 32), (6, 32)]  # (heads, requests): H * B items
CONFIGS = [("fp32", 2), ("fp32", 3), ("bf16", 2), ("bf16", 4), ("bf16", 6)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import cuda.bindings.driver as cuda
    import torch
    from bench_kda import ROTATE_BYTES, copy_bandwidth, time_graph

    from tpcomm.cuteutil import to_cute

    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    tbps = copy_bandwidth()
    print(f"copy {tbps:.2f} TB/s, {ctas} SMs")
    out = []
    for dtype, stages in CONFIGS:
        page = 65536 if dtype == "fp32" else 32768
        for mode in ("bulk", "regs"):
            for H, B in ROWS:
                items = H * B
                rot = max(1, min(64, -(-ROTATE_BYTES // (2 * items * page))))
                pool = torch.randint(0, 1 << 30, (2 * rot * items + 1, page // 4), device="cuda")
                pool = pool.to(torch.int32).view(torch.uint8).view(-1)
                tables = []
                for r in range(rot):
                    src = (1 + 2 * r * items + torch.randperm(items, device="cuda")).to(torch.int32)
                    tables.append((src, src + items))
                stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
                fn = compile_probe(page, stages, mode, ctas, tensors=(pool, *tables[0], stream))
                args = [(to_cute(pool), to_cute(s), to_cute(d)) for s, d in tables]

                step = functools.partial(launch_all, fn, args)
                step()
                torch.cuda.synchronize()
                words = pool.view(torch.int32).view(-1, page // 4)
                s0, d0 = tables[-1]
                ok = torch.equal(words[s0.long()], words[d0.long()])
                us = time_graph(step, inner=rot)
                pct = 100 * 2 * items * page / (us * 1e-6) / 1e12 / tbps
                row = dict(dtype=dtype, stages=stages, mode=mode, H=H, B=B, us=us, pct=pct, ok=ok)
                out.append(row)
                print(
                    f"{dtype} stages {stages} {mode:4s} H {H:3d} B {B:4d}: {us:8.1f} us "
                    f"{pct:5.1f}% {'ok' if ok else 'MISMATCH'}"
                )
                del pool, tables, args, step
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(copy_tbps=tbps, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
