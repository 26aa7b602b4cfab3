"""O-projection producer side: publishing a rank's partial into every rank's mailbox.

``PartialPublisher``: rank r's partial ``[tokens, HID]`` bf16 (already computed) goes
into slot ``[step & 1, r]`` of every rank's mailbox ``[2, TP, tokens, HID]``: each thread
loads one 16-byte group, canonicalises sentinel words (``tpcomm.ptx.publish``) and stores
it with one relaxed sys-scope store per peer through the peer pointer table (the NVLink
path; multicast, when the platform has it, is one store). Grid ``(HID / 1024, tokens)``,
128 threads. With ``fence`` a sys-scope fence first orders this step's publish after the
previous step's re-arms of the same parity on other GPUs (one GPU: the kernel boundary
does it). With ``twoshot`` each group goes only to the rank owning its columns: slot
``[step & 1, r]`` of that rank's receive view ``[2, TP, tokens, HID / TP]`` (the peer table
then holds the receive views' addresses; no multicast on this hop).

``OprojProducer``: the rank's o-projection ``partial = bf16(attn_out @ w_o^T)`` for
tokens 1..8 (``attn_out`` [tokens, D] bf16, ``w_o`` [HID, D] bf16, D = heads x 128), fp32
accumulation, one rounding to bf16 (nearest even), published straight into slot
``[step & 1, rank]`` of every rank's mailbox like ``PartialPublisher``. Swap A/B:
``mma.sync.m16n8k16`` with 16 output features as M and the tokens as N = 8. Grid
``HID / 16`` CTAs of 4 warps; warp w takes the 32-wide k chunks w, w+4, ... (each lane
loads 16 contiguous bytes of two ``w_o`` rows and of one token; the k order inside a chunk
is permuted identically for A and B, which a dot product allows), the four warps' fp32
fragments are added in warp order through shared memory, and 128 threads publish the
16 features x tokens as 16-byte groups (8 peers per group in parallel). Only the order of
the fp32 accumulation differs from ``tpcomm.oproj.reference.project`` (within 1 bf16 ulp).
With ``pdl`` it waits for the previous kernel (the KDA step) before reading ``attn_out``
and lets the consumer launch at once. ``OprojProducer.tile`` is one CTA's 16-feature tile
for any 128 threads: the fused kernel (``tpcomm.oproj.fused``) runs several per CTA.

``OprojProducerDeep`` (``producer_class("deep")``, ``OprojAllReduce(..., producer="deep")``):
the same tile, built for weight bandwidth. The tiled kernel keeps about one 32-wide k
chunk of ``w_o`` per warp in flight (1 KiB; 16 KiB per CTA at most if ptxas hoists the
unrolled loads), so HBM latency, not bandwidth, bounds it. Here thread 0 of each CTA
requests the tile's 16 ``w_o`` rows at once with ``cp.async.bulk`` (one per row, async
proxy, completing bytes on an mbarrier) into shared memory, *before* the PDL wait
(``w_o`` must not be written by the kernel launched just before), so at launch every CTA
has its whole tile in flight: 24 KiB at TP16 (D 768), 48 KiB at TP8 (D 1536), i.e. the
whole 11 MB of weights requested by ~3.4 CTAs per SM (launch bound 4 CTAs per SM: the
448 CTAs of HID 7168 are one wave on 132 SMs; no tail of late CTAs). Wider tiles (D >
1536) go through a ring of k-slabs (``deep_plan``): each stage is refilled after a CTA
barrier and an async-proxy fence once all warps have read it. Rows are staged with a
64-byte pad (stride 64 mod 128 bytes): the per-lane 16-byte ``ld.shared`` of the tiled
fragment layout is then free of bank conflicts. Each warp's ``attn_out`` fragments of a
slab are loaded (after the PDL wait) before it waits for the slab. Numerics: bitwise
the tiled producer's: warp w runs the same ``mma.sync`` chain over the same k chunks w,
w + 4, ... in ascending k with the same per-lane fragments (now read from shared memory),
and the four warp fragments are summed in warp order through shared memory, then the
same single bf16 rounding and publish (``publish_tile``).

``ranks`` = TP (one-shot; a one-GPU backend): one launch projects or publishes every
rank's partial, grid y (producers) or z (publisher) = rank r with its operands at r times
one rank's size past rank 0's.

The CuTe DSL is imported lazily: this module imports on a CPU-only machine.
"""

