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
    python3 scripts/probe_bulk.py --configs fp32:3:bulk:2:2:4096 --shapes 12x128 96x128
"""

from __future__ import annotations

import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from _common import launch_all, probe_args  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402

from kda.kernels.replay import st_shared_f32x4  # noqa: E402
from tpcomm.cuteutil import bulk_copy_g2s, launch, ld_shared_f32x4, smem_tensor  # noqa: E402

THREADS = 128
SMEM_LIMIT = 227 * 1024
CHUNK = 16 * 1024  # bytes per bulk load instruction


def bulk_store(target: Int64, shared: Int32, size: int):
    cute.arch.inline_ptx(
        f"cp.async.bulk.global.shared::cta.bulk_group [{{$r0}}], [{{$r1}}], {int(size)};",
        read_only_args=[target, shared],
    )


class BulkPages:
    """``page_bytes``: the unit copied (a page or a part of one); ``per_sm`` CTAs per SM
    (``ctas`` in all), each with ``stages`` units of shared memory; ``chunk``: bytes per
    bulk instruction."""

    def __init__(self, page_bytes, stages, mode, ctas, chunk=CHUNK, per_sm=1):
        if stages * page_bytes + 1024 > SMEM_LIMIT // per_sm or stages < 2:
            raise ValueError(f"stages must be >= 2 and fit; got {stages} of {page_bytes} B")
        if mode not in ("bulk", "regs"):
            raise ValueError(f"mode must be bulk or regs; got {mode!r}")
        if chunk % 16 or page_bytes % chunk:
            raise ValueError(f"chunk must divide the unit in 16-byte multiples; got {chunk}")
        self.page, self.stages, self.mode, self.ctas = page_bytes, stages, mode, ctas
        self.chunk, self.per_sm = chunk, per_sm

    @cute.jit
    def __call__(self, pool: cute.Tensor, src: cute.Tensor, dst: cute.Tensor, stream):
        grid, block = (self.ctas, 1, 1), (THREADS, 1, 1)
        launch(
            self.kernel(pool, src, dst),
            grid,
            block,
            stream,
            min_blocks_per_mp=self.per_sm,
            carveout=100,
        )

    @cute.jit
    def load(self, base, src, item, stage0, bars, s):
        bar = bars + s
        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.page)
        source = base + Int64(src[item]) * self.page
        for c in cutlass.range_constexpr(self.page // self.chunk):
            bulk_copy_g2s(
                stage0 + s * self.page + c * self.chunk,
                source + c * self.chunk,
                self.chunk,
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
                    words.append(ld_shared_f32x4(here + (j * THREADS + tid) * 16))
                for j in cutlass.range_constexpr(self.page // 16 // THREADS):
                    st_shared_f32x4(here + (j * THREADS + tid) * 16, words[j])
                cute.arch.inline_ptx("fence.proxy.async.shared::cta;")
                cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
            if tid == 0:
                if cutlass.const_expr(self.mode == "bulk"):
                    cute.arch.mbarrier_wait(bars + s, phase)
                target = base + Int64(dst[first + n]) * self.page
                for c in cutlass.range_constexpr(self.page // self.chunk):
                    bulk_store(target + c * self.chunk, here + c * self.chunk, self.chunk)
                cute.arch.inline_ptx("cp.async.bulk.commit_group;")
                # refill the stage of item n - 1 once its store has read it
                if (n >= 1) & (n - 1 + self.stages < count):
                    cute.arch.inline_ptx("cp.async.bulk.wait_group.read 1;")
                    prev = (n - 1) % self.stages
                    self.load(base, src, first + n - 1 + self.stages, stage0, bars, prev)
            n = n + 1
        if tid == 0:
            cute.arch.inline_ptx("cp.async.bulk.wait_group 0;")


def compile_probe(page_bytes, stages, mode, ctas, arch=None, tensors=None, chunk=CHUNK, per_sm=1):
    """The compiled probe (``tensors``: runtime (pool, src, dst); None: fake ones)."""
    from tpcomm.cuteutil import fake_like_runtime, to_cute

    kernel = BulkPages(page_bytes, stages, mode, ctas, chunk, per_sm)
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


ROWS = [(96, 128), (12, 128), (6, 128), (12, 32), (6, 32)]  # (heads, requests): H * B items
# dtype, stages, modes, parts of a page per unit, CTAs per SM, bytes per bulk instruction
CONFIGS = [
    ("fp32", 2, ("bulk", "regs"), 1, 1, CHUNK),
    ("fp32", 3, ("bulk", "regs"), 1, 1, CHUNK),
    ("bf16", 2, ("bulk", "regs"), 1, 1, CHUNK),
    ("bf16", 4, ("bulk", "regs"), 1, 1, CHUNK),
    ("bf16", 6, ("bulk", "regs"), 1, 1, CHUNK),
]


def parse_config(text):
    """``dtype:stages:mode:parts:per_sm:chunk`` (e.g. ``fp32:3:bulk:2:2:4096``: half pages,
    two CTAs per SM, 4 KB instructions) -> a CONFIGS entry."""
    dtype, stages, mode, parts, per_sm, chunk = text.split(":")
    if dtype not in ("fp32", "bf16") or mode not in ("bulk", "regs"):
        raise ValueError(f"config {text!r}: dtype fp32|bf16, mode bulk|regs")
    return dtype, int(stages), (mode,), int(parts), int(per_sm), int(chunk)


def main(argv=None):
    a, shapes = probe_args(__doc__, "dtype:stages:mode:parts:per_sm:chunk", argv)
    configs = [parse_config(c) for c in a.configs] if a.configs else CONFIGS
    rows = shapes or ROWS
    import cuda.bindings.driver as cuda
    import torch
    from bench_kda import ROTATE_BYTES, copy_bandwidth, time_graph, write_json

    from tpcomm.cuteutil import to_cute

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tbps = copy_bandwidth()
    print(f"copy {tbps:.2f} TB/s, {sms} SMs")
    out = []
    for dtype, stages, modes, parts, per_sm, chunk in configs:
        page = (65536 if dtype == "fp32" else 32768) // parts  # the unit copied
        ctas = sms * per_sm
        for mode in modes:
            for H, B in rows:
                items = H * B * parts  # units: part p of every page, then p + 1 (other CTAs)
                rot = max(1, min(64, -(-ROTATE_BYTES // (2 * items * page))))
                pool = torch.randint(0, 1 << 30, (2 * rot * items + 1, page // 4), device="cuda")
                pool = pool.to(torch.int32).view(torch.uint8).view(-1)
                tables = []
                for r in range(rot):
                    pages = torch.randperm(items // parts, device="cuda") * parts
                    units = torch.cat([pages + q for q in range(parts)])
                    src = (1 + 2 * r * items + units).to(torch.int32)
                    tables.append((src, src + items))
                stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
                tensors = (pool, *tables[0], stream)
                fn = compile_probe(page, stages, mode, ctas, None, tensors, chunk, per_sm)
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
                row.update(parts=parts, per_sm=per_sm, chunk=chunk)
                out.append(row)
                print(
                    f"{dtype} stages {stages} {mode:4s} parts {parts} per SM {per_sm} chunk "
                    f"{chunk:5d} H {H:3d} B {B:4d}: {us:8.1f} us {pct:5.1f}% "
                    f"{'ok' if ok else 'MISMATCH'}"
                )
                del pool, tables, args, step
                torch.cuda.empty_cache()
    if a.json:
        write_json(a.json, dict(copy_tbps=tbps, rows=out))


if __name__ == "__main__":
    main()
