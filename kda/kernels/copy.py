"""KdaCopy: copy whole slots of a layer's KDA state, the device side of ``kda.copy_state``
(math: ``kda.reference.copy_state``).

Pair ``p`` copies slot ``src[p]`` into slot ``dst[p]``: the state page, the conv page and,
with a ring, the slot's ring entries (all R of them, held or not) and its counters, bit for
bit. A pair with ``src[p] <= 0`` or ``dst[p] <= 0`` is padding: nothing is read or
written. The pools are passed as ``[S, words]`` int32 views of their pages, so the copy
is dtype-blind (fp32 or bf16 pages, either conv layout: a page is contiguous in both).

Grid ``(ctas, pairs)``: each pool's page is cut into 16-byte vectors and the x-blocks are
split between the pools statically (``plan``), so a CTA copies ``UNROLL`` vectors a thread
of one pool (CTA-uniform branch), all its loads in flight before its stores; x-block 0 of a
pair also copies the ring counters (2H words). Loads take the non-coherent path: the
caller's contract (checked by ``kda.copy_state`` outside graph capture) is that no
destination is also a source of the call, so nothing this kernel reads is written by it.
No PDL: it runs between steps.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from tpcomm.cuteutil import launch, ld_global_nc_b32x4, st_global_b32x4

from ..operands import CopyKernelOperands

THREADS = 256
UNROLL = 4  # 16-byte vectors per thread (loads in flight together)
VECTORS_PER_CTA = THREADS * UNROLL
POOLS = ("state", "conv_state", "ring_v", "ring_kg")


def plan(vectors):
    """Per pool (its 16-byte vectors per page): ``(first x-block, x-blocks)``; and the total
    x-blocks of a pair."""
    spans, first = [], 0
    for n in vectors:
        blocks = (n + VECTORS_PER_CTA - 1) // VECTORS_PER_CTA
        spans.append((first, blocks))
        first += blocks
    return spans, first


class KdaCopy:
    """``words``: the 32-bit words of one page of each pool (``state``, ``conv_state``,
    ``ring_v``, ``ring_kg``; 0 for an absent ring), each a multiple of 4 (16-byte vectors);
    ``counters``: the ring counters' words per slot (2H; 0 without a ring)."""

    def __init__(self, words, counters=0, *, arch="sm_90a"):
        words = tuple(int(w) for w in words)
        if len(words) != len(POOLS) or any(w < 0 or w % 4 for w in words) or words[0] < 4:
            raise ValueError(f"words must be 4 multiples of 4 (state first, > 0); got {words}")
        if counters < 0 or (counters and not words[2]):
            raise ValueError(f"counters must be >= 0 and need a ring; got {counters}")
        self.vectors = tuple(w // 4 for w in words)
        self.counters, self.arch = counters, arch
        self.spans, self.blocks = plan(self.vectors)

    @cute.jit
    def __call__(self, op: CopyKernelOperands, stream):
        """Launch on ``stream`` (``op``: ``kda.operands.CopyKernelOperands``)."""
        pairs = op.src.shape[0]
        launch(self.kernel(op), (self.blocks, pairs, 1), (THREADS, 1, 1), stream)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def copy_pool(self, pool, vectors: cutlass.Constexpr, block, src, dst):
        """Vectors ``block * VECTORS_PER_CTA ..`` of page ``src`` into page ``dst`` of
        ``pool``: every load, then every store (the tail past ``vectors`` re-reads the last
        vector and stores nothing)."""
        tid, _, _ = cute.arch.thread_idx()
        base = Int64(pool.iterator.toint())
        source = base + Int64(src) * (vectors * 16)
        target = base + Int64(dst) * (vectors * 16)
        first = block * VECTORS_PER_CTA + tid
        words = []
        for i in cutlass.range_constexpr(UNROLL):
            v = first + i * THREADS
            at = cutlass.select_(v < vectors, v, Int32(vectors - 1))
            words.append(ld_global_nc_b32x4(source + Int64(at) * 16))
        for i in cutlass.range_constexpr(UNROLL):
            v = first + i * THREADS
            if v < vectors:
                st_global_b32x4(target + Int64(v) * 16, words[i])

    @cute.jit
    def copy_counters(self, op, block, src, dst):
        """The ring counters of slot ``src`` into slot ``dst`` (x-block 0, one word a thread)."""
        tid, _, _ = cute.arch.thread_idx()
        if (block == 0) & (tid < self.counters):
            op.ring_length[Int64(dst), tid] = op.ring_length[Int64(src), tid]

    @cute.kernel
    def kernel(self, op):
        block, pair, _ = cute.arch.block_idx()
        src, dst = Int32(op.src[pair]), Int32(op.dst[pair])
        if (src > 0) & (dst > 0):
            pools = (op.state, op.conv_state, op.ring_v, op.ring_kg)
            for k in cutlass.range_constexpr(len(POOLS)):
                if cutlass.const_expr(self.vectors[k] > 0):
                    first, count = self.spans[k]
                    if (block >= first) & (block < first + count):
                        self.copy_pool(pools[k], self.vectors[k], block - first, src, dst)
            if cutlass.const_expr(self.counters > 0):
                self.copy_counters(op, block, src, dst)
