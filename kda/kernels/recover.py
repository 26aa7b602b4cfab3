"""KdaRecover: commit the accepted tokens of a recorded verify step (``kda.reference.recover``).

One CTA per (request b, head h) in ``kda.kernels.device``'s thread layout reads the checkpoint page
``slots[b, checkpoint[b] - 1]`` into registers; for token t < accepted[b]: decay from the
recorded bf16 raw gate (``kda.kernels.device.decay``), ``k^ = k * rsqrt(sum k^2 + 1e-6)`` from the
recorded k (``(w0 + w2) + (w1 + w3)`` of 32-lane butterflies, as KdaWide), ``S = S * decay``,
``S = fma(k^, v_new, S)`` with the recorded fp32 ``v_new``, stored to ``slots[b, t]`` when
> 0. Rounding: the reference's points; only the fp32 order of ``sum k^2`` differs. Padding
(checkpoint slot <= 0): no load, no store. Tokens t >= accepted[b] apply the neutral update
(``decay = 1``, ``k^ = -0.0``, ``v_new = +0.0``: ``S`` bit for bit) and store nothing, so no
data-dependent control flow; each thread writes back only what it read, so the checkpoint
page may also be a target. PDL: everything is read after ``griddepcontrol.wait``;
dependents are released once the page and the records are loaded. bf16 pages
(``state_dtype``): the checkpoint page widened to fp32 on load, each stored page rounded to
nearest-even once (the tokens are applied in fp32 registers, as the reference's ``recover``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from tpcomm.cuteutil import (
    launch,
    ld_shared_f32x4,
    smem_tensor,
)

from ..operands import RecoverKernelOperands
from . import device as dev
from .device import HEAD_DIM, KCHUNKS, LANES, ROWS, THREADS


class KdaRecover:
    """``heads`` H of the state pool, ``tokens`` T (2..8) recorded per request;
    ``arch``: the target (packed fp32 FMA on sm_100a); ``pdl``: programmatic dependent
    launch; ``state_dtype``: the pages' dtype, "fp32" or "bf16"; ``gate_form``: the decay's
    form (``kda.validate.GATE_FORMS``, compiled in)."""

    def __init__(
        self,
        heads,
        tokens,
        *,
        arch="sm_90a",
        pdl=False,
        state_dtype="fp32",
        gate_form="lower-bound",
    ):
        if not 2 <= tokens <= 8:
            raise ValueError(f"tokens must be in 2..8 (a recorded verify step); got {tokens}")
        if heads < 1:
            raise ValueError(f"heads must be >= 1; got {heads}")
        self.heads, self.tokens = heads, tokens
        self.arch, self.packed, self.pdl = arch, dev.has_packed_fma(arch), pdl
        self.state_bytes = dev.state_bytes(state_dtype)
        self.bf16_state = state_dtype == "bf16"
        self.gate_form, self.softplus_gate = gate_form, dev.softplus_gate(gate_form)

    @cute.jit
    def __call__(self, op: RecoverKernelOperands, stream):
        """Launch on ``stream`` (``op``: ``kda.operands.RecoverKernelOperands``)."""
        requests = op.accepted.shape[0]
        launch(
            self.kernel(op), (self.heads, requests, 1), (THREADS, 1, 1), stream, use_pdl=self.pdl
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def load_page(self, state, head, slot):
        """The thread's 64 values of page ``slot`` into registers as fp32: page[r][c][e]."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        size = self.state_bytes
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        source0 = Int64(state.iterator.toint()) + page * size
        values = []
        for r in cutlass.range_constexpr(ROWS):
            row = []
            for c in cutlass.range_constexpr(KCHUNKS):
                offset = (base_row + 64 * r) * HEAD_DIM + 4 * (lane_in + LANES * c)
                address = source0 + Int64(offset) * size
                row.append(list(dev.ld_global_keys4(address, self.bf16_state)))
            values.append(row)
        return values

    @cute.jit
    def store_page(self, state, head, slot, values):
        """The thread's 64 fp32 into page ``slot`` (the elements ``load_page`` read; a bf16
        page rounded here, once)."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        size = self.state_bytes
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        target0 = Int64(state.iterator.toint()) + page * size
        for r in cutlass.range_constexpr(ROWS):
            for c in cutlass.range_constexpr(KCHUNKS):
                offset = (base_row + 64 * r) * HEAD_DIM + 4 * (lane_in + LANES * c)
                address = target0 + Int64(offset) * size
                dev.st_global_keys4(address, values[r][c], self.bf16_state)

    @cute.jit
    def stage_tokens(self, op, count, shared, request, head):
        """Per token (``dev.stage_records``): k with its per-warp sums of squares; decay
        and v_new. Tokens past ``count`` get the neutral decay 1 and v_new +0."""
        dev.stage_records(
            op,
            head,
            count,
            self.tokens,
            shared,
            lambda t, c: op.kg_records[request, head, t, c],
            lambda t, c: op.v_records[request, head, t, c],
            softplus_gate=self.softplus_gate,
        )

    @cute.jit
    def apply(self, values, shared, slots, state, count, request, head):
        """Per token: S = S * decay; S = fma(k^, v_new, S); store after accepted tokens."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        s_k, s_decay, s_v, _ = shared
        packed = self.packed
        k0, d0 = Int32(s_k.iterator.toint()), Int32(s_decay.iterator.toint())
        for t in cutlass.range_constexpr(self.tokens):
            v_new = [s_v[t, base_row + 64 * r] for r in range(ROWS)]
            for c in cutlass.range_constexpr(KCHUNKS):
                offset = (t * HEAD_DIM + 4 * (lane_in + LANES * c)) * 4
                d4 = ld_shared_f32x4(d0 + offset)
                k4 = ld_shared_f32x4(k0 + offset)
                for r in cutlass.range_constexpr(ROWS):
                    dev.apply_record(values[r][c], d4, k4, v_new[r], packed)
            target = Int32(slots[request, t])
            if (t < count) & (target > 0):
                self.store_page(state, head, target, values)

    @cute.kernel
    def kernel(self, op):
        T = self.tokens
        head, request, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        source = Int32(op.slots[request, Int32(op.checkpoint[request]) - 1])
        if source > 0:
            smem = cutlass.memory.SmemAllocator()
            s_k = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_decay = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_v = smem_tensor(smem, Float32, (T, HEAD_DIM))
            sums = smem_tensor(smem, Float32, (T, 4))
            shared = (s_k, s_decay, s_v, sums)
            count = Int32(op.accepted[request])
            values = self.load_page(op.state, head, source)
            self.stage_tokens(op, count, shared, request, head)
            cute.arch.barrier()
            dev.normalize_rows(s_k, sums, count, self.tokens)
            cute.arch.barrier()
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            self.apply(values, shared, op.slots, op.state, count, request, head)
        elif cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
