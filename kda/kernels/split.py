"""KdaSplit: one (request, head) item per cluster of C = 2, 4 or 8 CTAs; CTA rank i owns
value rows ``[i R, (i + 1) R)`` of the head, R = 128 / C.

Contract: KdaWide's (operands, T = 1..8, record mode, padding, PDL, rounding points). The
raw gate, the decay and the conv outputs are KdaWide's bit for bit; only the fp32 order of
the three per-head sums and of the rows' dot products (butterflies over 2 C lanes) differs.

The per-item prologue is done once per cluster: CTA i convolves q, k and v of its R
channels (threads 0 .. 3R - 1) and computes the raw gate and decay of its R features (the
last R / 16 warps, one 16-feature mma.sync tile each; gate mode 3 settles undecided raw
gates with ``dev.settle_gate``, re-reading their f_a and f_b rows, four per round where
KdaWide takes one at a time); it pushes its q, k (SiLU outputs, before the norm) and decays
into ``s_q``, ``s_k``, ``s_decay`` of every CTA of the cluster, itself included (st.async +
mbarrier complete_tx; the barrier is armed before a cluster barrier that every CTA passes
before pushing). Each CTA then forms ``sum q^2``, ``sum k^2`` of all 128 channels itself:
16-channel butterflies, then the pairwise tree over the eight groups (the order the partial
exchange used to give, so every CTA normalises with identical bits). ``sum o^2`` crosses
the cluster as partials (each CTA pushes the pairwise sum of its 16-channel groups; the C
partials are added pairwise in rank order). CTA i writes its rows of the state, v records
and outputs, its channels of the conv page, the k record and the raw-gate record of its
features. The state rows are staged by cp.async first; the output gate is read with the
step's other inputs, after ``griddepcontrol.wait``. bf16 state pages as KdaWide's: half
the cp.asyncs (a row's adjacent threads share a 16-byte copy), widened when read into
registers, rounded to nearest-even once per stored page.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm import cuteutil as ptx  # the cluster exchange: push_float, arm/wait_exchange
from tpcomm.cuteutil import (
    cp_async_16,
    launch,
    smem_tensor,
    xor_sum,
)

from ..dispatch import CLUSTERS
from . import device as dev
from .device import HEAD_DIM, THREADS
from .wide import KdaWide

GROUP = 16  # channels per butterfly group of the per-head sums
GROUPS = HEAD_DIM // GROUP


class KdaSplit(KdaWide):
    """KdaWide's configuration (``tokens``, ``record``, ``gate_mode``, ``has_bias``,
    ``arch``, ``pdl``) plus ``cluster``: CTAs per (request, head) item (2, 4 or 8)."""

    settle_batch = 4  # gate mode 3: four undecided raw gates per round (faster here)

    def __init__(self, heads, tokens=1, record=False, gate_mode=3, has_bias=False, cluster=2, **kw):
        # arch, pdl, state_dtype, gate_form
        super().__init__(heads, tokens, record, gate_mode, has_bias, 0, **kw)
        if cluster not in CLUSTERS:
            raise ValueError(f"cluster must be one of {CLUSTERS}; got {cluster}")
        self.cluster = cluster
        self.rows = HEAD_DIM // cluster  # value rows per CTA
        self.lanes = THREADS // self.rows  # threads per value row (2 C)
        self.chunks = HEAD_DIM // (4 * self.lanes)  # 16-byte key chunks per thread

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
        """cp.async the CTA's R rows of the page into the thread-private slots
        ``staged[c, tid]`` (16 bytes fp32; bf16: 8, thread 2p + s copying the 16 bytes of
        threads 2p and 2p + 1 for the chunks c = s mod 2, as KdaWide's ``stage_state``)."""
        tid, _, _ = cute.arch.thread_idx()
        row, lane_in = tid // self.lanes, tid % self.lanes
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        source0 = Int64(state.iterator.toint()) + page * self.state_bytes
        shared0 = Int32(staged.iterator.toint())
        if cutlass.const_expr(self.bf16_state):
            s = lane_in % 2
            for c2 in cutlass.range_constexpr(self.chunks // 2):
                c = 2 * c2 + s
                offset = (rank * self.rows + row) * HEAD_DIM + 4 * (lane_in - s + self.lanes * c)
                cp_async_16(shared0 + (c * THREADS + tid - s) * 8, source0 + Int64(offset) * 2)
        else:
            for c in cutlass.range_constexpr(self.chunks):
                offset = (rank * self.rows + row) * HEAD_DIM + 4 * (lane_in + self.lanes * c)
                cp_async_16(shared0 + (c * THREADS + tid) * 16, source0 + Int64(offset) * 4)

    @cute.jit
    def load_rows(self, staged):
        """The staged chunks into registers (a bf16 page widened): history[c][e]."""
        tid, _, _ = cute.arch.thread_idx()
        shared0 = Int32(staged.iterator.toint())
        size = 4 * self.chunk_words
        return [
            list(dev.ld_shared_keys4(shared0 + (c * THREADS + tid) * size, self.bf16_state))
            for c in range(self.chunks)
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
        """``dev.delta_rule`` on the CTA's R rows (one row per thread group of 2 C lanes);
        o (bf16) into ``s_o[t, local row]``; the rows' state stored after token t (not in
        record mode)."""
        tid, _, _ = cute.arch.thread_idx()
        row, lane_in = tid // self.lanes, tid % self.lanes
        value_row = rank * self.rows + row
        dev.delta_rule(
            [history],
            shared,
            s_beta,
            s_o,
            op.state,
            lane_in,
            self.lanes,
            lambda i: row,
            self.tokens,
            self.packed,
            write_v=self.v_writer(op.v_records, request, head, lane_in, value_row),
            target=self.state_target(op.slots, slot, request),
            store=lambda state0, target: self.store_token(state0, target, head, history),
            beta_first=False,
        )

    @cute.jit
    def store_state(self, state0, page, history):
        """The thread's chunks of its value row to page ``page``."""
        tid, _, _ = cute.arch.thread_idx()
        row, lane_in = tid // self.lanes, tid % self.lanes
        value_row = cute.arch.block_idx_in_cluster() * self.rows + row
        for c in cutlass.range_constexpr(self.chunks):
            offset = value_row * HEAD_DIM + 4 * (lane_in + self.lanes * c)
            address = state0 + (page + offset) * self.state_bytes
            dev.st_global_keys4(address, history[c], self.bf16_state)

    @cute.jit
    def write_conv_channel(self, conv_state, conv_slot, column, taps, inputs):
        """Window positions 0..T+1 = [tap1, tap2, x_0 .. x_{T-1}] of one channel (only this
        CTA reads its taps: written right after the convolution)."""
        conv_type = conv_state.element_type
        slot = Int64(conv_slot)
        conv_state[slot, column, 0] = conv_type(taps[1])
        conv_state[slot, column, 1] = conv_type(taps[2])
        for t in cutlass.range_constexpr(self.tokens):
            conv_state[slot, column, 2 + t] = conv_type(inputs[t])

    @cute.jit
    def push_all(self, target, value, bars):
        """st.async one fp32 to the same shared address in every CTA of the cluster."""
        for peer in cutlass.range_constexpr(self.cluster):
            ptx.push_float(target, value, bars, peer)

    @cute.jit
    def gate_tile(
        self, op, weights, activations, a, dt, s_gate, s_decay, bars, request, head, tile
    ):
        """KdaWide.gate_phase on one 16-feature tile: raw gate (mode 3: settled exactly
        where undecided), decays into ``s_gate[t, local feature]``, the raw-gate record;
        then each lane pushes its decays of tokens < T into every CTA's ``s_decay``."""
        lane = cute.arch.lane_idx()
        group, quarter = lane // 4, lane % 4
        first = 16 * (tile % (self.rows // 16))  # the tile's first local feature
        acc, bound = self.project_gate(weights, activations)
        for e in cutlass.range_constexpr(4):
            t = 2 * quarter + e % 2
            raw_g = dev.to_bf16_f32(acc[e])
            local = first + group + 8 * (e // 2)
            s_gate[t, local] = dev.decay(a, raw_g, dt[e // 2], op.lower_bound, self.softplus_gate)
            if cutlass.const_expr(self.record):  # noqa: SIM102
                if t < self.tokens:
                    feature = 16 * tile + group + 8 * (e // 2)
                    op.kg_records[request, head, t, HEAD_DIM + feature] = BFloat16(raw_g)
        if cutlass.const_expr(self.gate_mode == 3):
            where = self.settling(s_gate, first, tile, request, head)
            dev.settle_gate(op, acc, bound, a, dt, where)
        # each lane reads back only what it wrote itself
        for e in cutlass.range_constexpr(4):
            t = 2 * quarter + e % 2
            if t < self.tokens:
                local = first + group + 8 * (e // 2)
                target = s_decay.iterator + (t * HEAD_DIM + 16 * tile + group + 8 * (e // 2))
                self.push_all(target, s_gate[t, local], bars)

    @cute.jit
    def normalize_cluster(self, s_q, s_k, qk_pairs, scale):
        """After the exchange: ``sum q^2``, ``sum k^2`` of the 128 channels (16-lane
        butterflies, pairs of groups, then ``(p0 + p1) + (p2 + p3)``: the pairwise tree over
        the eight groups) and q^ = q rsqrt(sum + 1e-6) scale, k^ = k rsqrt(sum + 1e-6)."""
        tid, _, _ = cute.arch.thread_idx()
        lane, warp, channel, section = dev.thread_layout(tid)
        qk = []
        for t in cutlass.range_constexpr(self.tokens):
            value = Float32(cutlass.select_(section == 0, s_q[t, channel], s_k[t, channel]))
            qk.append(value)
            group = xor_sum(value * value, GROUP)
            pair = group + cute.arch.shuffle_sync_bfly(group, offset=GROUP)
            if lane == 0:
                qk_pairs[t, section, warp % 4] = pair
        cute.arch.barrier()
        for t in cutlass.range_constexpr(self.tokens):
            total = dev.tree_sum([qk_pairs[t, section, w] for w in range(4)])
            factor = dev.rsqrt_f32(total + 1.0e-6)
            if section == 0:
                s_q[t, channel] = (qk[t] * factor) * scale
            else:
                s_k[t, channel] = qk[t] * factor

    @cute.kernel
    def kernel(self, op):
        T, C, R = self.tokens, self.cluster, self.rows
        tiles = R // 16  # gate tiles (warps) per CTA
        tid, _, _ = cute.arch.thread_idx()
        block, request, _ = cute.arch.block_idx()
        head = block // C
        rank = cute.arch.block_idx_in_cluster()
        lane, warp = tid % 32, tid // 32
        dim = self.heads * HEAD_DIM
        token = request * T
        own_row = rank * R + tid % R  # the v row / output row of threads tid < R
        slot, conv_slot, offset = self.item_slots(op.slots, op.accepted, request)
        if slot <= 0:
            self.write_padding(op.output, token, head, tid, own_row, R)
        else:
            smem = cutlass.memory.SmemAllocator()
            bars = smem.allocate_array(Int64, 2, byte_alignment=8)
            staged = smem_tensor(smem, Float32, (self.chunks, THREADS, self.chunk_words), align=128)
            s_q = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_k = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_decay = smem_tensor(smem, Float32, (T, HEAD_DIM))
            s_v = smem_tensor(smem, Float32, (T, R))
            s_o = smem_tensor(smem, Float32, (T, R))
            s_gate = smem_tensor(smem, Float32, (8, R))  # the gate lanes' decays, 8 tokens
            s_beta = smem_tensor(smem, Float32, (8,))
            smem_tensor(smem, BFloat16, (T, HEAD_DIM), align=16)  # unused (was gate mode 2's)
            qk_pairs = smem_tensor(smem, Float32, (T, 2, 4))
            o_groups = smem_tensor(smem, Float32, (T, 1, R // GROUP))
            o_exchange = smem_tensor(smem, Float32, (T * C,))

            # Exchange barriers armed, then a cluster barrier before anyone pushes.
            ptx.arm_exchanges(bars, (4 * 3 * HEAD_DIM * T, 4 * T * C))
            cute.arch.cluster_arrive()

            # Predecessor-independent: the state rows (cp.async) first, then the conv
            # window and weights of the thread's channel (part q / k / v of channel
            # rank R + local; threads past 3R repeat thread 3R - 1's addresses: one
            # broadcast per warp) and the gate tile's f_b fragments.
            self.stage_rows(op.state, staged, head, slot, rank)
            cute.arch.cp_async_commit_group()
            conv = cutlass.min(tid, 3 * R - 1)
            part, local = conv // R, conv % R
            channel = rank * R + local
            column = part * dim + head * HEAD_DIM + channel
            taps = [op.conv_state[Int64(conv_slot), column, offset + j] for j in range(3)]
            coeff = [Float32(op.conv_weight[part, i, head * HEAD_DIM + channel]) for i in range(4)]
            bias = Float32(op.conv_bias[column]) if self.has_bias else Float32(0.0)
            nw = Float32(op.norm_weight[own_row])
            tile = rank * tiles + warp % tiles
            a = Float32(op.a_log[head])
            dt = [
                Float32(op.dt_bias[head * HEAD_DIM + 16 * tile + lane // 4 + 8 * i])
                for i in range(2)
            ]
            weights = self.load_gate_weights(op.f_b, head, tile, cute.arch.lane_idx())

            # The step's inputs (written by the kernel before): x, beta, f_a, output gate.
            cute.arch.griddepcontrol_wait()
            inputs = [op.x[token + t, column] for t in range(T)]
            self.load_beta(op.beta, s_beta, token, head)
            activations = self.load_activations(op.f_a, token)
            gates = [op.gate[token + t, head * HEAD_DIM + own_row] for t in range(T)]
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.cluster_wait()  # every peer's barriers are armed

            # q, k, v of the CTA's R channels; q and k pushed to every CTA, v kept.
            if tid < 3 * R:
                values = self.convolve(taps, coeff, bias, inputs)
                self.write_conv_channel(op.conv_state, conv_slot, column, taps, inputs)
                if part == 2:
                    for t in cutlass.range_constexpr(T):
                        s_v[t, local] = values[t]
                elif part == 0:
                    for t in cutlass.range_constexpr(T):
                        self.push_all(s_q.iterator + (t * HEAD_DIM + channel), values[t], bars)
                else:
                    for t in cutlass.range_constexpr(T):
                        self.push_all(s_k.iterator + (t * HEAD_DIM + channel), values[t], bars)
                        if cutlass.const_expr(self.record):
                            op.kg_records[request, head, t, channel] = BFloat16(values[t])
            # the raw gate and decays of the CTA's R features, pushed to every CTA
            if warp >= 8 - tiles:
                self.gate_tile(
                    op, weights, activations, a, dt, s_gate, s_decay, bars, request, head, tile
                )
            out_gates = [dev.sigmoid(Float32(g)) for g in gates]

            ptx.wait_exchange(bars)  # all of q, k and the decays, from every CTA
            self.normalize_cluster(s_q, s_k, qk_pairs, op.scale)
            if cutlass.const_expr(self.bf16_state):  # a pair's copies: seen after the barrier
                cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # q^, k^, s_v, s_beta

            if cutlass.const_expr(not self.bf16_state):
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
                    result = ((s_o[t, tid] * rstd) * nw) * out_gates[t]
                    op.output[token + t, column] = BFloat16(result)
