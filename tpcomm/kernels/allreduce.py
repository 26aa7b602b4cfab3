"""``AllReduceKernel``: the mailbox all-reduce of one rank and step (``tpcomm.allreduce``).

Rank r loads its partial ``[tokens, HID]`` bf16 (16 bytes a thread), publishes it into slot
``[step & 1, r]`` of every rank's mailbox (relaxed sys stores, or one multicast store),
polls its own slots four ranks at a time with a bounded spin (on expiry: the missing-rank
mask into the error word, no output, no re-arm), sums them in rank order in fp32 from rank
0's value, rounds once to bf16 (bitwise ``tpcomm.mailbox.rank_order_sum``) and re-arms the
slots it read. Grid ``(HID / 1024, tokens)``, 128 threads, launch bound 8 CTAs per SM.
"""

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm import protocol
from tpcomm.cuteutil import compile_cached, fake_tensor, launch, pack_bf16x2
from tpcomm.mailbox import ALLREDUCE_BLOCKS_PER_SM as MIN_BLOCKS_PER_SM
from tpcomm.mailbox import COLUMNS_PER_CTA, MAX_TP, POLL_CHUNK
from tpcomm.mailbox import CTA_THREADS as THREADS


class AllReduceOperands(NamedTuple):
    """The kernel's parameters: rank ``rank``'s partial and output ``[tokens, HID]``, its
    mailbox, the peer table and multicast address it publishes through, its error word,
    the step's parity and the poll budget."""

    partial: cute.Tensor
    out: cute.Tensor
    mailbox: cute.Tensor
    peers: cute.Tensor
    multicast_base: Int64
    error: cute.Tensor
    rank: Int32
    step: Int32
    budget_ns: Int64


class AllReduceKernel:
    """Compile-time configuration: TP, HID, publish path, optional sys fence."""

    def __init__(self, tp: int, hid: int, *, multicast: bool = False, fence: bool = False):
        if not 1 <= tp <= MAX_TP:
            raise ValueError(f"tp must be in 1..{MAX_TP}; got {tp}")
        if hid <= 0 or hid % COLUMNS_PER_CTA:
            raise ValueError(f"hid must be a positive multiple of {COLUMNS_PER_CTA}; got {hid}")
        self.tp, self.hid = tp, hid
        self.multicast, self.fence = bool(multicast), bool(fence)

    @cute.jit
    def __call__(self, op: AllReduceOperands, stream: cuda.CUstream):
        grid = (self.hid // COLUMNS_PER_CTA, op.partial.shape[0], 1)
        launch(self.kernel(op), grid, (THREADS, 1, 1), stream, min_blocks_per_mp=MIN_BLOCKS_PER_SM)

    @cute.jit
    def publish_all(self, words, peers, multicast_base, offset):
        if cutlass.const_expr(self.multicast):
            protocol.publish(multicast_base + offset, words, multicast=True)
        else:
            for p in cutlass.range_constexpr(self.tp):
                protocol.publish(peers[p] + offset, words)

    @cute.jit
    def poll_sum(self, acc, raw, base, slot0, slot_bytes, budget_ns, error_address):
        """Rank-order fp32 sum of all slots into ``acc``; returns the missing mask."""
        failed = Int32(0)
        for c in cutlass.range_constexpr((self.tp + POLL_CHUNK - 1) // POLL_CHUNK):
            first: cutlass.Constexpr = c * POLL_CHUNK
            count: cutlass.Constexpr = min(POLL_CHUNK, self.tp - first)
            if failed == 0:
                addresses = [base + slot0 + (first + i) * slot_bytes for i in range(count)]
                missing = protocol.poll_groups(
                    raw, addresses, count, budget_ns, error_address, first
                )
                failed = missing << first
                if missing == 0:
                    protocol.add_in_rank_order(acc, raw, count, first)
        return failed

    @cute.kernel
    def kernel(self, op: AllReduceOperands):
        partial, out, mailbox, peers, multicast_base, error, rank, step, budget_ns = op
        tid, _, _ = cute.arch.thread_idx()
        cta, token, _ = cute.arch.block_idx()
        tokens = partial.shape[0]
        column = cta * COLUMNS_PER_CTA + tid * 8
        row = Int64(token * self.hid + column) * 2  # byte offset inside one slot
        slot_bytes = Int64(tokens) * (self.hid * 2)
        half = Int64(step & 1) * self.tp
        words = protocol.load16(Int64(partial.iterator.toint()) + row)
        if cutlass.const_expr(self.fence):
            protocol.fence_sys()
        self.publish_all(words, peers, multicast_base, (half + rank) * slot_bytes + row)
        acc = cute.make_rmem_tensor(8, Float32)
        raw = cute.make_rmem_tensor(POLL_CHUNK * 4, Int32)
        base = Int64(mailbox.iterator.toint())
        slot0 = half * slot_bytes + row
        error_address = Int64(error.iterator.toint())
        failed = self.poll_sum(acc, raw, base, slot0, slot_bytes, budget_ns, error_address)
        if failed == 0:
            result = [pack_bf16x2(acc[2 * j], acc[2 * j + 1]) for j in range(4)]
            protocol.store16(Int64(out.iterator.toint()) + row, result)
            for src in cutlass.range_constexpr(self.tp):
                protocol.rearm(base + slot0 + src * slot_bytes)


def fake_arguments(tp: int, hid: int):
    """Compile-only arguments of ``AllReduceKernel.__call__`` (tokens dynamic)."""
    tokens = cute.sym_int()
    operands = AllReduceOperands(
        fake_tensor(BFloat16, (tokens, hid)),
        fake_tensor(BFloat16, (tokens, hid)),
        fake_tensor(BFloat16, (2, tp, tokens, hid)),
        fake_tensor(Int64, (tp,), align=8),
        Int64(0),
        fake_tensor(Int32, (1,), align=4),
        Int32(0),
        Int32(0),
        Int64(0),
    )
    return operands, cute.runtime.make_fake_stream()


def compiled(tp: int, hid: int, multicast: bool = False, fence: bool = False, arch=None):
    """One compile per (TP, HID, publish path, fence, arch); tokens are dynamic."""

    def build():
        kernel = AllReduceKernel(tp, hid, multicast=multicast, fence=fence)
        return kernel, fake_arguments(tp, hid)

    return compile_cached(("allreduce", tp, hid, multicast, fence), build, arch=arch)
