"""O-projection producer side: a rank's partial published into every rank's mailbox.

``PartialPublisher``: rank r's ready partial ``[tokens, HID]`` bf16 (one CTA per row and
consumer slice, ``plan.slicing``; a thread per 16-byte group) goes into slot
``[step & 1, r]`` of every rank's mailbox (one relaxed sys store per peer, or one multicast
store), sentinel words canonicalised. With ``fence`` a sys fence first orders the publish
after the previous step's re-arms on other GPUs. With ``twoshot`` each group goes only to
the rank owning its columns (slot ``[step & 1, r]`` of its receive view).

``OprojProducer``: ``partial = bf16(attn_out @ w_o^T)`` (tokens 1..8, fp32 accumulation,
one rounding to bf16, nearest even), published the same way. Swap A/B: ``mma.sync``
m16n8k16 with 16 features as M and the tokens as N = 8; warp w takes k chunks w, w + 4,
...; the four warps' fragments are added in warp order through shared memory. Only the
fp32 accumulation order differs from ``reference.project`` (within 1 bf16 ulp). With
``pdl`` it waits for the previous kernel before reading ``attn_out``. ``tile`` is one
CTA's work for any 128 threads (the fused kernel runs several per CTA).

``ranks`` = TP (one GPU): one launch serves every rank, rank r's operands at r times one
rank's size past rank 0's.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32

from tpcomm import protocol
from tpcomm.cuteutil import (
    compile_cached,
    fake_tensor,
    launch,
    ld_global_nc_b32x4,
    mma_bf16_16816,
    pack_bf16x2,
    smem_tensor,
)
from tpcomm.oproj.operands import ProducerOperands, ProjectionAddresses, PublishOperands
from tpcomm.oproj.plan import FEATURES, K_CHUNK, THREADS, WARPS, check_producer, slicing

Flag = cutlass.Constexpr[bool]  # a compile-time bool parameter


def twoshot_offset(tp, hid, step, rank, tokens, token, column):
    """Byte offset of ``column`` of ``token`` in slot ``[step & 1, rank]`` of the owning
    rank's twoshot receive view ``[2, TP, tokens, HID / TP]`` (traced: Int32/Int64 in)."""
    width = hid // tp
    owner = column // width
    slot = (Int64(step & 1) * tp + rank) * Int64(tokens) + Int64(token)
    return (slot * width + Int64(column - owner * width)) * 2


class GroupPublisher:
    """Needs ``tp``, ``hid``, ``twoshot`` and ``multicast``: where a rank's 16-byte group
    of its partial goes (the publisher's and the wgmma producer's)."""

    @cute.jit
    def publish_group(
        self, peers, multicast_base, offset, tokens, rank, step, token, column, words
    ):
        """The group of features ``column ..`` of row ``token`` into slot ``[step & 1,
        rank]`` of every rank's mailbox at byte ``offset`` (one store per peer, or one
        multicast store), or into the owner's twoshot receive view."""
        if cutlass.const_expr(self.twoshot):
            owner = column // (self.hid // self.tp)
            offset = twoshot_offset(self.tp, self.hid, step, rank, tokens, token, column)
            protocol.publish(peers[owner] + offset, words)
        elif cutlass.const_expr(self.multicast):
            protocol.publish(multicast_base + offset, words, multicast=True)
        else:
            for p in cutlass.range_constexpr(self.tp):
                protocol.publish(peers[p] + offset, words)