import functools
from dataclasses import dataclass

from tpcomm.oproj.consumer import check_ranks
from tpcomm.oproj.reference import MAX_TP, SLICE

THREADS = 128


def twoshot_offset(tp, hid, step, rank, tokens, token, column):
    """Byte offset of ``column`` of ``token`` in slot ``[step & 1, rank]`` of the owning
    rank's twoshot receive view ``[2, TP, tokens, HID / TP]`` (traced: Int32/Int64 in)."""
    from cutlass import Int64

    width = hid // tp
    owner = column // width
    slot = (Int64(step & 1) * tp + rank) * Int64(tokens) + Int64(token)
    return (slot * width + Int64(column - owner * width)) * 2


@functools.cache
def _publisher_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from tpcomm import ptx
    from tpcomm.cuteutil import launch

    class PartialPublisher:
        """Compile-time configuration: TP, HID, multicast, sys fence, PDL, twoshot."""

        def __init__(self, tp, hid, *, multicast=False, fence=False, pdl=False, twoshot=False,
                     ranks=1):  # fmt: skip
            check_ranks(tp, ranks, twoshot)
            self.ranks = ranks
            if not isinstance(tp, int) or not 1 <= tp <= MAX_TP:
                raise ValueError(f"tp must be an int in 1..{MAX_TP}; got {tp!r}")
            if not isinstance(hid, int) or hid % SLICE or not SLICE <= hid <= 8 * SLICE:
                raise ValueError(f"hid must be a multiple of 1024 in 1024..8192; got {hid!r}")
            if twoshot and hid % (8 * tp):
                raise ValueError(f"twoshot needs hid ({hid}) divisible by 8 * tp ({8 * tp})")
            self.tp, self.hid = tp, hid
            self.multicast, self.fence, self.pdl = bool(multicast), bool(fence), bool(pdl)
            self.twoshot = bool(twoshot)

        @cute.jit
        def __call__(
            self,
            partial: cute.Tensor,
            peers: cute.Tensor,
            multicast_base: Int64,
            rank: Int32,
            step: Int32,
            stream: cuda.CUstream,
        ):
            call = self.kernel(
                Int64(partial.iterator.toint()),
                peers,
                multicast_base,
                partial.shape[0],
                rank,
                step,
            )
            grid = (self.hid // SLICE, partial.shape[0], self.ranks)
            launch(call, grid, (THREADS, 1, 1), stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, a_partial: Int64, peers: cute.Tensor, multicast_base: Int64,
                   tokens: Int32, rank: Int32, step: Int32):  # fmt: skip
            tid, _, _ = cute.arch.thread_idx()
            cta, token, r = cute.arch.block_idx()
            if cutlass.const_expr(self.ranks > 1):  # rank ``rank + r``'s partial
                a_partial = a_partial + Int64(r) * Int64(tokens) * (self.hid * 2)
                rank = rank + r
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
            column = cta * SLICE + tid * 8
            row = (Int64(token) * self.hid + column) * 2
            words = ptx.load16(a_partial + row)
            slot_bytes = Int64(tokens) * (self.hid * 2)
            offset = (Int64(step & 1) * self.tp + rank) * slot_bytes + row
            if cutlass.const_expr(self.fence):
                ptx.fence_sys()
            if cutlass.const_expr(self.twoshot):
                owner = column // (self.hid // self.tp)
                offset = twoshot_offset(self.tp, self.hid, step, rank, tokens, token, column)
                ptx.publish(peers[owner] + offset, words)
            elif cutlass.const_expr(self.multicast):
                ptx.publish(multicast_base + offset, words, multicast=True)
            else:
                for p in cutlass.range_constexpr(self.tp):
                    ptx.publish(peers[p] + offset, words)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()

    return PartialPublisher


def publisher_class():
    """The ``PartialPublisher`` class (imports the CuTe DSL)."""
    return _publisher_class()


def fake_publisher_arguments(tp: int, hid: int):
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Int64

    tokens = cute.sym_int()
    return (
        cute.runtime.make_fake_compact_tensor(BFloat16, (tokens, hid), assumed_align=16),
        cute.runtime.make_fake_compact_tensor(Int64, (tp,), assumed_align=8),
        Int64(0),
        Int32(0),
        Int32(0),
        cute.runtime.make_fake_stream(),
    )


@functools.cache
def compiled_publisher(tp, hid, multicast=False, fence=False, pdl=False, arch=None, *,
                       twoshot=False, ranks=1):  # fmt: skip
    """One compile per configuration and arch; tokens are dynamic. With ``twoshot`` the
    peer table holds the receive views' addresses; ``ranks`` = TP publishes every rank's
    partial ``[TP, tokens, HID]`` in one launch (grid z = rank)."""
    import cutlass.cute as cute

    kernel = publisher_class()(tp, hid, multicast=multicast, fence=fence, pdl=pdl,
                               twoshot=twoshot, ranks=ranks)  # fmt: skip
    options = None if arch is None else f"--gpu-arch {arch}"
    return cute.compile(kernel, *fake_publisher_arguments(tp, hid), options=options)


FEATURES = 16  # output features per CTA (the MMA's M)
K_CHUNK = 32  # k per warp iteration (two m16n8k16)
WARPS = 4
TILE_SMEM_BYTES = WARPS * 32 * 4 * 4  # fp32 fragments of one tile, summed in warp order

VARIANTS = ("tiled", "deep")
ROW_PAD = 64  # bytes after each staged w_o row: row stride = 64 mod 128, no bank conflicts
DEEP_WEIGHT_SMEM = 52 * 1024  # staged w_o bytes per deep CTA (TP8's whole tile: 50176)
DEEP_CTAS_PER_SM = 4  # launch bound: ceil(448 tiles / 132 SMs), all resident in one wave
SMEM_PER_SM = 233472  # 228 KiB (sm_90 / sm_100)
RESERVED_SMEM = 1024  # per CTA


@dataclass(frozen=True)
class DeepPlan:
    """How ``OprojProducerDeep`` stages one 16-row ``w_o`` tile in shared memory: ``slabs``
    k-slabs of ``k_slab`` columns each (``16 x k_slab`` bf16, rows padded by ``ROW_PAD``)
    through a ring of ``stages`` buffers (``stages == slabs``: the whole tile is requested
    at once, nothing refilled)."""

    d_local: int
    k_slab: int
    slabs: int
    stages: int

    @property
    def row_stride(self) -> int:
        return self.k_slab * 2 + ROW_PAD

    @property
    def slab_bytes(self) -> int:  # shared bytes of one stage
        return FEATURES * self.row_stride

    @property
    def copy_bytes(self) -> int:  # w_o bytes of one slab (the mbarrier's tx count)
        return FEATURES * self.k_slab * 2

    @property
    def smem_bytes(self) -> int:  # dynamic shared memory of one CTA, as allocated
        return self.stages * (self.slab_bytes + 8) + TILE_SMEM_BYTES

    @property
    def in_flight(self) -> int:  # w_o bytes one CTA has requested before it computes
        return self.stages * self.copy_bytes


def deep_plan(d_local: int) -> DeepPlan:
    """The whole tile in one slab when it fits ``DEEP_WEIGHT_SMEM`` (D <= 1536: TP8, TP16);
    otherwise the widest k-slab (a multiple of 128 dividing D) of at most half of it, and
    as many stages as fit (>= 2: the next slab streams while one is multiplied)."""
    if not isinstance(d_local, int) or d_local <= 0 or d_local % (K_CHUNK * WARPS):
        raise ValueError(f"d_local must be a positive multiple of 128; got {d_local!r}")

    def slab(k):
        return FEATURES * (2 * k + ROW_PAD)

    if slab(d_local) <= DEEP_WEIGHT_SMEM:
        return DeepPlan(d_local, d_local, 1, 1)
    step = K_CHUNK * WARPS
    k = max(k for k in range(step, d_local, step)
            if d_local % k == 0 and slab(k) <= DEEP_WEIGHT_SMEM // 2)  # fmt: skip
    slabs = d_local // k
    return DeepPlan(d_local, k, slabs, min(slabs, DEEP_WEIGHT_SMEM // slab(k)))


@functools.cache
def _producer_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32

    from tpcomm import ptx
    from tpcomm.cuteutil import launch, ld_shared_b32x4, saddr, smem_tensor

    def ld_nc16(address):
        """Weak 16-byte read-only load (non-coherent path, no L1 allocation): weights."""
        return cute.arch.inline_ptx(
            "ld.global.nc.L1::no_allocate.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
            write_only_types=[Uint32] * 4,
            read_only_args=[address],
        )

    def mma_bf16(c, a, b):
        """``d = a @ b + c``: m16n8k16, bf16 inputs, fp32 accumulate (no memory access)."""
        return cute.arch.inline_ptx(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{{$w0}, {$w1}, {$w2}, {$w3}}, {{$r0}, {$r1}, {$r2}, {$r3}}, "
            "{{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
            write_only_types=[Float32] * 4,
            read_only_args=[*a, *b, *c],
        )

    class OprojProducer:
        """Compile-time configuration: TP, HID, D (local width), multicast, fence, PDL."""

        def __init__(self, tp, hid, d_local, *, multicast=False, fence=False, pdl=False,
                     twoshot=False, ranks=1):  # fmt: skip
            check_ranks(tp, ranks, twoshot)
            self.ranks = ranks
            if not isinstance(tp, int) or not 1 <= tp <= MAX_TP:
                raise ValueError(f"tp must be an int in 1..{MAX_TP}; got {tp!r}")
            if not isinstance(hid, int) or hid % SLICE or not SLICE <= hid <= 8 * SLICE:
                raise ValueError(f"hid must be a multiple of 1024 in 1024..8192; got {hid!r}")
            if not isinstance(d_local, int) or d_local <= 0 or d_local % (K_CHUNK * WARPS):
                raise ValueError(f"d_local must be a positive multiple of 128; got {d_local!r}")
            if twoshot and hid % (8 * tp):
                raise ValueError(f"twoshot needs hid ({hid}) divisible by 8 * tp ({8 * tp})")
            self.tp, self.hid, self.d = tp, hid, d_local
            self.multicast, self.fence, self.pdl = bool(multicast), bool(fence), bool(pdl)
            self.twoshot = bool(twoshot)

        @cute.jit
        def __call__(
            self,
            attn_out: cute.Tensor,
            w_o: cute.Tensor,
            peers: cute.Tensor,
            multicast_base: Int64,
            rank: Int32,
            step: Int32,
            stream: cuda.CUstream,
        ):
            call = self.kernel(
                Int64(attn_out.iterator.toint()),
                Int64(w_o.iterator.toint()),
                peers,
                multicast_base,
                attn_out.shape[0],
                rank,
                step,
            )
            grid = (self.hid // FEATURES, self.ranks, 1)
            launch(call, grid, (WARPS * 32, 1, 1), stream, use_pdl=self.pdl)

        @cute.jit
        def rank_operands(self, a_attn: Int64, a_w: Int64, tokens: Int32, rank: Int32):
            """(attn_out, w_o, rank) of the rank this CTA projects: grid y = r is rank
            ``rank + r`` (``ranks`` > 1: every rank's operands ``[TP, ...]`` contiguous)."""
            _, r, _ = cute.arch.block_idx()
            if cutlass.const_expr(self.ranks > 1):
                r64 = Int64(r)
                a_attn = a_attn + r64 * Int64(tokens) * (self.d * 2)
                a_w = a_w + r64 * (self.hid * self.d * 2)
                rank = rank + r
            return a_attn, a_w, rank

        @cute.kernel
        def kernel(self, a_attn: Int64, a_w: Int64, peers: cute.Tensor, multicast_base: Int64,
                   tokens: Int32, rank: Int32, step: Int32):  # fmt: skip
            tid, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            a_attn, a_w, rank = self.rank_operands(a_attn, a_w, tokens, rank)
            smem = cutlass.memory.SmemAllocator()
            red = smem_tensor(smem, Float32, (WARPS, 32, 4))
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            self.tile(a_attn, a_w, peers, multicast_base, tokens, rank, step, cta, tid, red,
                      0, None, self.pdl)  # fmt: skip

        @cute.jit
        def tile(self, a_attn: Int64, a_w: Int64, peers: cute.Tensor, multicast_base: Int64,
                 tokens: Int32, rank: Int32, step: Int32, index, tid, red, warp0,
                 barrier_id, wait: cutlass.Constexpr[bool]):  # fmt: skip
            """One 16-feature tile ``index`` (features ``16 index ..``) by the 128 threads
            ``tid`` = 0..127 of four warps: GEMM, warp-order sum through ``red[warp0 ..
            warp0 + 3]``, publish. ``barrier_id`` None: the CTA barrier, else a 128-thread
            named barrier (the fused kernel runs several tiles per CTA). With ``wait`` the
            previous kernel (PDL) is waited for before ``attn_out`` is read."""
            warp, lane = tid // 32, tid % 32
            g, t = lane // 4, lane % 4
            row_bytes = Int64(self.d * 2)
            w_lo = a_w + Int64(index * FEATURES + g) * row_bytes + t * 16
            w_hi = w_lo + 8 * row_bytes
            b_row = a_attn + Int64(cutlass.min(g, tokens - 1)) * row_bytes + t * 16
            live = g < tokens
            if cutlass.const_expr(wait):
                cute.arch.griddepcontrol_wait()
            acc = cute.make_rmem_tensor(4, Float32)
            for j in cutlass.range_constexpr(4):
                acc[j] = Float32(0)
            zero = Uint32(0)
            for i in cutlass.range(self.d // (K_CHUNK * WARPS), unroll=4):
                k_bytes = Int64((i * WARPS + warp) * K_CHUNK * 2)
                lo = ld_nc16(w_lo + k_bytes)
                hi = ld_nc16(w_hi + k_bytes)
                raw = ptx.load16(b_row + k_bytes)  # a real row even for padding lanes
                b = [Uint32(cutlass.select_(live, Uint32(raw[j]), zero)) for j in range(4)]
                c = [acc[0], acc[1], acc[2], acc[3]]
                d = mma_bf16(c, (lo[0], hi[0], lo[1], hi[1]), (b[0], b[1]))
                d = mma_bf16(d, (lo[2], hi[2], lo[3], hi[3]), (b[2], b[3]))
                for j in cutlass.range_constexpr(4):
                    acc[j] = d[j]
            for j in cutlass.range_constexpr(4):
                red[warp0 + warp, lane, j] = acc[j]
            if cutlass.const_expr(barrier_id is None):
                cute.arch.barrier()
            else:
                cute.arch.barrier(barrier_id=barrier_id, number_of_threads=THREADS)
            self.publish_tile(peers, multicast_base, tokens, rank, step, index, tid, red, warp0)

        @cute.jit
        def publish_tile(self, peers: cute.Tensor, multicast_base: Int64, tokens: Int32,
                         rank: Int32, step: Int32, index, tid, red, warp0):  # fmt: skip
            """Tile ``index``'s four warp fragments ``red[warp0 .. warp0 + 3]`` (written and
            made visible by the caller's barrier) summed in warp order, rounded to bf16 and
            published by the 128 threads ``tid``."""
            # thread -> (token n, half h of the 16 features, peer lane q)
            group, q = tid // 8, tid % 8
            n, h = group // 2, group % 2
            if n < tokens:
                values = []
                for j in cutlass.range_constexpr(8):
                    src = (j * 4 + n // 2, 2 * h + n % 2)  # (lane, register) holding it
                    s = red[warp0, src[0], src[1]] + red[warp0 + 1, src[0], src[1]]
                    s = s + red[warp0 + 2, src[0], src[1]]
                    values.append(s + red[warp0 + 3, src[0], src[1]])
                words = [ptx.pack_bf16x2(values[2 * j], values[2 * j + 1]) for j in range(4)]
                slot_bytes = Int64(tokens) * (self.hid * 2)
                column = index * FEATURES + h * 8
                offset = (Int64(step & 1) * self.tp + rank) * slot_bytes
                offset = offset + (Int64(n) * self.hid + column) * 2
                if cutlass.const_expr(self.fence):
                    ptx.fence_sys()
                if cutlass.const_expr(self.twoshot):
                    if q == 0:
                        owner = column // (self.hid // self.tp)
                        shard = twoshot_offset(self.tp, self.hid, step, rank, tokens, n, column)
                        ptx.publish(peers[owner] + shard, words)
                elif cutlass.const_expr(self.multicast):
                    if q == 0:
                        ptx.publish(multicast_base + offset, words, multicast=True)
                else:
                    for p0 in cutlass.range_constexpr(0, self.tp, 8):
                        if p0 + q < self.tp:
                            ptx.publish(peers[p0 + q] + offset, words)

    def bulk_load(shared: Int32, source: Int64, size: int, mbar: Int32):
        """Async proxy, no ordering for this thread: ``size`` bytes global -> shared
        (``cp.async.bulk``, no tensor map), completing ``size`` bytes of tx on ``mbar``;
        readable by the threads that then wait on that mbarrier phase."""
        cute.arch.inline_ptx(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
            f"[{{$r0}}], [{{$r1}}], {int(size)}, [{{$r2}}];",
            read_only_args=[shared, source, mbar],
        )

    class OprojProducerDeep(OprojProducer):
        """``OprojProducer`` built for weight bandwidth (see ``deep_plan``): one CTA per
        16-feature tile, its ``w_o`` rows requested at once by ``cp.async.bulk`` into
        shared memory, before the PDL wait; same fragments, warp-order sum and publish."""

        def __init__(self, tp, hid, d_local, **kw):
            super().__init__(tp, hid, d_local, **kw)
            self.plan = deep_plan(d_local)

        @cute.jit
        def __call__(
            self,
            attn_out: cute.Tensor,
            w_o: cute.Tensor,
            peers: cute.Tensor,
            multicast_base: Int64,
            rank: Int32,
            step: Int32,
            stream: cuda.CUstream,
        ):
            call = self.kernel(
                Int64(attn_out.iterator.toint()),
                Int64(w_o.iterator.toint()),
                peers,
                multicast_base,
                attn_out.shape[0],
                rank,
                step,
            )
            grid = (self.hid // FEATURES, self.ranks, 1)
            launch(call, grid, (WARPS * 32, 1, 1), stream, use_pdl=self.pdl,
                   min_blocks_per_mp=DEEP_CTAS_PER_SM, carveout=100)  # fmt: skip

        @cute.jit
        def request(self, a_w: Int64, index, n, stage_base: Int32, bar):
            """One thread: arm ``bar`` for slab ``n`` of tile ``index`` and request its 16
            rows (each ``k_slab`` contiguous bf16 of a ``w_o`` row) into one stage."""
            plan = self.plan
            cute.arch.mbarrier_arrive_and_expect_tx(bar, plan.copy_bytes)
            first = a_w + Int64(index * FEATURES) * (self.d * 2) + n * (plan.k_slab * 2)
            for r in cutlass.range_constexpr(FEATURES):
                bulk_load(stage_base + r * plan.row_stride, first + r * (self.d * 2),
                          plan.copy_bytes // FEATURES, Int32(bar.toint()))  # fmt: skip

        @cute.kernel
        def kernel(self, a_attn: Int64, a_w: Int64, peers: cute.Tensor, multicast_base: Int64,
                   tokens: Int32, rank: Int32, step: Int32):  # fmt: skip
            plan = self.plan
            tid, _, _ = cute.arch.thread_idx()
            index, _, _ = cute.arch.block_idx()
            a_attn, a_w, rank = self.rank_operands(a_attn, a_w, tokens, rank)
            smem = cutlass.memory.SmemAllocator()
            slabs = smem_tensor(smem, Uint32, (plan.stages, plan.slab_bytes // 4), align=128)
            red = smem_tensor(smem, Float32, (WARPS, 32, 4))
            bars = smem.allocate_array(Int64, plan.stages, byte_alignment=8)
            base = saddr(slabs, (0, 0))
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            if tid == 0:  # w_o is no kernel's output: requested before the PDL wait
                for s in cutlass.range_constexpr(plan.stages):
                    cute.arch.mbarrier_init(bars + s, 1)
                cute.arch.mbarrier_init_fence()
                for s in cutlass.range_constexpr(plan.stages):
                    self.request(a_w, index, s, base + s * plan.slab_bytes, bars + s)
            warp, lane = tid // 32, tid % 32
            g, t = lane // 4, lane % 4
            row_bytes = Int64(self.d * 2)
            b_row = a_attn + Int64(cutlass.min(g, tokens - 1)) * row_bytes + t * 16
            live = g < tokens
            zero = Uint32(0)
            chunks = plan.k_slab // (K_CHUNK * WARPS)  # per warp and slab
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
            cute.arch.barrier()  # the mbarriers' initialisation, for every waiting thread
            acc = cute.make_rmem_tensor(4, Float32)
            for j in cutlass.range_constexpr(4):
                acc[j] = Float32(0)
            for n in cutlass.range_constexpr(plan.slabs):
                stage = n % plan.stages
                # this warp's attn_out fragments of the slab, in flight during the wait
                frags = []
                for i in cutlass.range_constexpr(chunks):
                    k_bytes = ((n * chunks + i) * WARPS + warp) * (K_CHUNK * 2)
                    raw = ptx.load16(b_row + k_bytes)  # a real row even for padding lanes
                    frags.append([Uint32(cutlass.select_(live, Uint32(raw[j]), zero))
                                  for j in range(4)])  # fmt: skip
                cute.arch.mbarrier_wait(bars + stage, (n // plan.stages) % 2)
                w_lo = base + stage * plan.slab_bytes + g * plan.row_stride + t * 16
                w_hi = w_lo + 8 * plan.row_stride
                for i in cutlass.range_constexpr(chunks):
                    k_bytes = (i * WARPS + warp) * (K_CHUNK * 2)
                    lo = ld_shared_b32x4(w_lo + k_bytes)
                    hi = ld_shared_b32x4(w_hi + k_bytes)
                    b = frags[i]
                    c = [acc[0], acc[1], acc[2], acc[3]]
                    d = mma_bf16(c, (lo[0], hi[0], lo[1], hi[1]), (b[0], b[1]))
                    d = mma_bf16(d, (lo[2], hi[2], lo[3], hi[3]), (b[2], b[3]))
                    for j in cutlass.range_constexpr(4):
                        acc[j] = d[j]
                if cutlass.const_expr(n + plan.stages < plan.slabs):
                    cute.arch.barrier()  # every warp is done with this stage: refill it
                    if tid == 0:
                        cute.arch.fence_proxy("async.shared", space="cta")
                        self.request(a_w, index, n + plan.stages,
                                     base + stage * plan.slab_bytes, bars + stage)  # fmt: skip
            for j in cutlass.range_constexpr(4):
                red[warp, lane, j] = acc[j]
            cute.arch.barrier()
            self.publish_tile(peers, multicast_base, tokens, rank, step, index, tid, red, 0)

    return OprojProducer, OprojProducerDeep


def producer_class(variant="tiled"):
    """The ``OprojProducer`` class, or with ``variant="deep"`` ``OprojProducerDeep``
    (imports the CuTe DSL)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    return _producer_class()[VARIANTS.index(variant)]


def fake_producer_arguments(tp: int, hid: int, d_local: int):
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Int64

    tokens = cute.sym_int()

    def fake(dtype, shape, align=16):
        return cute.runtime.make_fake_compact_tensor(dtype, shape, assumed_align=align)

    return (
        fake(BFloat16, (tokens, d_local)),
        fake(BFloat16, (hid, d_local)),
        fake(Int64, (tp,), align=8),
        Int64(0),
        Int32(0),
        Int32(0),
        cute.runtime.make_fake_stream(),
    )


@functools.cache
def compiled_producer(tp, hid, d_local, multicast=False, fence=False, pdl=False, arch=None, *,
                      twoshot=False, variant="tiled", ranks=1):  # fmt: skip
    """One compile per configuration, variant and arch; tokens are dynamic (1..8).
    ``ranks`` = TP projects every rank in one launch (grid y = rank; ``attn_out``
    ``[TP, tokens, D]`` and ``w_o`` ``[TP, HID, D]`` contiguous, rank 0's passed)."""
    import cutlass.cute as cute

    kernel = producer_class(variant)(tp, hid, d_local, multicast=multicast, fence=fence,
                                     pdl=pdl, twoshot=twoshot, ranks=ranks)  # fmt: skip
    options = None if arch is None else f"--gpu-arch {arch}"
    return cute.compile(kernel, *fake_producer_arguments(tp, hid, d_local), options=options)
