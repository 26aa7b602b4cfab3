"""KdaSplit: one (request, head) item per cluster of C = 2, 4 or 8 CTAs; CTA rank i owns
value rows ``[i R, (i + 1) R)`` of the head, R = 128 / C.

Contract: KdaWide's (operands, T = 1..8, record mode, padding, PDL, rounding points). The
raw gate, the decay and the conv outputs are KdaWide's bit for bit; only the fp32 order of
the three per-head sums and of the rows' dot products (butterflies over 2 C lanes) differs.
Every CTA convolves all q and k channels and runs the whole gate (every value row needs all
keys), v only for its rows: the repeated work is why the split pays only for a few items
(``kda.dispatch``, docs/kda_dispatch.md).

Per-head sums (``sum q^2``, ``sum k^2``, ``sum o^2`` per token) cross the cluster through
distributed shared memory (st.async + mbarrier complete_tx, one barrier per exchange,
armed before a cluster barrier): each CTA pushes the pairwise sum of its 16-channel groups
to every CTA, which adds the C partials pairwise in rank order, so every CTA normalises
with identical bits. CTA i writes its rows of the state, v records and outputs, its
channel slice of the conv page and the k record; CTA 0 the raw-gate record. A CTA writes
its conv slice only after the first exchange (each peer pushes after a CTA barrier that
follows its reads of all taps).
"""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm import cuteutil as ptx  # the cluster exchange: push_float, arm/wait_exchange
from tpcomm.cuteutil import (
    cp_async_16,
    launch,
    ld_shared_f32x4,
    smem_tensor,
    st_global_f32x4,
    xor_sum,
)

from . import device as dev
from .device import ACCUMULATORS, HEAD_DIM, THREADS
from .dispatch import CLUSTERS
from .wide import KdaWide

GROUP = 16  # channels per butterfly group of the per-head sums
GROUPS = HEAD_DIM // GROUP


