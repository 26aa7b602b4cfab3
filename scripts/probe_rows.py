"""A value row per thread: how fast the state half of a KDA decode item runs when each of
128 threads holds one row of the page in registers (issue 35; docs/kda.md, "a value row per
thread in the state group").

``RowState``: persistent CTAs (``per_sm`` per SM, 128 threads each) over a contiguous range
of (request, head) items, as KdaPipe splits them. Each item's page (fp32 or bf16) and its
vectors (per token: q^, k^, v, the decays and beta, as KdaPipe's prep group leaves them in a
slot) are cp.asynced ``stages - 1`` items ahead into a shared stage, 16-byte chunks
XOR-swizzled by row (a warp's copies read whole rows; a thread's reads of its own row are
conflict-free). Thread r then holds row r's 128 keys as fp32 and runs the delta rule with no
cross-lane reduction (KdaWide's per-chunk products, ``dev.decay_and_dot`` /
``dev.update_and_out``: eight partial sums per dot product):

    S = S * decay;  v_new = (v - S . k^) * beta;  S = fma(k^, v_new, S);  o = S . q^

token by token, writes o (fp32) per token and the final row to the item's target page
(bf16: rounded once). ``store="direct"``: each thread stores its row from registers
(16-byte stores a row apart); ``store="staged"``: the rows go back into the stage and the
warps store them row by row (coalesced), then the stage is refilled.

Checked against the reference's math (``kda.reference``'s recurrence in float64 sums) on
the last slot table; timed as ``bench_kda.py`` times kernels (CUDA graphs over rotated
slot tables, past L2) beside the copy bandwidth measured in the run; bytes: 2 pages per
item (the vectors stay in L2: 64 sets, as a prep group would hand them over in shared
memory).

    python3 scripts/probe_rows.py [--json out.json]
    python3 scripts/probe_rows.py --configs bf16:1:4:1:direct --shapes 12x128 96x128
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
from cutlass import Float32, Int32, Int64  # noqa: E402

from kda.kernels import device as dev  # noqa: E402
from kda.kernels.replay import st_shared_f32x4  # noqa: E402
from kda.kernels.stream import fresh_tid, reload_shared_f32x4  # noqa: E402
from tpcomm.cuteutil import (  # noqa: E402
    bf16x2_to_f32,
    cp_async_16,
    cvt_bf16x2,
    launch,
    ld_shared_b32x4,
    ld_shared_f32x4,
    smem_tensor,
    st_global_b32x4,
    st_global_f32x4,
)

KEYS = 128
SMEM_LIMIT = 227 * 1024
VECTORS = 5  # per token: q^, k^, v, decays, beta (its first element)
VECTOR_SETS = 64  # distinct vector sets (item % 64): they stay in L2
STORES = ("direct", "staged")


class RowState:
    """``dtype`` pages, ``tokens`` per item, ``stages`` shared stages (a unit + vectors),
    ``ctas`` persistent CTAs, ``per_sm`` of them per SM, ``store`` direct or staged;
    ``parts``: units per page (1, 2 or 4), each ``128 / parts`` rows on as many threads (a
    finer split of the work over the SMs; units p and p + 1 of an item are neighbours in
    a CTA's range)."""

    def __init__(
        self, dtype, tokens, stages, ctas, per_sm=1, store="direct", arch="sm_90a", parts=1
    ):
        if dtype not in ("fp32", "bf16") or store not in STORES or parts not in (1, 2, 4):
            raise ValueError(
                f"dtype fp32|bf16, store {STORES}, parts 1|2|4; got {dtype!r}, {store!r}, {parts!r}"
            )
        if not 1 <= tokens <= 8:
            raise ValueError(f"tokens must be in 1..8; got {tokens}")
        self.bf16, self.tokens, self.stages, self.ctas = dtype == "bf16", tokens, stages, ctas
        self.per_sm, self.store, self.parts = per_sm, store, parts
        self.threads = KEYS // parts  # a row each
        self.packed = dev.has_packed_fma(arch)
        self.row = KEYS * (2 if self.bf16 else 4)  # bytes of a row
        self.chunks = self.row // 16  # 16-byte chunks of a row (32 fp32, 16 bf16)
        self.page = KEYS * self.row
        self.unit = self.threads * self.row  # the rows of a unit
        self.vectors = tokens * VECTORS * KEYS * 4
        self.stage_bytes = self.unit + self.vectors
        if stages < 2 or stages * self.stage_bytes + 1024 > SMEM_LIMIT // per_sm:
            raise ValueError(f"stages must be >= 2 and fit; got {stages} of {self.stage_bytes} B")

    @cute.jit
    def __call__(self, pool, src, dst, vec, out, stream):
        launch(
            self.kernel(pool, src, dst, vec, out),
            (self.ctas, 1, 1),
            (self.threads, 1, 1),
            stream,
            min_blocks_per_mp=self.per_sm,
            carveout=100,
        )

    def split(self, unit):
        """Trace-time helper: (item, part) of a unit."""
        shift = self.parts.bit_length() - 1
        return unit >> shift, unit & (self.parts - 1)

    @cute.jit
    def stage_unit(self, base, vbase, src, unit, stage0, s):
        """cp.async a unit's rows (swizzled) and its item's vectors into stage ``s``."""
        tid = fresh_tid()
        item, part = self.split(unit)
        here = stage0 + s * self.stage_bytes
        source = base + Int64(src[item]) * self.page + part * self.unit + tid * 16
        for j, shared in self.page_chunks(here, tid):
            cp_async_16(shared, source + j * self.threads * 16)
        vsource = vbase + Int64(item % VECTOR_SETS) * self.vectors
        n = self.vectors // 16
        for j in cutlass.range_constexpr((n + self.threads - 1) // self.threads):
            c = j * self.threads + tid
            if c < n:
                cp_async_16(here + self.unit + c * 16, vsource + c * 16)

    def page_chunks(self, here, tid):
        """Trace-time helper: (j, shared address) of the thread's 16-byte chunk j of a unit
        copy (chunk ``j * threads + tid`` of the unit: a round of copies covers ``rows``
        whole rows) in the stage at ``here``, swizzled: chunk ``col`` of row r at
        ``col ^ (r % chunks)``. As r % chunks = rows * (j % period) + tid // chunks (rows
        divides chunks), the swizzle takes ``period`` base addresses and the rest are
        immediate offsets."""
        rows = self.threads // self.chunks  # 128 threads: fp32 4, bf16 8
        period = self.chunks // rows  # fp32 8, bf16 2
        shift = self.chunks.bit_length() - 1
        first, col = tid >> shift, tid & (self.chunks - 1)
        start = here + first * self.row
        bases = [start + ((col ^ first) ^ (rows * m)) * 16 for m in range(period)]
        rounds = self.unit // 16 // self.threads
        return [(j, bases[j % period] + j * rows * self.row) for j in range(rounds)]

    @cute.jit
    def load_row(self, here):
        """The thread's row of the page in stage ``here``, 128 fp32 (its addresses from
        a fresh ``%tid.x``: not held across the item loop)."""
        tid = fresh_tid()
        h = []
        for j in cutlass.range_constexpr(self.chunks):
            address = here + tid * self.row + ((tid & (self.chunks - 1)) ^ j) * 16
            if cutlass.const_expr(self.bf16):
                for word in ld_shared_b32x4(address):
                    h.extend(bf16x2_to_f32(word))
            else:
                h.extend(ld_shared_f32x4(address))
        return h

    @cute.jit
    def token(self, h, vt, row):
        """One token of the delta rule on the thread's value row ``row`` (its keys ``h``, in
        place); returns o."""
        q0, k0, v0, d0 = vt, vt + KEYS * 4, vt + 2 * KEYS * 4, vt + 3 * KEYS * 4
        packed = self.packed
        beta = ld_shared_f32(vt + 4 * KEYS * 4)
        dots = [Float32(0.0)] * (2 * dev.ACCUMULATORS)
        for c in cutlass.range_constexpr(KEYS // 4):
            d4, k4 = ld_shared_f32x4(d0 + c * 16), ld_shared_f32x4(k0 + c * 16)
            chunk = h[4 * c : 4 * c + 4]
            dev.decay_and_dot(chunk, dots, c, d4, k4, packed)
            h[4 * c : 4 * c + 4] = chunk
        pred = dev.tree_sum(dots)
        v = ld_shared_f32(v0 + row * 4)
        v_new = (v - pred) * beta
        outs = [Float32(0.0)] * (2 * dev.ACCUMULATORS)
        for c in cutlass.range_constexpr(KEYS // 4):
            # k read again (volatile: not merged with the first pass's, not held)
            k4, q4 = reload_shared_f32x4(k0 + c * 16), ld_shared_f32x4(q0 + c * 16)
            chunk = h[4 * c : 4 * c + 4]
            dev.update_and_out(chunk, outs, c, k4, q4, v_new, packed)
            h[4 * c : 4 * c + 4] = chunk
        return dev.tree_sum(outs)

    @cute.jit
    def store_row(self, h, target, here):
        """The thread's row to the target page: from registers (direct) or through the
        stage (staged: every thread's row, then the warps' coalesced row stores)."""
        tid = fresh_tid()
        if cutlass.const_expr(self.store == "direct"):
            for j in cutlass.range_constexpr(self.chunks):
                address = target + tid * self.row + j * 16
                if cutlass.const_expr(self.bf16):
                    words = [cvt_bf16x2(h[8 * j + 2 * i], h[8 * j + 2 * i + 1]) for i in range(4)]
                    st_global_b32x4(address, words)
                else:
                    st_global_f32x4(address, h[4 * j : 4 * j + 4])
        else:
            for j in cutlass.range_constexpr(self.chunks):
                address = here + tid * self.row + ((tid & (self.chunks - 1)) ^ j) * 16
                if cutlass.const_expr(self.bf16):
                    words = [cvt_bf16x2(h[8 * j + 2 * i], h[8 * j + 2 * i + 1]) for i in range(4)]
                    st_shared_b32x4(address, words)
                else:
                    st_shared_f32x4(address, h[4 * j : 4 * j + 4])
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            target = target + tid * 16
            for j, shared in self.page_chunks(here, fresh_tid()):
                st_global_b32x4(target + j * self.threads * 16, ld_shared_b32x4(shared))

    @cute.kernel
    def kernel(self, pool, src, dst, vec, out):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        units = src.shape[0] * self.parts
        first = cta * units // self.ctas
        count = (cta + 1) * units // self.ctas - first
        smem = cutlass.memory.SmemAllocator()
        stages = smem_tensor(smem, cutlass.Uint8, (self.stages * self.stage_bytes,), align=128)
        stage0 = Int32(stages.iterator.toint())
        base, vbase = Int64(pool.iterator.toint()), Int64(vec.iterator.toint())
        obase = Int64(out.iterator.toint())
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < count:
                self.stage_unit(base, vbase, src, first + s, stage0, s)
            cute.arch.cp_async_commit_group()
        n = Int32(0)
        while n < count:
            s = n % self.stages
            ahead = n + self.stages - 1  # into the stage unit n - 1 left
            if ahead < count:
                self.stage_unit(base, vbase, src, first + ahead, stage0, ahead % self.stages)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(self.stages - 1)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            here = stage0 + s * self.stage_bytes
            item, part = self.split(first + n)
            row = part * self.threads + tid  # the thread's value row
            h = self.load_row(here)
            for t in cutlass.range_constexpr(self.tokens):
                vt = here + self.unit + t * VECTORS * KEYS * 4
                o = self.token(h, vt, row)
                out_address = obase + (Int64(item) * self.tokens + t) * (KEYS * 4) + row * 4
                cute.arch.inline_ptx(
                    "st.global.f32 [{$r0}], {$r1};", read_only_args=[out_address, Float32(o)]
                )
            target = base + Int64(dst[item]) * self.page + part * self.unit
            self.store_row(h, target, here)
            # every thread is done with the stage before the next iteration refills it
            cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
            n = n + 1
        cute.arch.cp_async_wait_group(0)


def ld_shared_f32(shared: Int32):
    """Weak 4-byte shared load of one fp32."""
    return cute.arch.inline_ptx(
        "ld.shared.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[shared]
    )


def st_shared_b32x4(shared: Int32, words):
    """Weak 16-byte shared store of four 32-bit words."""
    cute.arch.inline_ptx(
        "st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[shared, *[cutlass.Uint32(w) for w in words]],
    )


def compile_probe(kernel: RowState, tensors=None, arch=None, extra=""):
    """The compiled probe (``tensors``: runtime (pool, src, dst, vec, out, stream); None:
    fake ones, for a compile without a GPU; ``extra``: more compile options)."""
    from tpcomm.cuteutil import fake_like_runtime, to_cute

    if tensors is None:
        import cuda.bindings.driver as cuda

        page_type = cutlass.BFloat16 if kernel.bf16 else Float32
        args = (
            fake_like_runtime(page_type, 1),
            fake_like_runtime(Int32, 1),
            fake_like_runtime(Int32, 1),
            fake_like_runtime(Float32, 1),
            fake_like_runtime(Float32, 1),
            cuda.CUstream(0),
        )
    else:
        args = tuple(to_cute(t) for t in tensors[:5]) + (tensors[5],)
    options = (("" if arch is None else f"--gpu-arch {arch} ") + extra).strip() or None
    return cute.compile(kernel, *args, options=options)


def make_vectors(tokens, device, seed=0):
    """``VECTOR_SETS`` sets of per-token vectors at model-like scales: q^ and k^ unit rows
    (q^ times 128^-0.5), v standard normal, decays in (0.9, 1), beta in (0, 1)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (VECTOR_SETS, tokens, KEYS)
    q = torch.nn.functional.normalize(torch.randn(shape, generator=g), dim=-1) * KEYS**-0.5
    k = torch.nn.functional.normalize(torch.randn(shape, generator=g), dim=-1)
    v = torch.randn(shape, generator=g)
    decay = 0.9 + 0.1 * torch.rand(shape, generator=g)
    beta = torch.rand(shape[:2], generator=g)[..., None].expand(shape)
    return torch.stack([q, k, v, decay, beta], dim=2).contiguous().to(device)  # [64, T, 5, 128]


def reference(pages, vectors):
    """The reference's recurrence (``kda.reference.decode`` step 3, fp32 with float64 sums)
    on fp32 ``pages`` [n, 128, 128] and ``vectors`` [n, T, 5, 128]: (final pages, o [n, T,
    128])."""
    import torch

    from kda.reference import _fma, _matvec

    S = pages.float().clone()
    outs = []
    for t in range(vectors.shape[1]):
        q, k, v, decay, beta = vectors[:, t].unbind(1)
        S = S * decay[:, None, :]
        v_new = (v - _matvec(S, k)) * beta[:, :1]
        S = _fma(k[:, None, :], v_new[..., None], S)
        outs.append(_matvec(S, q))
    return S, torch.stack(outs, dim=1)


def check(pool, src, dst, vec, out, tokens, bf16):
    """(state error / page max, o error / o max) of the last launch against the reference;
    bf16 pages: the reference's page rounded once, errors in units of its bf16 ulp."""
    import torch

    items = src.numel()
    vectors = vec.view(VECTOR_SETS, tokens, VECTORS, KEYS)[torch.arange(items) % VECTOR_SETS]
    S, o = reference(pool[src.long()], vectors.to(pool.device))
    got = pool[dst.long()].float()
    if bf16:
        want = S.to(torch.bfloat16).float()
        ulp = want.abs().clamp_min(1e-30) * 2.0**-7
        state_err = ((got - want).abs() / ulp).max().item()  # 1: one bf16 rounding flipped
    else:
        state_err = ((got - S).abs().max() / S.abs().max()).item()
    o_err = ((out.view(items, tokens, KEYS) - o).abs().max() / o.abs().max()).item()
    return state_err, o_err


# (heads, requests): H * B items
SHAPES = [(96, 128), (12, 128), (6, 128), (12, 32)]
# dtype, tokens, stages, CTAs per SM, store, parts
CONFIGS = [
    ("fp32", 1, 2, 1, "direct", 1),
    ("fp32", 1, 3, 1, "direct", 1),
    ("fp32", 1, 2, 1, "staged", 1),
    ("fp32", 1, 3, 2, "direct", 2),
    ("bf16", 1, 4, 1, "direct", 1),
    ("bf16", 1, 4, 1, "staged", 1),
    ("bf16", 1, 3, 2, "direct", 1),
    ("bf16", 1, 4, 2, "direct", 2),
    ("fp32", 4, 2, 1, "direct", 1),
    ("bf16", 4, 4, 1, "direct", 1),
]


def parse_config(text):
    """``dtype:tokens:stages:per_sm:store[:parts]`` (e.g. ``bf16:1:4:2:direct:2``) -> a
    CONFIGS entry."""
    fields = text.split(":")
    if len(fields) == 5:
        fields.append("1")
    dtype, tokens, stages, per_sm, store, parts = fields
    if dtype not in ("fp32", "bf16") or store not in STORES:
        raise ValueError(f"config {text!r}: dtype fp32|bf16, store {STORES}")
    return dtype, int(tokens), int(stages), int(per_sm), store, int(parts)


def main(argv=None):
    a, shapes = probe_args(__doc__, "dtype:tokens:stages:per_sm:store[:parts]", argv)
    configs = [parse_config(c) for c in a.configs] if a.configs else CONFIGS
    shapes = shapes or SHAPES
    import cuda.bindings.driver as cuda
    import torch
    from bench_kda import ROTATE_BYTES, copy_bandwidth, time_graph, write_json

    from kda.dispatch import arch_of
    from tpcomm.cuteutil import to_cute

    props = torch.cuda.get_device_properties(0)
    sms, arch = props.multi_processor_count, arch_of((props.major, props.minor))
    tbps = copy_bandwidth()
    print(f"copy {tbps:.2f} TB/s, {sms} SMs")
    rows = []
    for dtype, tokens, stages, per_sm, store, parts in configs:
        kernel = RowState(dtype, tokens, stages, sms * per_sm, per_sm, store, arch, parts)
        page_type = torch.bfloat16 if kernel.bf16 else torch.float32
        vec = make_vectors(tokens, "cuda").view(-1)
        for H, B in shapes:
            items = H * B
            rot = max(1, min(64, -(-ROTATE_BYTES // (2 * items * kernel.page))))
            pool = (0.05 * torch.randn(2 * rot * items + 1, KEYS, KEYS, device="cuda")).to(
                page_type
            )
            tables = []
            for r in range(rot):
                src = (1 + 2 * r * items + torch.randperm(items, device="cuda")).to(torch.int32)
                tables.append((src, (src + items).to(torch.int32)))
            out = torch.full((items * tokens * KEYS,), float("nan"), device="cuda")
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            fn = compile_probe(kernel, (pool.view(-1), *tables[0], vec, out, stream), arch)
            flat = [to_cute(t) for t in (pool.view(-1), vec, out)]
            args = [(flat[0], to_cute(s), to_cute(d), flat[1], flat[2]) for s, d in tables]
            step = functools.partial(launch_all, fn, args)
            step()
            torch.cuda.synchronize()
            state_err, o_err = check(pool, *tables[-1], vec, out, tokens, kernel.bf16)
            us = time_graph(step, inner=rot)
            pct = 100 * 2 * items * kernel.page / (us * 1e-6) / 1e12 / tbps
            row = dict(dtype=dtype, tokens=tokens, stages=stages, per_sm=per_sm, store=store)
            row.update(parts=parts)
            row.update(H=H, B=B, us=us, pct=pct, state_err=state_err, o_err=o_err)
            rows.append(row)
            print(
                f"{dtype} T {tokens} stages {stages} per SM {per_sm} {store:6s} parts {parts} "
                f"H {H:3d} "
                f"B {B:4d}: {us:8.1f} us {pct:5.1f}%  state err {state_err:.2e} "
                f"o err {o_err:.2e}"
            )
            del pool, tables, args, step, out
            torch.cuda.empty_cache()
    if a.json:
        write_json(a.json, dict(copy_tbps=tbps, rows=rows))


if __name__ == "__main__":
    main()
