"""KdaWide: one CTA per (request, head) item; the head's fp32 state lives in registers.

Operands: ``KernelOperands`` (``conv_state`` as the ``[S, 3D, W]`` view; dummies for an
absent bias, ``accepted`` or records). Padding: a request whose state slot (``slots[b]``,
or ``slots[b, accepted[b] - 1]`` for T > 1) is <= 0 gets zero output rows and touches
nothing else. Rounding: bf16 after the SiLU, on the raw gate and on ``o``; all else fp32
(``kda.kernels.device``). PDL: the state page, conv window and weights are read before
``griddepcontrol.wait`` (the kernel right before must not write them), x, gate, f_a and
beta after it; dependents are released once those are read (gate mode 3 may re-read f_a
rows later: a dependent writes f_a only after its own wait, as any PDL kernel must).

State pages (``state_dtype``, compile time): fp32, or bf16 widened to fp32 as the staged
page is read into registers and rounded to nearest-even once per stored page
(``cvt.rn.bf16x2.f32``): the reference's one rounding (docs/contract.md). A bf16 page is
staged in half the shared memory by half the cp.asyncs: 16 bytes hold the 8-byte key
chunks of a row's two adjacent threads, each copied by one of the pair and read by its
owner after a barrier.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm.cuteutil import (
    cp_async_16,
    launch,
    ld_global_nc_b32x2,
    ld_shared_f32x4,
    prefetch_l2_bulk,
    smem_tensor,
    warp_sum,
)

from ..operands import KernelOperands
from . import device as dev
from .device import CTAS_PER_SM, HEAD_DIM, KCHUNKS, LANES, ROWS, THREADS

STATE_PAGE_BYTES = HEAD_DIM * HEAD_DIM * 4


class KdaWide:
    """``tokens`` T (1: decode with slots [B]; 2..8: verify with slots [B, >= T] and
    accepted [B]); ``record``: RecoverSSM verify (state read from the checkpoint slot,
    not written; records out); ``gate_mode``: the raw gate's reduction (0: mma.sync, one
    chain of eight; 1: mma.sync, four chains of two; 3: mode 0's chain with an error bound,
    and the exact dot only where the bound straddles a bf16 rounding: bitwise the
    reference's raw gate); ``ahead``: L2-prefetch the state page
    of the item that many CTAs on (0: off); ``arch``: the target (packed fp32 FMA on sm_100a);
    ``pdl``: launch with programmatic dependent launch; ``state_dtype``: the pages'
    dtype, "fp32" or "bf16"; ``gate_form``: the decay's form (``kda.validate.GATE_FORMS``,
    compiled in: ``dev.decay``)."""

    # gate mode 3: undecided raw gates dev.settle_gate recomputes per round (KdaSplit: 4;
    # here 1, where the batched rounds slowed KdaStream at T = 4)
    settle_batch = 1

    def __init__(
        self,
        heads,
        tokens=1,
        record=False,
        gate_mode=3,
        has_bias=False,
        ahead=0,
        *,
        arch="sm_90a",
        pdl=False,
        state_dtype="fp32",
        gate_form="lower-bound",
    ):
        if not 1 <= tokens <= 8:
            raise ValueError(f"KdaWide supports 1-8 tokens per request; got {tokens}")
        if heads < 1:
            raise ValueError(f"heads must be >= 1; got {heads}")
        if gate_mode not in dev.GATE_MODES:
            raise ValueError(f"gate_mode must be 0, 1 or 3; got {gate_mode}")
        if record and tokens == 1:
            raise ValueError("record mode needs tokens > 1")
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0; got {ahead}")
        self.heads, self.tokens, self.record = heads, tokens, record
        self.gate_mode, self.has_bias, self.ahead = gate_mode, has_bias, ahead
        self.arch, self.packed, self.pdl = arch, dev.has_packed_fma(arch), pdl
        self.state_bytes = dev.state_bytes(state_dtype)
        self.state_dtype, self.bf16_state = state_dtype, state_dtype == "bf16"
        self.gate_form, self.softplus_gate = gate_form, dev.softplus_gate(gate_form)
        # words per staged 4-key chunk, bytes per page
        self.chunk_words = self.state_bytes
        self.page_bytes = HEAD_DIM * HEAD_DIM * self.state_bytes

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, op: KernelOperands, stream):
        """Launch on ``stream`` (``op``: ``kda.operands.KernelOperands``)."""
        self.launch_grid(self.kernel(op), op.output.shape[0] // self.tokens, stream)

    ctas_per_sm = CTAS_PER_SM  # two CTAs of ~85-110 KB of shared memory per SM

    def grid(self, requests):
        """One CTA per (head, request) item (KdaStream: its persistent CTAs)."""
        return (self.heads, requests, 1)

    def launch_grid(self, call, requests, stream):
        """``grid``, ``ctas_per_sm`` CTAs per SM, all shared memory (KdaSplit: clusters)."""
        launch(
            call,
            self.grid(requests),
            (THREADS, 1, 1),
            stream,
            use_pdl=self.pdl,
            min_blocks_per_mp=self.ctas_per_sm,
            carveout=100,
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def item_slots(self, slots, accepted, request):
        """(state slot, conv slot, window offset) of a request."""
        if cutlass.const_expr(self.tokens == 1):
            slot = Int32(slots[request])
            return slot, slot, Int32(0)
        offset = Int32(accepted[request]) - 1
        return Int32(slots[request, offset]), Int32(slots[request, 0]), offset

    def thread_index(self):
        """This thread's index (KdaStream reads it afresh at each use: ``fresh_tid``)."""
        tid, _, _ = cute.arch.thread_idx()
        return tid

    @cute.jit
    def stage_state(self, state, staged, head, slot):
        """cp.async the item's [128, 128] page into the thread-private slots
        ``staged[r * KCHUNKS + c, tid]`` (16 bytes fp32, 8 bytes bf16; conflict-free to
        read back). bf16: a row's threads 2p and 2p + 1 hold adjacent slots and adjacent
        keys, so thread 2p + s copies the 16 bytes of both for the chunks c = s mod 2
        (visible to both after the wait and a barrier)."""
        tid = self.thread_index()
        base_row, lane_in = tid // LANES, tid % LANES
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        source0 = Int64(state.iterator.toint()) + page * self.state_bytes
        shared0 = Int32(staged.iterator.toint())
        if cutlass.const_expr(self.bf16_state):
            s = lane_in % 2
            pair = tid - s
            for r in cutlass.range_constexpr(ROWS):
                for c2 in cutlass.range_constexpr(KCHUNKS // 2):
                    c = 2 * c2 + s
                    offset = (base_row + 64 * r) * HEAD_DIM + 4 * (lane_in - s + LANES * c)
                    shared = shared0 + ((r * KCHUNKS + c) * THREADS + pair) * 8
                    cp_async_16(shared, source0 + Int64(offset) * 2)
        else:
            for r in cutlass.range_constexpr(ROWS):
                for c in cutlass.range_constexpr(KCHUNKS):
                    key = 4 * (lane_in + LANES * c)
                    offset = (base_row + 64 * r) * HEAD_DIM + key
                    shared = shared0 + ((r * KCHUNKS + c) * THREADS + tid) * 16
                    cp_async_16(shared, source0 + Int64(offset) * 4)

    def staged_shape(self):
        """Shape of the staged page (fp32 words): a 4-key chunk per thread and (r, c)."""
        return (ROWS * KCHUNKS, THREADS, self.chunk_words)

    @cute.jit
    def load_history(self, staged):
        """The staged page into registers (a bf16 page widened): history[r][c][e]."""
        tid, _, _ = cute.arch.thread_idx()
        shared0 = Int32(staged.iterator.toint())
        size = 4 * self.chunk_words
        history = []
        for r in cutlass.range_constexpr(ROWS):
            row = []
            for c in cutlass.range_constexpr(KCHUNKS):
                shared = shared0 + ((r * KCHUNKS + c) * THREADS + tid) * size
                row.append(list(dev.ld_shared_keys4(shared, self.bf16_state)))
            history.append(row)
        return history

    @cute.jit
    def load_gate_weights(self, f_b, head, tile, lane):
        """f_b A fragments of gate tile ``tile`` (features 16 tile ..) for lane ``lane`` of
        its warp, 8 k16 chunks (K permuted within a chunk identically for A and B: thread
        columns 4q..4q+3 -> k 2q, 2q+1, 2q+8, 2q+9)."""
        group, quarter = lane // 4, lane % 4
        base = Int64(f_b.iterator.toint())
        feature = head * HEAD_DIM + 16 * tile + group
        weights = []
        for chunk in cutlass.range_constexpr(8):
            col = 16 * chunk + 4 * quarter
            low = ld_global_nc_b32x2(base + Int64(feature * HEAD_DIM + col) * 2)
            high = ld_global_nc_b32x2(base + Int64((feature + 8) * HEAD_DIM + col) * 2)
            weights.append((low[0], high[0], low[1], high[1]))
        return weights

    @cute.jit
    def load_activations(self, f_a, token):
        """f_a B fragments: column n = lane // 4 is token n % T (columns >= T repeat)."""
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        group, quarter = lane // 4, lane % 4
        base = Int64(f_a.iterator.toint())
        row = token + group % self.tokens
        activations = []
        for chunk in cutlass.range_constexpr(8):
            col = 16 * chunk + 4 * quarter
            word = ld_global_nc_b32x2(base + Int64(row * HEAD_DIM + col) * 2)
            activations.append((word[0], word[1]))
        return activations

    @cute.jit
    def convolve(self, taps, coeff, bias, inputs):
        """Depthwise conv (stock tap order, fp32 FMA) and bf16-rounded SiLU, per token."""
        results = []
        for t in cutlass.range_constexpr(self.tokens):
            acc = bias
            for i in cutlass.range_constexpr(4):
                w = t + i
                term = taps[w] if w < 3 else inputs[w - 3]
                acc = cute.math.fma(Float32(term), coeff[i], acc)
            results.append(dev.silu_bf16(acc))
        return results

    @cute.jit
    def conv_phase(self, taps, coeff, bias, inputs, shared, sums, kg_records, request, head):
        """q, k (threads 0-127) and v (128-255) into shared memory; per-warp sums of q^2
        and k^2; the k record."""
        tid, _, _ = cute.arch.thread_idx()
        lane, warp, channel, section = dev.thread_layout(tid)
        s_q, s_k, s_v = shared
        first = self.convolve(taps[0], coeff[0], bias[0], inputs[0])
        second = self.convolve(taps[1], coeff[1], bias[1], inputs[1])
        for t in cutlass.range_constexpr(self.tokens):
            squares_q = warp_sum(first[t] * first[t])
            squares_k = warp_sum(second[t] * second[t])
            if lane == 0:
                sums[t, 0, warp] = squares_q
                sums[t, 1, warp] = squares_k
            if section == 0:
                s_q[t, channel] = first[t]
                s_k[t, channel] = second[t]
                if cutlass.const_expr(self.record):
                    kg_records[request, head, t, channel] = BFloat16(second[t])
            else:
                s_v[t, channel] = first[t]

    @cute.jit
    def gate_phase(self, op, weights, activations, a, dt, s_decay, request, head, rows=None):
        """Raw gate on mma.sync (bf16 rounded; mode 3: ``dev.settle_gate`` recomputes the
        undecided ones exactly), decay into shared, the raw-gate record; ``rows``: the
        settle's row loader (``dev.GateTile.rows``; None: global memory)."""
        lower_bound, kg_records = op.lower_bound, op.kg_records
        tid, _, _ = cute.arch.thread_idx()
        lane, warp = tid % 32, tid // 32
        group, quarter = lane // 4, lane % 4
        acc, bound = self.project_gate(weights, activations)
        for e in cutlass.range_constexpr(4):
            t = 2 * quarter + e % 2
            feature = 16 * warp + group + 8 * (e // 2)
            raw_g = dev.to_bf16_f32(acc[e])
            # s_decay has 8 token rows: columns past T hold unused values.
            s_decay[t, feature] = dev.decay(a, raw_g, dt[e // 2], lower_bound, self.softplus_gate)
            if cutlass.const_expr(self.record):  # noqa: SIM102
                if t < self.tokens:
                    kg_records[request, head, t, HEAD_DIM + feature] = BFloat16(raw_g)
        if cutlass.const_expr(self.gate_mode == 3):
            where = self.settling(s_decay, 16 * warp, warp, request, head, rows)
            dev.settle_gate(op, acc, bound, a, dt, where)

    def project_gate(self, weights, activations):
        """Trace-time helper: the warp's raw gate tile on mma.sync (``dev.gate_projection``;
        gate mode 3 with its error bounds). Returns (accumulators, bounds or None)."""
        if self.gate_mode == 3:
            return dev.gate_projection_bounded(weights, activations)
        return dev.gate_projection(weights, activations, self.gate_mode), None

    def settling(self, s_gate, first, tile, request, head, rows=None):
        """Trace-time helper: ``dev.settle_gate``'s ``where`` of a gate tile."""
        where = (s_gate, first, tile, request, head, self.tokens, self.record)
        return dev.GateTile(*where, self.settle_batch, rows, self.softplus_gate)

    @cute.jit
    def per_channel(self, body):
        """``body(t, channel)`` per token on threads 0-127 (channel ``tid``)."""
        tid, _, _ = cute.arch.thread_idx()
        channel, section = tid % 128, tid // 128
        if section == 0:
            for t in cutlass.range_constexpr(self.tokens):
                body(t, channel)

    def normalize_qk(self, s_q, s_k, sums, scale):
        """q^ = q * rsqrt(sum q^2 + 1e-6) * scale, k^ = k * rsqrt(sum k^2 + 1e-6)."""

        def normalize(t, channel):
            fq = dev.rsqrt_f32(dev.quad_sum([sums[t, 0, w] for w in range(4)]) + 1.0e-6)
            fk = dev.rsqrt_f32(dev.quad_sum([sums[t, 1, w] for w in range(4)]) + 1.0e-6)
            s_q[t, channel] = (s_q[t, channel] * fq) * scale
            s_k[t, channel] = s_k[t, channel] * fk

        self.per_channel(normalize)

    @cute.jit
    def recurrence(self, op, history, shared, s_beta, s_o, slot, request, head):
        """``dev.delta_rule`` on the register state (rows ``tid // LANES`` and + 64); the
        state after token t stored to its page (not in record mode; ``state_store``)."""
        tid = self.thread_index()
        base_row, lane_in = tid // LANES, tid % LANES
        dev.delta_rule(
            history,
            shared,
            s_beta,
            s_o,
            op.state,
            lane_in,
            LANES,
            lambda i: base_row + 64 * i,
            self.tokens,
            self.packed,
            write_v=self.v_writer(op.v_records, request, head, lane_in),
            target=self.state_target(op.slots, slot, request),
            store=self.state_store(head, history),
            streamed=self.streamed,
            load=self.load_chunk,
        )

    # dev.delta_rule's state store: after the token's outputs (KdaStream: during the
    # second pass)
    streamed = False

    def load_chunk(self, shared):
        """Trace-time hook: ``dev.delta_rule``'s d and k loader (KdaStream: volatile)."""
        return ld_shared_f32x4(shared)

    def state_store(self, head, history):
        """Trace-time hook: ``dev.delta_rule``'s state store, the page of token t's
        ``target`` written after the token's outputs when ``target`` > 0."""
        return lambda state0, target: self.store_token(state0, target, head, history)

    def v_writer(self, v_records, request, head, lane_in, value_row=None):
        """Trace-time helper: ``dev.delta_rule``'s v-record writer (lane 0 of a row), None
        outside record mode; ``value_row``: the record's row where it is not ``s_v``'s
        (KdaSplit's local rows)."""
        if not self.record:
            return None

        def write(t, row, v):
            row = row if value_row is None else value_row
            self.write_v(v_records, request, head, t, row, v, lane_in)

        return write

    @cute.jit
    def write_v(self, v_records, request, head, t, row, v, lane_in):
        """The v record of value row ``row`` of token ``t`` (lane 0 of the row)."""
        if lane_in == 0:
            v_records[request, head, t, row] = v

    def state_target(self, slots, slot, request):
        """Trace-time helper: ``dev.delta_rule``'s ``target``, the slot of the state after
        token t (``slot`` at T = 1, else ``slots[request, t]``); None in record mode."""
        if self.record:
            return None
        if self.tokens == 1:
            return lambda t: slot
        return lambda t: Int32(slots[request, t])

    @cute.jit
    def store_token(self, state0, target, head, history):
        """The thread's rows of the state to page ``target`` when it is > 0."""
        if target > 0:
            page = (Int64(target) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
            self.store_state(state0, page, history)

    @cute.jit
    def store_state(self, state0, page, history):
        """The thread's value rows of the register state to page ``page`` (a bf16 page
        rounded here, once)."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        for r in cutlass.range_constexpr(ROWS):
            for c in cutlass.range_constexpr(KCHUNKS):
                offset = (base_row + 64 * r) * HEAD_DIM + 4 * (lane_in + LANES * c)
                address = state0 + (page + offset) * self.state_bytes
                dev.st_global_keys4(address, history[r][c], self.bf16_state)

    @cute.jit
    def norm_sums(self, s_o, out_sums):
        """Per-warp sums of o^2 (threads 0-127, channel c of each token)."""
        tid, _, _ = cute.arch.thread_idx()
        lane, warp = tid % 32, tid // 32
        channel = tid % 128
        for t in cutlass.range_constexpr(self.tokens):
            o = s_o[t, channel]
            total = warp_sum(o * o)
            if lane == 0:
                out_sums[t, warp] = total

    def conv_operands(
        self,
        conv_state,
        conv_weight,
        conv_bias,
        conv_slot,
        offset,
        columns,
        weight_parts,
        weight_columns,
    ):
        """Trace-time helper (no barrier): the predecessor-independent conv operands of a
        thread's two channels ``s`` = 0, 1: column ``columns[s]`` of x / conv_state, weight
        ``conv_weight[weight_parts[s], :, weight_columns[s]]``. Returns the three window
        taps before this step's inputs, the four fp32 weights and the bias (0.0 without)."""
        taps, coeff, bias = [], [], []
        for s in range(2):
            ch = columns[s]
            taps.append([conv_state[Int64(conv_slot), ch, offset + j] for j in range(3)])
            coeff.append(
                [Float32(conv_weight[weight_parts[s], i, weight_columns[s]]) for i in range(4)]
            )
            bias.append(Float32(conv_bias[ch]) if self.has_bias else Float32(0.0))
        return taps, coeff, bias

    def gate_operands(self, op, head, warp, lane):
        """Trace-time helper (no barrier): the head's a_log, the thread's two dt_bias values
        (rows ``lane // 4`` and + 8 of its warp's gate tile) and its f_b fragments."""
        a = Float32(op.a_log[head])
        group = lane // 4
        dt = [Float32(op.dt_bias[head * HEAD_DIM + 16 * warp + group + 8 * i]) for i in range(2)]
        tid, _, _ = cute.arch.thread_idx()  # read here: KdaStream's own lane here spilled
        return a, dt, self.load_gate_weights(op.f_b, head, tid // 32, tid % 32)

    def item_operands(self, op, thread, conv_slot, offset, s_beta, token, head):
        """Trace-time helper: an item's operands of the conv and gate phases, in this
        order: the conv window, weights and bias of the thread's two channels, the norm
        weight and the gate's parameters (predecessor-independent), then ``read_inputs``.
        ``thread``: (lane, warp, channel, section) of the thread. Returns (conv, nw, gate):
        conv (taps, coeff, bias, inputs), gate (weights, activations, a, dt)."""
        lane, warp, channel, section = thread
        dim = self.heads * HEAD_DIM
        parts = (2 * section, 1)  # s = 0: q or v; s = 1: k (used by threads 0-127)
        columns = [parts[s] * dim + head * HEAD_DIM + channel for s in range(2)]
        taps, coeff, bias = self.conv_operands(
            op.conv_state,
            op.conv_weight,
            op.conv_bias,
            conv_slot,
            offset,
            columns,
            parts,
            [head * HEAD_DIM + channel] * 2,
        )
        nw = Float32(op.norm_weight[channel])
        a, dt, weights = self.gate_operands(op, head, warp, lane)
        inputs, activations = self.read_inputs(op, s_beta, columns, token, head)
        return (taps, coeff, bias, inputs), nw, (weights, activations, a, dt)

    def read_inputs(self, op, s_beta, columns, token, head):
        """Trace-time helper: after ``griddepcontrol.wait``, x at the thread's two
        ``columns``, sigmoid(beta) into ``s_beta``, the thread's f_a fragments; then releases
        the dependents. Returns (inputs, fragments)."""
        cute.arch.griddepcontrol_wait()
        inputs = [[op.x[token + t, columns[s]] for t in range(self.tokens)] for s in range(2)]
        self.load_beta(op.beta, s_beta, token, head)
        activations = self.load_activations(op.f_a, token)
        cute.arch.griddepcontrol_launch_dependents()
        return inputs, activations

    @cute.jit
    def load_beta(self, beta, s_beta, token, head):
        """sigmoid(beta) of the item's tokens into ``s_beta`` (threads 128 .. 128 + T - 1)."""
        tid, _, _ = cute.arch.thread_idx()
        channel, section = tid % 128, tid // 128
        if (section == 1) & (channel < self.tokens):
            s_beta[channel] = dev.sigmoid(Float32(beta[token + channel, head]))

    def output_gate(self, gate, token, t, head, channel):
        """sigmoid of the output gate of ``channel`` of token ``t`` (trace-time hook:
        KdaStream reads it from its staged rows)."""
        return dev.sigmoid(Float32(gate[token + t, head * HEAD_DIM + channel]))

    def write_output(self, s_o, out_sums, gate, nw, eps, output, token, head):
        """Gated RMSNorm of each token's o (threads 0-127)."""

        def write(t, channel):
            sumsq = dev.quad_sum([out_sums[t, w] for w in range(4)])
            rstd = dev.rsqrt_f32(sumsq * (1.0 / HEAD_DIM) + eps)
            result = ((s_o[t, channel] * rstd) * nw) * self.output_gate(
                gate, token, t, head, channel
            )
            output[token + t, head * HEAD_DIM + channel] = BFloat16(result)

        self.per_channel(write)

    @cute.jit
    def write_conv(self, conv_state, conv_slot, head, taps, inputs):
        """Window positions 0..T+1 of the item's channels: [tap1, tap2, x_0 .. x_{T-1}]."""
        tid, _, _ = cute.arch.thread_idx()
        channel, section = tid % 128, tid // 128
        dim = self.heads * HEAD_DIM
        conv_type = conv_state.element_type
        for s in cutlass.range_constexpr(2):
            part = 2 * section + s  # 0 q, 1 k, 2 v (s = 1 only in section 0)
            if (section == 0) | (s == 0):
                ch = part * dim + head * HEAD_DIM + channel
                conv_state[Int64(conv_slot), ch, 0] = conv_type(taps[s][1])
                conv_state[Int64(conv_slot), ch, 1] = conv_type(taps[s][2])
                for t in cutlass.range_constexpr(self.tokens):
                    conv_state[Int64(conv_slot), ch, 2 + t] = conv_type(inputs[s][t])

    @cute.jit
    def write_padding(self, output, token, head, tid, row, rows):
        """A padding item: zero output rows (threads ``tid`` < ``rows``, value row ``row``)
        between the PDL wait and the release; nothing else read or written."""
        cute.arch.griddepcontrol_wait()
        if tid < rows:
            for t in cutlass.range_constexpr(self.tokens):
                output[token + t, head * HEAD_DIM + row] = BFloat16(0.0)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def prefetch_next(self, slots, accepted, state, head, request, requests):
        """L2 prefetch of the state page of the item ``ahead`` CTAs on."""
        item = head + self.heads * request + self.ahead
        if item < self.heads * requests:
            h, r = item % self.heads, item // self.heads
            slot, _, _ = self.item_slots(slots, accepted, r)
            if slot > 0:
                page = (Int64(slot) * self.heads + h) * (HEAD_DIM * HEAD_DIM)
                address = Int64(state.iterator.toint()) + page * self.state_bytes
                prefetch_l2_bulk(address, self.page_bytes)

    @cute.kernel
    def kernel(self, op):
        T = self.tokens
        tid, _, _ = cute.arch.thread_idx()
        head, request, _ = cute.arch.block_idx()
        _, requests, _ = cute.arch.grid_dim()
        thread = dev.thread_layout(tid)  # (lane, warp, channel, section)
        section = thread[3]
        token = request * T
        slot, conv_slot, offset = self.item_slots(op.slots, op.accepted, request)
        if slot <= 0:
            self.write_padding(op.output, token, head, tid, tid, HEAD_DIM)
        else:
            smem = cutlass.memory.SmemAllocator()
            staged = smem_tensor(smem, Float32, self.staged_shape(), align=128)
            # q, k, v, o of the item's tokens
            s_q, s_k, s_v, s_o = [smem_tensor(smem, Float32, (T, HEAD_DIM)) for _ in range(4)]
            s_decay = smem_tensor(smem, Float32, (8, HEAD_DIM))
            s_beta = smem_tensor(smem, Float32, (8,))
            smem_tensor(smem, BFloat16, (T, HEAD_DIM), align=16)  # unused (was gate mode 2's)
            sums = smem_tensor(smem, Float32, (T, 2, 8))
            out_sums = smem_tensor(smem, Float32, (T, 4))

            if cutlass.const_expr(self.ahead > 0):  # noqa: SIM102
                if tid == 0:
                    self.prefetch_next(op.slots, op.accepted, op.state, head, request, requests)

            # Predecessor-independent: the state page (cp.async), the conv window, weights.
            self.stage_state(op.state, staged, head, slot)
            cute.arch.cp_async_commit_group()
            conv, nw, gate = self.item_operands(op, thread, conv_slot, offset, s_beta, token, head)

            self.conv_phase(*conv, (s_q, s_k, s_v), sums, op.kg_records, request, head)
            # The conv page now: frees the taps' and inputs' registers for the recurrence.
            self.write_conv(op.conv_state, conv_slot, head, conv[0], conv[3])
            self.gate_phase(op, *gate, s_decay, request, head)
            cute.arch.barrier()
            self.normalize_qk(s_q, s_k, sums, op.scale)
            if cutlass.const_expr(self.bf16_state):  # a pair's copies: seen after the barrier
                cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

            if cutlass.const_expr(not self.bf16_state):
                cute.arch.cp_async_wait_group(0)
            history = self.load_history(staged)
            self.recurrence(op, history, (s_q, s_k, s_v, s_decay), s_beta, s_o, slot, request, head)
            cute.arch.barrier()

            if section == 0:
                self.norm_sums(s_o, out_sums)
            cute.arch.barrier()
            self.write_output(s_o, out_sums, op.gate, nw, op.eps, op.output, token, head)