class KdaSplit(KdaWide):
    """KdaWide's configuration (``tokens``, ``record``, ``gate_mode``, ``has_bias``,
    ``arch``, ``pdl``) plus ``cluster``: CTAs per (request, head) item (2, 4 or 8)."""

    def __init__(
        self,
        heads,
        tokens=1,
        record=False,
        gate_mode=3,
        has_bias=False,
        cluster=2,
        *,
        arch="sm_90a",
        pdl=False,
    ):
        super().__init__(heads, tokens, record, gate_mode, has_bias, 0, arch=arch, pdl=pdl)
        if cluster not in CLUSTERS:
            raise ValueError(f"cluster must be one of {CLUSTERS}; got {cluster}")
        self.cluster = cluster
        self.rows = HEAD_DIM // cluster  # value rows per CTA
        self.lanes = THREADS // self.rows  # threads per value row (2 C)
        self.chunks = HEAD_DIM // (4 * self.lanes)  # 16-byte key chunks per thread
        # The same configuration without records: the gate phase of CTAs other than 0.
        self.silent = copy.copy(self)
        self.silent.record = False

    # ------------------------------------------------------------------ host side
    def launch_grid(self, call, requests, stream):
        """One cluster of C CTAs per (head, request) item."""
        launch(
            call,
            (self.heads * self.cluster, requests, 1),
            (THREADS, 1, 1),
            stream,
            cluster=(self.cluster, 1, 1),
            use_pdl=self.pdl,
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def stage_rows(self, state, staged, head, slot, rank):
        """cp.async the CTA's R rows of the page into the thread-private 16-byte slots
        ``staged[c, tid]``."""
        tid, _, _ = cute.arch.thread_idx()
        row, lane_in = tid // self.lanes, tid % self.lanes
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        source0 = Int64(state.iterator.toint()) + page * 4
        shared0 = Int32(staged.iterator.toint())
        for c in cutlass.range_constexpr(self.chunks):
            offset = (rank * self.rows + row) * HEAD_DIM + 4 * (lane_in + self.lanes * c)
            cp_async_16(shared0 + (c * THREADS + tid) * 16, source0 + Int64(offset) * 4)

    @cute.jit
    def load_rows(self, staged):
        """The staged chunks into registers: history[c][e]."""
        tid, _, _ = cute.arch.thread_idx()
        shared0 = Int32(staged.iterator.toint())
        return [
            list(ld_shared_f32x4(shared0 + (c * THREADS + tid) * 16)) for c in range(self.chunks)
        ]

    @cute.jit
    def group_squares(self, values, s_groups, part, limit: cutlass.Constexpr[int]):
        """Per token, the 16-channel butterfly sums of ``values[t]^2`` into
        ``s_groups[t, part, channel // 16]`` for channels below ``limit`` (every lane of
        the calling warps takes part in the shuffles)."""
        tid, _, _ = cute.arch.thread_idx()
        channel = tid % HEAD_DIM
        for t in cutlass.range_constexpr(self.tokens):
            total = xor_sum(values[t] * values[t], GROUP)
            if (channel % GROUP == 0) & (channel < limit):
                s_groups[t, part, channel // GROUP] = total

    @cute.jit
    def push_partials(self, s_groups, parts: cutlass.Constexpr[int], first, groups, exchange, bar):
        """Thread (t, part, peer): the CTA's pairwise sum of its ``groups`` 16-channel
        groups from ``first``, pushed into ``exchange[(t * parts + part) * C + rank]`` of
        CTA ``peer``."""
        tid, _, _ = cute.arch.thread_idx()
        C = self.cluster
        rank = cute.arch.block_idx_in_cluster()
        if tid < self.tokens * parts * C:
            peer, index = tid % C, tid // C
            t, part = index // parts, index % parts
            partial = dev.tree_sum([s_groups[t, part, first + j] for j in range(groups)])
            ptx.push_float(exchange.iterator + index * C + rank, partial, bar, peer)

    @cute.jit
    def cluster_total(self, exchange, index):
        """Pairwise sum of the C partials of ``index`` in rank order."""
        C = self.cluster
        return dev.tree_sum([exchange[index * C + p] for p in range(C)])

    @cute.jit
    def recurrence_rows(self, op, history, shared, s_beta, s_o, slot, request, head, rank):
        """KdaWide's delta rule on the CTA's R rows (one row per thread group of 2 C
        lanes); o (bf16) into ``s_o[t, local row]``; the rows' state stored after token t
        (not in record mode)."""
        slots, state, v_records = op.slots, op.state, op.v_records
        tid, _, _ = cute.arch.thread_idx()
        row, lane_in = tid // self.lanes, tid % self.lanes
        value_row = rank * self.rows + row
        s_q, s_k, s_v, s_decay = shared
        packed = self.packed
        q0, k0 = Int32(s_q.iterator.toint()), Int32(s_k.iterator.toint())
        d0 = Int32(s_decay.iterator.toint())
        state0 = Int64(state.iterator.toint())
        for t in cutlass.range_constexpr(self.tokens):
            chunk_offset = [
                (t * HEAD_DIM + 4 * (lane_in + self.lanes * c)) * 4 for c in range(self.chunks)
            ]
            dots = [Float32(0.0)] * (2 * ACCUMULATORS)
            for c in cutlass.range_constexpr(self.chunks):
                d4 = ld_shared_f32x4(d0 + chunk_offset[c])
                k4 = ld_shared_f32x4(k0 + chunk_offset[c])
                dev.decay_and_dot(history[c], dots, c, d4, k4, packed)
            dot = xor_sum(dev.tree_sum(dots), self.lanes)
            v_new = (s_v[t, row] - dot) * s_beta[t]
            if cutlass.const_expr(self.record):  # noqa: SIM102
                if lane_in == 0:
                    v_records[request, head, t, value_row] = v_new
            outs = [Float32(0.0)] * (2 * ACCUMULATORS)
            for c in cutlass.range_constexpr(self.chunks):
                k4 = ld_shared_f32x4(k0 + chunk_offset[c])
                q4 = ld_shared_f32x4(q0 + chunk_offset[c])
                dev.update_and_out(history[c], outs, c, k4, q4, v_new, packed)
            o = xor_sum(dev.tree_sum(outs), self.lanes)
            if lane_in == 0:
                s_o[t, row] = dev.to_bf16_f32(o)
            if cutlass.const_expr(not self.record):
                target = slot
                if cutlass.const_expr(self.tokens > 1):
                    target = Int32(slots[request, t])
                if target > 0:
                    page = (Int64(target) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
                    for c in cutlass.range_constexpr(self.chunks):
                        offset = value_row * HEAD_DIM + 4 * (lane_in + self.lanes * c)
                        st_global_f32x4(state0 + (page + offset) * 4, history[c])

    @cute.jit
    def write_conv_slice(self, conv_state, conv_slot, head, rank, taps, inputs):
        """The CTA's channels ``[i R, (i + 1) R)`` of q, k and v: window positions
        0..T+1 = [tap1, tap2, x_0 .. x_{T-1}]."""
        tid, _, _ = cute.arch.thread_idx()
        channel, section = tid % HEAD_DIM, tid // HEAD_DIM
        dim = self.heads * HEAD_DIM
        conv_type = conv_state.element_type
        slot = Int64(conv_slot)
        if channel // self.rows == rank:
            ch = section * dim + head * HEAD_DIM + channel
            conv_state[slot, ch, 0] = conv_type(taps[0][1])
            conv_state[slot, ch, 1] = conv_type(taps[0][2])
            for t in cutlass.range_constexpr(self.tokens):
                conv_state[slot, ch, 2 + t] = conv_type(inputs[0][t])
        if tid < self.rows:
            ch = 2 * dim + head * HEAD_DIM + rank * self.rows + tid
            conv_state[slot, ch, 0] = conv_type(taps[1][1])
            conv_state[slot, ch, 1] = conv_type(taps[1][2])
            for t in cutlass.range_constexpr(self.tokens):
                conv_state[slot, ch, 2 + t] = conv_type(inputs[1][t])

    @cute.kernel
    def kernel(self, op):
        T, C, R = self.tokens, self.cluster, self.rows
        tid, _, _ = cute.arch.thread_idx()
        block, request, _ = cute.arch.block_idx()
        head = block // C
        rank = cute.arch.block_idx_in_cluster()
        lane, warp = tid % 32, tid // 32
        channel, section = tid % HEAD_DIM, tid // HEAD_DIM
        dim = self.heads * HEAD_DIM
        token = request * T
        own_row = rank * R + tid % R  # the v row / output row of threads tid < R
        slot, conv_slot, offset = self.item_slots(op.slots, op.accepted, request)
        if slot <= 0:
            cute.arch.griddepcontrol_wait()
            if tid < R:
                for t in cutlass.range_constexpr(T):
                    op.output[token + t, head * HEAD_DIM + own_row] = BFloat16(0.0)
            cute.arch.griddepcontrol_launch_dependents()
        else:
            smem = cutlass.memory.SmemAllocator()
            bars = smem.allocate_array(Int64, 2, byte_alignment=8)
            staged = smem_tensor(smem, Float32, (self.chunks, THREADS, 4), align=128)
            s_q = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_k = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_v = smem_tensor(smem, Float32, (T, R))
            s_o = smem_tensor(smem, Float32, (T, R))
            s_decay = smem_tensor(smem, Float32, (8, HEAD_DIM))
            s_beta = smem_tensor(smem, Float32, (8,))
            fas = smem_tensor(smem, BFloat16, (T, HEAD_DIM), align=16)
            qk_groups = smem_tensor(smem, Float32, (T, 2, GROUPS))
            o_groups = smem_tensor(smem, Float32, (T, 1, R // GROUP))
            qk_exchange = smem_tensor(smem, Float32, (T * 2 * C,))
            o_exchange = smem_tensor(smem, Float32, (T * C,))

            # Exchange barriers armed, then a cluster barrier before anyone pushes.
            ptx.arm_exchanges(bars, (4 * T * 2 * C, 4 * T * C))
            cute.arch.cluster_arrive()

            # Predecessor-independent: the state rows (cp.async), conv windows, weights.
            self.stage_rows(op.state, staged, head, slot, rank)
            cute.arch.cp_async_commit_group()
            columns = (
                section * dim + head * HEAD_DIM + channel,
                2 * dim + head * HEAD_DIM + own_row,
            )
            weight_columns = (head * HEAD_DIM + channel, head * HEAD_DIM + own_row)
            taps, coeff, bias = self.conv_operands(
                op.conv_state, op.conv_weight, op.conv_bias, conv_slot, offset, columns,
                (section, 2), weight_columns,
            )  # fmt: skip
            nw = Float32(op.norm_weight[own_row])
            a, dt, weights = self.gate_operands(op, head, warp, lane)
            exact_gate = self.gate_mode == 2
            inputs, activations = self.read_inputs(op, s_beta, fas, columns, token, head)

            # q (section 0) or k (section 1) of all 128 channels; v of the CTA's R rows.
            qk = self.convolve(taps[0], coeff[0], bias[0], inputs[0])
            values = self.convolve(taps[1], coeff[1], bias[1], inputs[1])
            self.group_squares(qk, qk_groups, section, HEAD_DIM)
            if tid < R:
                for t in cutlass.range_constexpr(T):
                    s_v[t, tid] = values[t]
            if cutlass.const_expr(self.record):  # noqa: SIM102
                if (section == 1) & (channel // R == rank):
                    for t in cutlass.range_constexpr(T):
                        op.kg_records[request, head, t, channel] = BFloat16(qk[t])

            if cutlass.const_expr(exact_gate):
                cute.arch.barrier()  # the f_a rows
                if rank == 0:
                    self.gate_phase_exact(op, fas, s_decay, request, head)
                else:
                    self.silent.gate_phase_exact(op, fas, s_decay, request, head)
            elif rank == 0:
                self.gate_phase(op, weights, activations, a, dt, s_decay, request, head)
            else:
                self.silent.gate_phase(op, weights, activations, a, dt, s_decay, request, head)
            cute.arch.barrier()  # the squares' groups, s_v, s_decay

            # sum q^2, sum k^2 across the cluster.
            cute.arch.cluster_wait()
            self.push_partials(qk_groups, 2, rank * (GROUPS // C), GROUPS // C, qk_exchange, bars)
            ptx.wait_exchange(bars)
            # Every peer pushed after a CTA barrier that follows its reads of all q and k
            # taps: only now may this CTA overwrite its slice of the conv page.
            self.write_conv_slice(op.conv_state, conv_slot, head, rank, taps, inputs)
            for t in cutlass.range_constexpr(T):
                factor = dev.rsqrt_f32(self.cluster_total(qk_exchange, t * 2 + section) + 1.0e-6)
                if section == 0:
                    s_q[t, channel] = (qk[t] * factor) * op.scale
                else:
                    s_k[t, channel] = qk[t] * factor
            cute.arch.barrier()

            cute.arch.cp_async_wait_group(0)
            history = self.load_rows(staged)
            self.recurrence_rows(
                op, history, (s_q, s_k, s_v, s_decay), s_beta, s_o, slot, request, head, rank
            )
            cute.arch.barrier()

            # sum o^2 across the cluster, then the gated RMSNorm of the CTA's rows.
            if tid < max(R, 32):  # whole warps: the butterflies shuffle over 32 lanes
                self.group_squares([s_o[t, tid % R] for t in range(T)], o_groups, 0, R)
            cute.arch.barrier()
            self.push_partials(o_groups, 1, 0, R // GROUP, o_exchange, bars + 1)
            if tid < R:
                ptx.wait_exchange(bars + 1)
                for t in cutlass.range_constexpr(T):
                    sumsq = self.cluster_total(o_exchange, t)
                    rstd = dev.rsqrt_f32(sumsq * (1.0 / HEAD_DIM) + op.eps)
                    column = head * HEAD_DIM + own_row
                    g = Float32(op.gate[token + t, column])
                    result = ((s_o[t, tid] * rstd) * nw) * dev.sigmoid(g)
                    op.output[token + t, column] = BFloat16(result)
