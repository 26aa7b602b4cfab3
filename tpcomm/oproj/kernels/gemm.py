"""O-projection producer for many rows: a TMA + ``wgmma`` GEMM that publishes from its
epilogue (issue 33).

``OprojGemmProducer``: ``partial = bf16(attn_out @ w_o^T)`` for any number of rows, the
partial never written to a staging buffer: each CTA computes a ``tile_m`` x ``tile_n``
tile (rows x features) and stores it, rounded once to bf16 (nearest even) and sentinel
words canonicalised, straight into every rank's mailbox slot ``[step & 1, rank]``
(one-shot: one relaxed sys store per peer, or one multicast store), or into the owning
rank's twoshot receive view, as ``PartialPublisher`` does with a ready partial.

Mainloop (sm_90a): A = ``attn_out`` [rows, D] and B = ``w_o`` [HID, D], both K-major,
move by TMA in k tiles of 64 into a ``stages``-deep ring of shared memory (swizzled as
``wgmma`` reads it; rows past ``rows`` arrive as zeros), one mbarrier pair per stage
(``PipelineTmaAsync``); warp 0 issues the loads ``stages`` k tiles ahead, the
``tile_m / 64`` warp groups run ``wgmma`` m64 n``tile_n`` k16 with fp32 accumulators, one
``wgmma`` group in flight. The fp32 sums run in k order within each k16 step of the
tensor core, so the result differs from ``reference.project`` (and from cuBLAS) only in
the order of the fp32 sums, the contract of the cuBLAS path it replaces.

Epilogue: each thread's accumulator pairs (two adjacent features) go to a padded bf16
tile in shared memory (over the ring, every load consumed by then) as one rounded word;
after a CTA barrier each thread reads 16-byte groups of the tile (8 features of one row)
and publishes them. Rows at or past ``rows``
are not published.

``ranks`` = TP (one GPU): every rank's operands contiguous (``[TP, rows, D]``,
``[TP, HID, D]``), the rank as the GEMM's batch mode (grid z). With ``pdl`` the CTA
waits for the previous kernel before its first load and lets the next one launch at once.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from tpcomm import protocol
from tpcomm.cuteutil import compile_cached, launch, ld_shared_b32x4, pack_bf16x2, saddr
from tpcomm.oproj.kernels.producer import GroupPublisher, fake_producer_arguments
from tpcomm.oproj.operands import ProducerOperands
from tpcomm.oproj.plan import check_producer

K_TILE = 64  # k elements per stage: four wgmma k16 steps
PAD_WORDS = 4  # 16 bytes of padding per epilogue row: rows start in different banks
SMEM_BYTES = 227 * 1024  # an sm_90 CTA's shared memory
BARRIER_BYTES = 1024
TILES_M = (64, 128)
TILES_N = (64, 128, 256)


def gemm_stages(tile_m: int, tile_n: int, d_local: int) -> int:
    """Stages of the A/B ring: as many as fit (the epilogue tile reuses the ring once the
    mainloop is done), at most the k tiles of one CTA's work (but two)."""
    stage = (tile_m + tile_n) * K_TILE * 2
    return max(2, min(d_local // K_TILE, (SMEM_BYTES - BARRIER_BYTES) // stage))


def check_gemm(tp, hid, d_local, tile_m, tile_n, stages, twoshot, ranks):
    """``ValueError`` naming the argument before any compile."""
    check_producer(tp, hid, d_local, twoshot=twoshot, ranks=ranks)
    if tile_m not in TILES_M:
        raise ValueError(f"tile_m must be one of {TILES_M}; got {tile_m!r}")
    if tile_n not in TILES_N or hid % tile_n:
        raise ValueError(f"tile_n must be one of {TILES_N} and divide hid ({hid}); got {tile_n!r}")
    if d_local % K_TILE:
        raise ValueError(f"d_local ({d_local}) must be a multiple of {K_TILE}")
    if stages is not None and not 2 <= stages <= gemm_stages(tile_m, tile_n, 1 << 20):
        raise ValueError(
            f"stages must be in 2..{gemm_stages(tile_m, tile_n, 1 << 20)}; got {stages!r}"
        )


def make_tiled_mma(warpgroups: int, tile_n: int):
    """``warpgroups`` warp groups of ``wgmma`` m64 n``tile_n`` k16, bf16 x bf16 -> fp32,
    both operands K-major (call inside a CuTe DSL trace)."""
    return sm90.make_trivial_tiled_mma(
        BFloat16,
        BFloat16,
        OperandMajorMode.K,
        OperandMajorMode.K,
        Float32,
        (warpgroups, 1, 1),
        tiler_mn=(64, tile_n),
    )


def accumulator_coords(tiled_mma, tid, tile_m: int, tile_n: int):
    """The (row, feature) in the CTA tile of each of thread ``tid``'s accumulators: the
    thread's own slice of C (a warp group's slice, as A and B take, gives every thread
    of the group its first thread's coordinates)."""
    return tiled_mma.get_slice(tid).partition_C(cute.make_identity_tensor((tile_m, tile_n)))


class OprojGemmProducer(GroupPublisher):
    """Compile-time configuration: TP, HID, D (local width), the CTA tile, the ring's
    stages, multicast, fence, PDL, twoshot, ranks in one launch."""

    def __init__(
        self,
        tp,
        hid,
        d_local,
        *,
        tile_m=64,
        tile_n=128,
        stages=None,
        multicast=False,
        fence=False,
        pdl=False,
        twoshot=False,
        ranks=1,
    ):
        check_gemm(tp, hid, d_local, tile_m, tile_n, stages, twoshot, ranks)
        self.tp, self.hid, self.d, self.ranks = tp, hid, d_local, ranks
        self.tile_m, self.tile_n = tile_m, tile_n
        self.stages = stages or gemm_stages(tile_m, tile_n, d_local)
        self.multicast, self.fence, self.pdl = bool(multicast), bool(fence), bool(pdl)
        self.twoshot = bool(twoshot)
        self.warpgroups = tile_m // 64
        self.threads = 128 * self.warpgroups
        self.tile_mnk = (tile_m, tile_n, K_TILE)
        self.row_words = tile_n // 2 + PAD_WORDS

    @cute.jit
    def __call__(self, op: ProducerOperands, rank: Int32, step: Int32, stream: cuda.CUstream):
        attn_out, w_o, peers, multicast_base = op
        tokens = attn_out.shape[0]
        # (M, K, L) and (N, K, L), K-major; L: the ranks of one launch
        a = cute.make_tensor(
            attn_out.iterator,
            cute.make_layout((tokens, self.d, self.ranks), stride=(self.d, 1, tokens * self.d)),
        )
        b = cute.make_tensor(
            w_o.iterator,
            cute.make_layout((self.hid, self.d, self.ranks), stride=(self.d, 1, self.hid * self.d)),
        )
        tiled_mma = make_tiled_mma(self.warpgroups, self.tile_n)
        a_layout = sm90.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, self.tile_mnk, BFloat16, self.stages
        )
        b_layout = sm90.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, self.tile_mnk, BFloat16, self.stages
        )
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, gmem_a = cpasync.make_tiled_tma_atom(
            g2s, a, cute.slice_(a_layout, (None, None, 0)), (self.tile_m, K_TILE)
        )
        tma_b, gmem_b = cpasync.make_tiled_tma_atom(
            g2s, b, cute.slice_(b_layout, (None, None, 0)), (self.tile_n, K_TILE)
        )

        @cute.struct
        class Storage:
            barriers: cute.struct.MemRange[Int64, self.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_layout)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]

        self.storage = Storage
        call = self.kernel(
            tma_a,
            gmem_a,
            tma_b,
            gmem_b,
            tiled_mma,
            a_layout,
            b_layout,
            peers,
            multicast_base,
            tokens,
            rank,
            step,
        )
        grid = ((tokens + self.tile_m - 1) // self.tile_m, self.hid // self.tile_n, self.ranks)
        launch(call, grid, (self.threads, 1, 1), stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        gmem_a: cute.Tensor,
        tma_b: cute.CopyAtom,
        gmem_b: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        peers: cute.Tensor,
        multicast_base: Int64,
        tokens: Int32,
        rank: Int32,
        step: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        bm, bn, r = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        stage_bytes = cute.size_in_bytes(
            BFloat16, cute.slice_(a_layout, (None, None, 0))
        ) + cute.size_in_bytes(BFloat16, cute.slice_(b_layout, (None, None, 0)))
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        sa = storage.sa.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sb = storage.sb.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        # the epilogue tile over the ring (sa, then sb right after it: both 1024-aligned,
        # sa a multiple of 1024 bytes) once the mainloop is done
        ring_bytes = 2 * (cute.cosize(a_layout) + cute.cosize(b_layout))
        assert self.tile_m * self.row_words * 4 <= ring_bytes
        out = cute.make_tensor(
            cute.recast_ptr(storage.sa.data_ptr(), dtype=Int32),
            cute.make_layout((self.tile_m, self.row_words), stride=(self.row_words, 1)),
        )
        coord = (bm, bn, None, r)
        ga = cute.local_tile(gmem_a, self.tile_mnk, coord, proj=(1, None, 1))  # (bM, bK, k)
        gb = cute.local_tile(gmem_b, self.tile_mnk, coord, proj=(None, 1, 1))  # (bN, bK, k)
        one = cute.make_layout(1)
        tas, tag = cpasync.tma_partition(
            tma_a, 0, one, cute.group_modes(sa, 0, 2), cute.group_modes(ga, 0, 2)
        )
        tbs, tbg = cpasync.tma_partition(
            tma_b, 0, one, cute.group_modes(sb, 0, 2), cute.group_modes(gb, 0, 2)
        )

        # A and B: the warp group's shared-memory descriptors; C: this thread's own values
        group = cute.arch.make_warp_uniform(tid // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.warpgroups, stride=128)(group))
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(sa))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sb))
        coords = accumulator_coords(tiled_mma, tid, self.tile_m, self.tile_n)
        acc = cute.make_rmem_tensor(coords.shape, Float32)
        cute.arch.sync_threads()  # the ring's barriers initialised

        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()  # attn_out comes from the previous kernel
        k_tiles = cute.size(ga, mode=[2])
        loads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if warp == 0:
            for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                self.load_stage(ring, loads, tma_a, tas, tag, tma_b, tbs, tbg)
                loads.advance()

        reads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        frees = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        blocks = cute.size(frag_a, mode=[2])
        # k tile 0 (peeled: its first wgmma starts the accumulators from zero)
        ring.consumer_wait(reads)
        warpgroup.fence()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(blocks):
            at = (None, None, kb, reads.index)
            cute.gemm(tiled_mma, acc, frag_a[at], frag_b[at], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        reads.advance()
        for _ in cutlass.range(1, k_tiles, 1, unroll=1):
            ring.consumer_wait(reads)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(blocks):
                at = (None, None, kb, reads.index)
                cute.gemm(tiled_mma, acc, frag_a[at], frag_b[at], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # the previous k tile's wgmma group is done: free its stage
            ring.consumer_release(frees)
            frees.advance()
            reads.advance()
            # refill the freed stage (never before it is freed: warp 0 arrives too)
            if (warp == 0) & (loads.count < k_tiles):
                self.load_stage(ring, loads, tma_a, tas, tag, tma_b, tbs, tbg)
                loads.advance()
        warpgroup.wait_group(0)
        cute.arch.sync_threads()  # every warp group's wgmma done reading the ring

        # epilogue: rounded pairs into the padded tile, then 16-byte groups published
        for i in cutlass.range_constexpr(0, cute.size(acc), 2):
            m, n = coords[i]
            out[m, n // 2] = pack_bf16x2(acc[i], acc[i + 1])
        cute.arch.sync_threads()
        if cutlass.const_expr(self.ranks > 1):
            rank = rank + r
        groups = self.tile_n // 8
        if cutlass.const_expr(self.fence):
            protocol.fence_sys()
        for j in cutlass.range_constexpr(self.tile_m * groups // self.threads):
            g = tid + j * self.threads
            row, chunk = g // groups, g % groups
            token = bm * self.tile_m + row
            if token < tokens:
                words = [Int32(w) for w in ld_shared_b32x4(saddr(out, (row, chunk * 4)))]
                column = bn * self.tile_n + chunk * 8
                offset = (Int64(step & 1) * self.tp + rank) * (Int64(tokens) * (self.hid * 2))
                offset = offset + (Int64(token) * self.hid + column) * 2
                self.publish_group(
                    peers, multicast_base, offset, tokens, rank, step, token, column, words
                )

    @cute.jit
    def load_stage(self, ring, state, tma_a, tas, tag, tma_b, tbs, tbg):
        """Warp 0: wait for the stage to be free, then TMA k tile ``state.count`` of A and B
        into it (the stage's mbarrier counts the bytes)."""
        ring.producer_acquire(state)
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_a, tag[(None, state.count)], tas[(None, state.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, tbg[(None, state.count)], tbs[(None, state.index)], tma_bar_ptr=bar)
        ring.producer_commit(state)


def fake_gemm_arguments(tp: int, hid: int, d_local: int):
    """Compile-only arguments of ``OprojGemmProducer.__call__`` (rows dynamic): the
    mma.sync producer's."""
    return fake_producer_arguments(tp, hid, d_local)


def compiled_gemm_producer(
    tp,
    hid,
    d_local,
    multicast=False,
    fence=False,
    pdl=False,
    arch=None,
    *,
    tile_m=64,
    tile_n=128,
    stages=None,
    twoshot=False,
    ranks=1,
):
    """One compile per configuration and arch (sm_90a: ``wgmma``); rows are dynamic."""
    if arch is not None and arch != "sm_90a":
        raise ValueError(f"arch: the wgmma producer runs on sm_90a only; got {arch!r}")
    config = dict(
        tile_m=tile_m,
        tile_n=tile_n,
        stages=stages,
        multicast=multicast,
        fence=fence,
        pdl=pdl,
        twoshot=twoshot,
        ranks=ranks,
    )

    def build():
        kernel = OprojGemmProducer(tp, hid, d_local, **config)
        return kernel, fake_gemm_arguments(tp, hid, d_local)

    key = ("oproj_gemm_producer", tp, hid, d_local, *config.values())
    return compile_cached(key, build, arch=arch)