class PartialPublisher(GroupPublisher):
    """Compile-time configuration: TP, HID, multicast, sys fence, PDL, twoshot."""

    def __init__(self, tp, hid, *, multicast=False, fence=False, pdl=False, twoshot=False, ranks=1):
        check_producer(tp, hid, twoshot=twoshot, ranks=ranks)
        self.ranks = ranks
        self.tp, self.hid = tp, hid
        self.multicast, self.fence, self.pdl = bool(multicast), bool(fence), bool(pdl)
        self.twoshot = bool(twoshot)
        self.columns = slicing(hid).columns

    @cute.jit
    def __call__(self, op: PublishOperands, rank: Int32, step: Int32, stream: cuda.CUstream):
        partial, peers, multicast_base = op
        call = self.kernel(
            Int64(partial.iterator.toint()), peers, multicast_base, partial.shape[0], rank, step
        )
        grid = (self.hid // self.columns, partial.shape[0], self.ranks)
        launch(call, grid, (self.columns // 8, 1, 1), stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(
        self,
        a_partial: Int64,
        peers: cute.Tensor,
        multicast_base: Int64,
        tokens: Int32,
        rank: Int32,
        step: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, token, r = cute.arch.block_idx()
        if cutlass.const_expr(self.ranks > 1):  # rank ``rank + r``'s partial
            a_partial = a_partial + Int64(r) * Int64(tokens) * (self.hid * 2)
            rank = rank + r
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        column = cta * self.columns + tid * 8
        row = (Int64(token) * self.hid + column) * 2
        words = protocol.load16(a_partial + row)
        slot_bytes = Int64(tokens) * (self.hid * 2)
        offset = (Int64(step & 1) * self.tp + rank) * slot_bytes + row
        if cutlass.const_expr(self.fence):
            protocol.fence_sys()
        self.publish_group(peers, multicast_base, offset, tokens, rank, step, token, column, words)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()


class OprojProducer:
    """Compile-time configuration: TP, HID, D (local width), multicast, fence, PDL."""

    def __init__(
        self, tp, hid, d_local, *, multicast=False, fence=False, pdl=False, twoshot=False, ranks=1
    ):
        check_producer(tp, hid, d_local, twoshot=twoshot, ranks=ranks)
        self.ranks = ranks
        self.tp, self.hid, self.d = tp, hid, d_local
        self.multicast, self.fence, self.pdl = bool(multicast), bool(fence), bool(pdl)
        self.twoshot = bool(twoshot)

    @cute.jit
    def __call__(self, op: ProducerOperands, rank: Int32, step: Int32, stream: cuda.CUstream):
        attn_out, w_o, peers, multicast_base = op
        a_attn, a_w = Int64(attn_out.iterator.toint()), Int64(w_o.iterator.toint())
        tokens = attn_out.shape[0]
        call = self.kernel(
            ProjectionAddresses(a_attn, a_w, peers, multicast_base, tokens, rank, step)
        )
        grid = (self.hid // FEATURES, self.ranks, 1)
        launch(call, grid, (WARPS * 32, 1, 1), stream, use_pdl=self.pdl)

    @cute.jit
    def rank_operands(self, p: ProjectionAddresses) -> ProjectionAddresses:
        """``p`` of the rank this CTA projects: grid y = r is rank ``rank + r`` (``ranks``
        > 1: every rank's operands ``[TP, ...]`` contiguous)."""
        _, r, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.ranks > 1):
            r64 = Int64(r)
            p = p._replace(
                a_attn=p.a_attn + r64 * Int64(p.tokens) * (self.d * 2),
                a_w=p.a_w + r64 * (self.hid * self.d * 2),
                rank=p.rank + r,
            )
        return p

    @cute.kernel
    def kernel(self, p: ProjectionAddresses):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        p = self.rank_operands(p)
        smem = cutlass.memory.SmemAllocator()
        red = smem_tensor(smem, Float32, (WARPS, 32, 4))
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        self.tile(p, cta, tid, red, 0, None, self.pdl)

    @cute.jit
    def tile(self, p: ProjectionAddresses, index, tid, red, warp0, barrier_id, wait: Flag):
        """One 16-feature tile ``index`` (features ``16 index ..``) by the 128 threads
        ``tid`` = 0..127 of four warps: GEMM, warp-order sum through ``red[warp0 ..
        warp0 + 3]``, publish. ``barrier_id`` None: the CTA barrier, else a 128-thread
        named barrier (the fused kernel runs several tiles per CTA). With ``wait`` the
        previous kernel (PDL) is waited for before ``attn_out`` is read."""
        a_attn, a_w, tokens = p.a_attn, p.a_w, p.tokens
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
            lo = ld_global_nc_b32x4(w_lo + k_bytes)
            hi = ld_global_nc_b32x4(w_hi + k_bytes)
            raw = protocol.load16(b_row + k_bytes)  # a real row even for padding lanes
            b = [Uint32(cutlass.select_(live, Uint32(raw[j]), zero)) for j in range(4)]
            c = [acc[0], acc[1], acc[2], acc[3]]
            d = mma_bf16_16816((lo[0], hi[0], lo[1], hi[1]), (b[0], b[1]), c)
            d = mma_bf16_16816((lo[2], hi[2], lo[3], hi[3]), (b[2], b[3]), d)
            for j in cutlass.range_constexpr(4):
                acc[j] = d[j]
        for j in cutlass.range_constexpr(4):
            red[warp0 + warp, lane, j] = acc[j]
        if cutlass.const_expr(barrier_id is None):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=THREADS)
        self.publish_tile(p, index, tid, red, warp0)

    @cute.jit
    def publish_tile(self, p: ProjectionAddresses, index, tid, red, warp0):
        """Tile ``index``'s four warp fragments ``red[warp0 .. warp0 + 3]`` (written and
        made visible by the caller's barrier) summed in warp order, rounded to bf16 and
        published by the 128 threads ``tid``."""
        peers, multicast_base, tokens, rank, step = p[2:]
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
            words = [pack_bf16x2(values[2 * j], values[2 * j + 1]) for j in range(4)]
            slot_bytes = Int64(tokens) * (self.hid * 2)
            column = index * FEATURES + h * 8
            offset = (Int64(step & 1) * self.tp + rank) * slot_bytes
            offset = offset + (Int64(n) * self.hid + column) * 2
            if cutlass.const_expr(self.fence):
                protocol.fence_sys()
            if cutlass.const_expr(self.twoshot):
                if q == 0:
                    owner = column // (self.hid // self.tp)
                    shard = twoshot_offset(self.tp, self.hid, step, rank, tokens, n, column)
                    protocol.publish(peers[owner] + shard, words)
            elif cutlass.const_expr(self.multicast):
                if q == 0:
                    protocol.publish(multicast_base + offset, words, multicast=True)
            else:
                for p0 in cutlass.range_constexpr(0, self.tp, 8):
                    if p0 + q < self.tp:
                        protocol.publish(peers[p0 + q] + offset, words)


def fake_publisher_arguments(tp: int, hid: int):
    """Compile-only arguments of ``PartialPublisher.__call__`` (tokens dynamic)."""
    partial = fake_tensor(BFloat16, (cute.sym_int(), hid))
    operands = PublishOperands(partial, fake_tensor(Int64, (tp,), align=8), Int64(0))
    return operands, Int32(0), Int32(0), cute.runtime.make_fake_stream()


def fake_producer_arguments(tp: int, hid: int, d_local: int):
    """Compile-only arguments of ``OprojProducer.__call__`` (tokens dynamic)."""
    operands = ProducerOperands(
        fake_tensor(BFloat16, (cute.sym_int(), d_local)),
        fake_tensor(BFloat16, (hid, d_local)),
        fake_tensor(Int64, (tp,), align=8),
        Int64(0),
    )
    return operands, Int32(0), Int32(0), cute.runtime.make_fake_stream()


def compiled_publisher(
    tp, hid, multicast=False, fence=False, pdl=False, arch=None, *, twoshot=False, ranks=1
):
    """One compile per configuration and arch; tokens are dynamic."""
    config = dict(multicast=multicast, fence=fence, pdl=pdl, twoshot=twoshot, ranks=ranks)

    def build():
        return PartialPublisher(tp, hid, **config), fake_publisher_arguments(tp, hid)

    return compile_cached(("oproj_publisher", tp, hid, *config.values()), build, arch=arch)


def compiled_producer(
    tp, hid, d_local, multicast=False, fence=False, pdl=False, arch=None, *, twoshot=False, ranks=1
):
    """One compile per configuration and arch; tokens are dynamic (1..8)."""
    config = dict(multicast=multicast, fence=fence, pdl=pdl, twoshot=twoshot, ranks=ranks)

    def build():
        kernel = OprojProducer(tp, hid, d_local, **config)
        return kernel, fake_producer_arguments(tp, hid, d_local)

    key = ("oproj_producer", tp, hid, d_local, *config.values())
    return compile_cached(key, build, arch=arch)
