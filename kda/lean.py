"""KdaLean: the state-streaming recurrence of ``kda.decode(..., kernel="lean")``, the
second of its two launches (KdaPrepare, ``kda.prepass``, writes the per-item vectors).

Persistent CTAs (``ctas``; ``dispatch.lean_ctas_per_sm``: 2 per SM, 128 registers; 3
fit in shared memory at T = 1 but cap registers at 80, where ptxas spills) each walk a
contiguous range of (request, head) items. Per item and per value row of the thread (r,
then r + 64: rows are independent, so each element sees Wide's operations in Wide's
order, with 32 state registers live instead of 64): the row's page slots (staged into
thread-private 16-byte slots by cp.async during the previous item, as KdaStream does) go
to registers, the next item's slots of that row (and, with row 0, its scratch vectors:
q^, k^, v, decay, sigmoid(gate), sigmoid(beta) in the ``kda.prepass`` layout,
double-buffered by item parity) start streaming in, then KdaWide's ``recurrence_rows``
runs (state, o and v records bitwise Wide's), then the gated RMSNorm
with Wide's expression ``((o * rstd) * gamma) * sigmoid(gate)`` (the sigmoid computed
by the prepass with Wide's function). State out after each token (slots and accepted as
Wide), record mode (``v_records`` here; ``kg_records`` by the prepass). Padding items
(state slot <= 0) write zero output rows only.

Barriers per item: one (the staged page and vectors visible) before the recurrence, one
(o) after it, one among the 128 output threads (the o^2 warp sums). The page slots are
thread-private (each thread reads back exactly the 16-byte slots it copied), so the next
page is issued right after this item's page is in registers, without a barrier.

PDL: launched as a programmatic dependent of KdaPrepare: the first item's state page is
staged before ``griddepcontrol.wait`` (the prepass writes no state page; with ``pdl`` the
kernel before the prepass must not write them either), the scratch after it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm.cuteutil import cp_async_16, launch, smem_tensor

from .device import HEAD_DIM, KCHUNKS, LANES, ROWS, THREADS
from .dispatch import lean_ctas_per_sm
from .prepass import SCRATCH_BETA, SCRATCH_FIELDS, SCRATCH_WIDTH
from .wide import KdaWide

GRANULE = 16  # bytes per cp.async
FIELD_GRANULES = HEAD_DIM * 4 // GRANULE  # 32 per 128-wide fp32 field
ROW_GRANULES = SCRATCH_FIELDS * FIELD_GRANULES + 1  # + the beta granule


# Immediate-offset forms of tpcomm.cuteutil's accesses: one base register per thread and
# the chunk's offset in the instruction, so no per-chunk address stays live (or gets
# hoisted out of the item loop) across the recurrence.


def ld_shared_f32x4_at(shared: Int32, offset: int):
    """Weak 16-byte shared load of four fp32 at ``shared + offset``."""
    return cute.arch.inline_ptx(
        "ld.shared.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}+" + str(int(offset)) + "];",
        write_only_types=[Float32] * 4,
        read_only_args=[shared],
    )


def st_global_f32x4_at(address: Int64, offset: int, values):
    """Weak 16-byte global store of four fp32 at ``address + offset``."""
    cute.arch.inline_ptx(
        "st.global.v4.f32 [{$r0}+" + str(int(offset)) + "], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[address, *values],
    )


def cp_async_16_at(shared: Int32, shared_offset: int, source: Int64, source_offset: int):
    """16-byte ``cp.async.cg`` (L2 only) from ``source + source_offset`` to ``shared +
    shared_offset``; visible after commit + wait_group by the issuing thread."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}+"
        + str(int(shared_offset))
        + "], [{$r1}+"
        + str(int(source_offset))
        + "], 16;",
        read_only_args=[shared, source],
    )


class KdaLean(KdaWide):
    """``heads``, ``tokens`` T (1..8), ``record`` (T > 1), ``ctas`` persistent CTAs,
    ``ctas_per_sm`` (None: ``dispatch.lean_ctas_per_sm``; sets the register cap),
    ``arch``; ``pdl``: launch as a programmatic dependent (of KdaPrepare)."""

    def __init__(self, heads, tokens, record, ctas, *, ctas_per_sm=None, arch="sm_90a", pdl=True):
        super().__init__(heads, tokens, record, 0, False, 0, arch=arch, pdl=pdl)
        if ctas < 1:
            raise ValueError(f"ctas must be >= 1; got {ctas}")
        if ctas_per_sm is None:
            ctas_per_sm = lean_ctas_per_sm(tokens)
        if ctas_per_sm not in (1, 2, 3):
            raise ValueError(f"ctas_per_sm must be 1, 2 or 3; got {ctas_per_sm}")
        self.ctas, self.ctas_per_sm = ctas, ctas_per_sm

    @cute.jit
    def __call__(
        self,
        slots: cute.Tensor,
        accepted: cute.Tensor,
        state: cute.Tensor,
        output: cute.Tensor,
        norm_weight: cute.Tensor,
        eps: Float32,
        v_records: cute.Tensor,
        scratch: cute.Tensor,
        stream,
    ):
        call = self.kernel(slots, accepted, state, output, norm_weight, eps, v_records, scratch)
        launch(
            call,
            (self.ctas, 1, 1),
            (THREADS, 1, 1),
            stream,
            use_pdl=self.pdl,
            min_blocks_per_mp=self.ctas_per_sm,
            carveout=100,
        )

    def load_chunk(self, base, chunk_offset, t, c):
        """KdaWide.load_chunk at ``base + 16 * lane`` + an immediate (same address)."""
        tid, _, _ = cute.arch.thread_idx()
        return ld_shared_f32x4_at(base + (tid % LANES) * 16, (t * HEAD_DIM + 4 * LANES * c) * 4)

    @cute.jit
    def store_state_rows(self, state0, page, rows, history):
        """KdaWide.store_state_rows from one row base + immediates (same addresses)."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        row0 = state0 + (page + base_row * HEAD_DIM + 4 * lane_in) * 4
        for i, r in enumerate(rows):
            for c in cutlass.range_constexpr(KCHUNKS):
                offset = (64 * r * HEAD_DIM + 4 * LANES * c) * 4
                st_global_f32x4_at(row0, offset, history[i][c])

    @cute.jit
    def stage_state_rows(self, state, staged, head, slot, rows):
        """KdaWide.stage_state_rows (the same slots) with immediate offsets."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        source = Int64(state.iterator.toint()) + (page + base_row * HEAD_DIM + 4 * lane_in) * 4
        shared = Int32(staged.iterator.toint()) + tid * 16
        for r in rows:
            for c in cutlass.range_constexpr(KCHUNKS):
                shared_offset = (r * KCHUNKS + c) * THREADS * 16
                cp_async_16_at(
                    shared, shared_offset, source, (64 * r * HEAD_DIM + 4 * LANES * c) * 4
                )

    @cute.jit
    def load_history_rows(self, staged, rows):
        """KdaWide.load_history_rows (the same slots) with immediate offsets."""
        tid, _, _ = cute.arch.thread_idx()
        shared = Int32(staged.iterator.toint()) + tid * 16
        history = []
        for r in rows:
            row = []
            for c in cutlass.range_constexpr(KCHUNKS):
                row.append(list(ld_shared_f32x4_at(shared, (r * KCHUNKS + c) * THREADS * 16)))
            history.append(row)
        return history

    @cute.jit
    def stage_vectors(self, scratch, vecs, betas, head, request, parity):
        """cp.async the item's scratch rows: field f of token t to ``vecs[parity, f, t, :]``,
        the beta granule to ``betas[parity, t, :]``."""
        tid, _, _ = cute.arch.thread_idx()
        T = self.tokens
        total = T * ROW_GRANULES
        scratch0 = Int64(scratch.iterator.toint())
        vecs0, betas0 = Int32(vecs.iterator.toint()), Int32(betas.iterator.toint())
        for j in cutlass.range_constexpr((total + THREADS - 1) // THREADS):
            g = tid + THREADS * j
            if g < total:
                t, k = g // ROW_GRANULES, g % ROW_GRANULES
                row = Int64((request * T + t) * self.heads + head) * SCRATCH_WIDTH
                if k < SCRATCH_FIELDS * FIELD_GRANULES:
                    field, q = k // FIELD_GRANULES, k % FIELD_GRANULES
                    source = scratch0 + (row + field * HEAD_DIM + 4 * q) * 4
                    shared = vecs0 + (((parity * SCRATCH_FIELDS + field) * T + t) * HEAD_DIM) * 4
                    cp_async_16(shared + q * GRANULE, source)
                else:
                    source = scratch0 + (row + SCRATCH_BETA) * 4
                    cp_async_16(betas0 + (parity * T + t) * GRANULE, source)

    @cute.jit
    def stage_next(self, slots, accepted, state, scratch, buffers, item, parity, rows, vectors):
        """Stage item ``item``: the page slots of the thread's value rows ``rows`` and, with
        ``vectors``, its scratch vectors into ``parity``; nothing for a padding item."""
        staged, vecs, betas = buffers
        head, request = item % self.heads, item // self.heads
        slot, _, _ = self.item_slots(slots, accepted, request)
        if slot > 0:
            self.stage_state_rows(state, staged, head, slot, rows)
            if cutlass.const_expr(vectors):
                self.stage_vectors(scratch, vecs, betas, head, request, parity)

    def output_gate(self, s_gate, token, t, head, channel):
        """sigmoid(gate) as the prepass stored it: ``write_output`` reads ``s_gate[t]``."""
        return s_gate[t, channel]

    @cute.kernel
    def kernel(
        self,
        slots: cute.Tensor,
        accepted: cute.Tensor,
        state: cute.Tensor,
        output: cute.Tensor,
        norm_weight: cute.Tensor,
        eps: Float32,
        v_records: cute.Tensor,
        scratch: cute.Tensor,
    ):
        T, H = self.tokens, self.heads
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        channel, section = tid % 128, tid // 128
        requests = output.shape[0] // T
        total = H * requests
        first = (cta * total) // self.ctas
        count = ((cta + 1) * total) // self.ctas - first

        smem = cutlass.memory.SmemAllocator()
        staged = smem_tensor(smem, Float32, (ROWS * KCHUNKS, THREADS, 4), align=128)
        vecs = smem_tensor(smem, Float32, (2, SCRATCH_FIELDS, T, HEAD_DIM), align=16)
        betas = smem_tensor(smem, Float32, (2, T, 4), align=16)
        s_o = smem_tensor(smem, Float32, (T, HEAD_DIM))
        out_sums = smem_tensor(smem, Float32, (T, 4))
        buffers = (staged, vecs, betas)
        nw = Float32(norm_weight[channel])
        field_layout = cute.make_layout((T, HEAD_DIM), stride=(HEAD_DIM, 1))

        # Prologue: the first item's page (predecessor-independent), then its vectors.
        if count > 0:
            request0 = first // H
            slot0, _, _ = self.item_slots(slots, accepted, request0)
            if slot0 > 0:
                self.stage_state(state, staged, first % H, slot0)
        cute.arch.griddepcontrol_wait()
        if count > 0:
            request0 = first // H
            slot0, _, _ = self.item_slots(slots, accepted, request0)
            if slot0 > 0:
                self.stage_vectors(scratch, vecs, betas, first % H, request0, 0)
        cute.arch.cp_async_commit_group()
        cute.arch.griddepcontrol_launch_dependents()

        for i in cutlass.range(count, unroll=1):
            item = first + i
            head, request = item % H, item // H
            token = request * T
            parity = i % 2
            has_next = i + 1 < count
            slot, _, _ = self.item_slots(slots, accepted, request)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # this item's vectors (all threads' copies) visible
            if slot <= 0:
                if tid < HEAD_DIM:
                    for t in cutlass.range_constexpr(T):
                        output[token + t, head * HEAD_DIM + tid] = BFloat16(0.0)
                if has_next:
                    self.stage_next(
                        slots, accepted, state, scratch, buffers, item + 1, 1 - parity,
                        tuple(range(ROWS)), True,
                    )  # fmt: skip
                cute.arch.cp_async_commit_group()
            else:
                base = (parity * SCRATCH_FIELDS) * T * HEAD_DIM
                fields = [
                    cute.make_tensor(vecs.iterator + base + f * T * HEAD_DIM, field_layout)
                    for f in range(SCRATCH_FIELDS)
                ]
                s_beta = cute.make_tensor(
                    betas.iterator + parity * T * 4, cute.make_layout((T,), stride=(4,))
                )
                # One value row at a time (32 state registers, not 64): as soon as a row's
                # page slots are in registers, item n + 1's slots of that row stream in
                # (thread-private slots: no barrier); its vectors go to the other parity,
                # last read by item n - 1, before the barrier above.
                for r in cutlass.range_constexpr(ROWS):
                    history = self.load_history_rows(staged, (r,))
                    if has_next:
                        self.stage_next(
                            slots, accepted, state, scratch, buffers, item + 1, 1 - parity,
                            (r,), r == 0,
                        )  # fmt: skip
                    cute.arch.cp_async_commit_group()
                    self.recurrence_rows(
                        history,
                        (r,),
                        (fields[0], fields[1], fields[2], fields[3]),
                        s_beta,
                        s_o,
                        slots,
                        state,
                        slot,
                        request,
                        head,
                        v_records,
                    )
                cute.arch.barrier()  # o
                if section == 0:
                    self.norm_sums(s_o, out_sums)
                    cute.arch.barrier(barrier_id=1, number_of_threads=HEAD_DIM)  # o^2 sums
                    self.write_output(s_o, out_sums, fields[4], nw, eps, output, token, head)
