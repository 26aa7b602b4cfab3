"""KdaStream: persistent KdaWide. Each CTA walks a contiguous, head-major range of
(head, request) items (its heads' f_b rows and parameters stay in L1) and cp.asyncs item
n + 1's state page, conv window and projection rows into shared memory while it runs item
n's recurrence.

Per item the math is KdaWide's call for call (same rounding points and fp32 order); only
the operands' source differs (conv taps, x, the output gate and f_a staged in shared
memory, both conv-cache layouts by 16-byte copies; ``conv_dim_first`` says which layout is
behind the ``[S, 3D, W]`` view). Padding items write zero outputs only. PDL: the first
item's page and window are staged before ``griddepcontrol.wait``, all else after it.

Registers (128 per thread, 64 of them the state): nothing but the item index is carried
through the item loop (per-item values re-derived from it, ``%tid.x`` and ``%ctaid.x``),
and the recurrence writes the state chunk by chunk from fresh registers; ptxas reports no
spills at T = 1..4 and T = 8 without record (gate modes 0 / 1): docs/kda_dispatch.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as IR
from cutlass.cutlass_dsl import dsl_user_op

from tpcomm.cuteutil import (
    cp_async_16,
    ld_shared_b32x2,
    smem_tensor,
)

from . import device as dev
from .device import HEAD_DIM, KCHUNKS, LANES, ROWS, THREADS
from .wide import KdaWide

GRANULE = 16  # bytes per cp.async
SMEM_LIMIT = 113 * 1024  # two CTAs per SM on sm_90 / sm_100 (227 KB per SM)


def stream_smem_bytes(tokens, window, conv_bytes, conv_dim_first, state_bytes=4):
    """Shared memory of one KdaStream CTA (bytes, without alignment padding); the staged
    page takes half of it at ``state_bytes`` 4 (fp32), a quarter at 2 (bf16)."""
    conv = 3 * HEAD_DIM * (window if conv_dim_first else 3) * conv_bytes
    staged = ROWS * KCHUNKS * THREADS * 4 * state_bytes
    inputs = tokens * 6 * HEAD_DIM * 2  # x (3 rows), f_a, the output gate twice (parity)
    work = (4 * tokens + 8) * HEAD_DIM * 4 + 16 * 4 + tokens * 12 * 4
    return conv + staged + inputs + work


def volatile_asm(result, operands, text, constraints, loc, ip):
    """``llvm.inline_asm`` with side effects: ptxas neither merges it with another nor
    moves it across one."""
    return llvm.inline_asm(
        result, operands, text, constraints, has_side_effects=True, asm_dialect=0, loc=loc, ip=ip
    )


@dsl_user_op
def fresh_index(register: str = "%tid.x", *, loc=None, ip=None) -> Int32:
    """``%tid.x`` (or ``%ctaid.x``) through a volatile asm: what is derived from it is
    computed per item, not hoisted out of the item loop and held in registers across the
    recurrence."""
    return Int32(volatile_asm(IR.i32(), [], f"mov.u32 $0, {register};", "=r", loc, ip))


@dsl_user_op
def opaque(value: Int32, *, loc=None, ip=None) -> Int32:
    """``value`` through a volatile asm: an expression of it is recomputed where used,
    not merged with an earlier one and held in registers."""
    return Int32(
        volatile_asm(
            IR.i32(), [Int32(value).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r", loc, ip
        )
    )


def fresh_tid():
    """This thread's index, read per use (``fresh_index``)."""
    return fresh_index("%tid.x")


@dsl_user_op
def reload_shared_f32x4(shared: Int32, *, loc=None, ip=None):
    """A 16-byte shared load that ptxas neither merges with an earlier load of the same
    address nor moves across another (volatile): the recurrence reads k twice rather than
    holding 32 keys in registers."""
    result = volatile_asm(
        llvm.StructType.get_literal([Float32.mlir_type] * 4),
        [Int32(shared).ir_value(loc=loc, ip=ip)],
        "ld.volatile.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,r",
        loc,
        ip,
    )
    return tuple(
        Float32(llvm.extractvalue(Float32.mlir_type, result, [e], loc=loc, ip=ip)) for e in range(4)
    )


@dsl_user_op
def st_global_f32_if_zero(address: Int64, value, lane: Int32, *, loc=None, ip=None):
    """4-byte global store of ``value`` when ``lane == 0`` (predicated, no branch)."""
    operands = [
        Int64(address).ir_value(loc=loc, ip=ip),
        Float32(value).ir_value(loc=loc, ip=ip),
        Int32(lane).ir_value(loc=loc, ip=ip),
    ]
    volatile_asm(
        None,
        operands,
        "{ .reg .pred p; setp.eq.s32 p, $2, 0; @p st.global.f32 [$0], $1; }",
        "l,f,r",
        loc,
        ip,
    )


@dsl_user_op
def st_global_bf16x4_masked(address: Int64, values, target: Int32, *, loc=None, ip=None):
    """8-byte global store of four fp32 rounded to bf16 (nearest even; a bf16 page's one
    rounding) when ``target > 0`` (predicated, no branch); the packed words are fresh
    registers, as ``st_global_f32x4_masked``'s."""
    operands = [Int64(address).ir_value(loc=loc, ip=ip)]
    operands += [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    operands.append(Int32(target).ir_value(loc=loc, ip=ip))
    volatile_asm(
        None,
        operands,
        "{ .reg .pred p; .reg .b32 a, b; setp.gt.s32 p, $5, 0; "
        "cvt.rn.bf16x2.f32 a, $2, $1; cvt.rn.bf16x2.f32 b, $4, $3; "
        "@p st.global.v2.b32 [$0], {a, b}; }",
        "l,f,f,f,f,r",
        loc,
        ip,
    )


@dsl_user_op
def st_global_f32x4_masked(address: Int64, values, target: Int32, *, loc=None, ip=None):
    """16-byte global store of four fp32 when ``target > 0`` (predicated, no branch). The
    words go through ``xor`` with ``target >> 31`` (zero whenever the store happens) into
    fresh registers: the long-lived state values need not sit in an aligned quad."""
    operands = [Int64(address).ir_value(loc=loc, ip=ip)]
    operands += [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    operands.append(Int32(target).ir_value(loc=loc, ip=ip))
    volatile_asm(
        None,
        operands,
        "{ .reg .pred p; .reg .b32 z, a, b, c, d; setp.gt.s32 p, $5, 0; shr.s32 z, $5, 31; "
        "xor.b32 a, $1, z; xor.b32 b, $2, z; xor.b32 c, $3, z; xor.b32 d, $4, z; "
        "@p st.global.v4.b32 [$0], {a, b, c, d}; }",
        "l,f,f,f,f,r",
        loc,
        ip,
    )


class KdaStream(KdaWide):
    """KdaWide's operands and semantics; ``ctas`` persistent CTAs (two per SM),
    ``conv_dim_first`` the conv cache's memory layout and ``window`` its length W."""

    def __init__(
        self,
        heads,
        tokens,
        record,
        gate_mode,
        has_bias,
        conv_dim_first,
        window,
        ctas,
        *,
        arch="sm_90a",
        pdl=False,
        state_dtype="fp32",
        gate_form="lower-bound",
    ):
        super().__init__(
            heads,
            tokens,
            record,
            gate_mode,
            has_bias,
            0,
            arch=arch,
            pdl=pdl,
            state_dtype=state_dtype,
            gate_form=gate_form,
        )
        if window < tokens + 2:
            raise ValueError(f"window W = {window} must be >= T + 2 = {tokens + 2}")
        if ctas < 1:
            raise ValueError(f"ctas must be >= 1; got {ctas}")
        self.check_shared_memory(tokens, window, conv_dim_first)
        self.conv_dim_first, self.window, self.ctas = conv_dim_first, window, ctas

    def check_shared_memory(self, tokens, window, conv_dim_first):
        """ValueError when the CTA's shared memory is past its budget (KdaPipe: its own)."""
        need = stream_smem_bytes(tokens, window, 4, conv_dim_first, self.state_bytes)
        if need > SMEM_LIMIT:
            raise ValueError(
                f"KdaStream needs {need} bytes of shared memory for W = {window}, "
                f"T = {tokens}; at most {SMEM_LIMIT} (use kernel='wide')"
            )

    def grid(self, requests):
        """``ctas`` persistent CTAs (two per SM)."""
        return (self.ctas, 1, 1)

    @cute.jit
    def stage_conv(self, conv_state, convs, head, conv_slot, offset):
        """cp.async the item's conv window: dim-first ``convs[part, channel * W + j]``
        (the whole window), window-first ``convs[part, tap * 128 + channel]``."""
        tid = fresh_tid()
        dim = self.heads * HEAD_DIM
        size = conv_state.element_type.width // 8
        per = GRANULE // size
        shared0 = Int32(convs.iterator.toint())
        if cutlass.const_expr(self.conv_dim_first):
            part_granules = HEAD_DIM * self.window // per
            total = 3 * part_granules
            for j in cutlass.range_constexpr((total + THREADS - 1) // THREADS):
                g = tid + THREADS * j
                if g < total:
                    part, k = g // part_granules, g % part_granules
                    base = conv_state.iterator + cute.crd2idx(
                        (Int64(conv_slot), part * dim + head * HEAD_DIM, 0), conv_state.layout
                    )
                    source = Int64(base.toint()) + Int64(k * GRANULE)
                    cp_async_16(shared0 + (part * HEAD_DIM * self.window + per * k) * size, source)
        else:
            row_granules = HEAD_DIM // per
            total = 9 * row_granules
            for j in cutlass.range_constexpr((total + THREADS - 1) // THREADS):
                g = tid + THREADS * j
                if g < total:
                    row, k = g // row_granules, g % row_granules
                    part, tap = row // 3, row % 3
                    channel = part * dim + head * HEAD_DIM + per * k
                    base = conv_state.iterator + cute.crd2idx(
                        (Int64(conv_slot), channel, offset + tap), conv_state.layout
                    )
                    shared = shared0 + (part * 3 * HEAD_DIM + tap * HEAD_DIM + per * k) * size
                    cp_async_16(shared, Int64(base.toint()))

    @cute.jit
    def stage_inputs(self, x, gate, f_a, xs, gs, fas, head, request, parity):
        """cp.async the item's projection rows: x (q, k, v), the output gate (into
        ``gs[parity]``: item n's gate is read after item n + 1's rows are staged), f_a."""
        tid = fresh_tid()
        T = self.tokens
        dim = self.heads * HEAD_DIM
        token = request * T
        total = 5 * 16 * T
        x0, g0, a0 = (Int64(t.iterator.toint()) for t in (x, gate, f_a))
        xs0, gs0, fas0 = (Int32(t.iterator.toint()) for t in (xs, gs, fas))
        for j in cutlass.range_constexpr((total + THREADS - 1) // THREADS):
            g = tid + THREADS * j
            if g < total:
                row, k = g // 16, g % 16
                t, kind = row // 5, row % 5
                if kind < 3:
                    col = kind * dim + head * HEAD_DIM + 8 * k
                    source = x0 + Int64((token + t) * 3 * dim + col) * 2
                    cp_async_16(xs0 + ((t * 3 + kind) * HEAD_DIM + 8 * k) * 2, source)
                elif kind == 3:
                    source = g0 + Int64((token + t) * dim + head * HEAD_DIM + 8 * k) * 2
                    gate_row = (parity * T + t) * HEAD_DIM
                    cp_async_16(gs0 + (gate_row + 8 * k) * 2, source)
                else:
                    source = a0 + Int64((token + t) * HEAD_DIM + 8 * k) * 2
                    cp_async_16(fas0 + (t * HEAD_DIM + 8 * k) * 2, source)

    def output_gate(self, gate, token, t, head, channel):
        """sigmoid of the output gate of ``channel`` of token ``t``, read from the item's
        staged rows (``gate`` is ``(gs, parity)``: ``gs`` [2, T, 128] bf16 in shared memory)."""
        rows, parity = gate
        return dev.sigmoid(Float32(rows[parity, t, channel]))

    def thread_index(self):
        """Read per use (``fresh_tid``): KdaWide's ``stage_state`` and ``recurrence`` then
        hold no thread index across the item loop."""
        return fresh_tid()

    # KdaWide's recurrence (``dev.delta_rule``) with fewer registers live: d and k read
    # with ``reload_shared_f32x4`` (k again for the second pass) and the state after token t
    # streamed to its page chunk by chunk as the second pass updates it (a predicated store;
    # the page's slot is read before that pass).
    streamed = True

    def load_chunk(self, shared):
        """Volatile (``reload_shared_f32x4``): d and k are not held in registers."""
        return reload_shared_f32x4(shared)

    def state_store(self, head, history):
        """The page address of token t's ``target``, before the second pass; each
        updated chunk then stored (when ``target`` > 0) by ``chunk_writer``'s writer."""
        return lambda state0, target: self.chunk_writer(state0, target, head)

    @cute.jit
    def write_v(self, v_records, request, head, t, row, v, lane_in):
        """The v record by one lane of the row: a predicated store, no branch."""
        index = cute.crd2idx((request, head, t, row), v_records.layout)
        address = Int64(v_records.iterator.toint()) + Int64(index) * 4
        st_global_f32_if_zero(address, v, lane_in)

    def page_head(self, head):
        """``head`` as the page address takes it: from a fresh register (``opaque``)."""
        return opaque(head)

    def chunk_writer(self, state0, target, head):
        """Trace-time helper: the thread's page address of ``target`` (from fresh
        registers: ``thread_index``, ``page_head``), and the writer of chunk ``c`` of row
        ``i`` (stored when ``target`` > 0; a bf16 page rounded to nearest-even here, once
        per stored page)."""
        tid_t = self.thread_index()
        page = (Int64(target) * self.heads + self.page_head(head)) * (HEAD_DIM * HEAD_DIM)
        key0 = (tid_t // LANES) * HEAD_DIM + 4 * (tid_t % LANES)
        size = self.state_bytes
        row0 = state0 + (page + Int64(key0)) * size
        store = st_global_bf16x4_masked if self.bf16_state else st_global_f32x4_masked

        def write(i, c, values):
            offset = (64 * i * HEAD_DIM + 4 * LANES * c) * size
            store(row0 + offset, values, target)

        return write

    @cute.jit
    def stage_item(self, op, buffers, head, request, parity, with_inputs):
        """Stage an item (state page, conv window, and with ``with_inputs`` its rows and
        sigmoid(beta) into ``s_beta[parity]``); nothing for a padding item."""
        x, conv_state, f_a, beta, gate = op.x, op.conv_state, op.f_a, op.beta, op.gate
        slots, state, accepted = op.slots, op.state, op.accepted
        staged, convs, xs, gs, fas, s_beta = buffers
        tid = fresh_tid()
        slot, conv_slot, offset = self.item_slots(slots, accepted, request)
        if slot > 0:
            if cutlass.const_expr(not with_inputs):
                self.stage_state(state, staged, head, slot)
                self.stage_conv(conv_state, convs, head, conv_slot, offset)
            else:
                self.stage_inputs(x, gate, f_a, xs, gs, fas, head, request, parity)
                if tid < self.tokens:
                    b = Float32(beta[request * self.tokens + tid, head])
                    s_beta[parity, tid] = dev.sigmoid(b)

    @cute.jit
    def stage_next(self, op, buffers, head, request, total, parity):
        """Stage the item after (head, request) into ``parity`` if it is in this CTA's
        range (derived here, not held across the item's work)."""
        requests = op.output.shape[0] // self.tokens
        item = opaque(head) * requests + opaque(request) + 1
        if item < ((fresh_index("%ctaid.x") + 1) * total) // self.ctas:
            h, r = item // requests, item % requests
            self.stage_item(op, buffers, h, r, parity, False)
            self.stage_item(op, buffers, h, r, parity, True)

    @cute.kernel
    def kernel(self, op):
        T, H = self.tokens, self.heads
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane, warp, channel, section = dev.thread_layout(tid)
        group, quarter = lane // 4, lane % 4
        dim = H * HEAD_DIM
        requests = op.output.shape[0] // T
        total = H * requests
        first = (cta * total) // self.ctas
        count = ((cta + 1) * total) // self.ctas - first

        smem = cutlass.memory.SmemAllocator()
        staged = smem_tensor(smem, Float32, self.staged_shape(), align=128)
        conv_type = op.conv_state.element_type
        conv_cols = HEAD_DIM * self.window if self.conv_dim_first else 3 * HEAD_DIM
        convs = smem_tensor(smem, conv_type, (3, conv_cols), align=16)
        xs = smem_tensor(smem, BFloat16, (T, 3, HEAD_DIM), align=16)
        gs = smem_tensor(smem, BFloat16, (2, T, HEAD_DIM), align=16)  # parity-buffered
        fas = smem_tensor(smem, BFloat16, (T, HEAD_DIM), align=16)
        # q, k, v, o of the item's tokens
        s_q, s_k, s_v, s_o = [smem_tensor(smem, Float32, (T, HEAD_DIM)) for _ in range(4)]
        s_decay = smem_tensor(smem, Float32, (8, HEAD_DIM))
        s_beta = smem_tensor(smem, Float32, (2, 8))
        sums = smem_tensor(smem, Float32, (T, 2, 8))
        out_sums = smem_tensor(smem, Float32, (T, 4))
        buffers = (staged, convs, xs, gs, fas, s_beta)
        parts = (2 * section, 1)

        # Prologue: the first item's page and window (predecessor-independent), its rows.
        # Items are head-major, (head, request) = divmod(item, requests): a CTA's range stays
        # on one or two heads, whose f_b rows, conv taps and parameters stay in L1.
        head, request = first // requests, first % requests
        if count > 0:
            self.stage_item(op, buffers, head, request, 0, False)
        cute.arch.griddepcontrol_wait()
        if count > 0:
            self.stage_item(op, buffers, head, request, 0, True)
        cute.arch.cp_async_commit_group()
        cute.arch.griddepcontrol_launch_dependents()

        item = first
        while item < ((fresh_index("%ctaid.x") + 1) * total) // self.ctas:
            # Everything per item is derived afresh from the item, %tid.x and %ctaid.x:
            # nothing else is carried in registers across the recurrence.
            tid = fresh_tid()
            lane, warp, channel, section = dev.thread_layout(tid)
            group, quarter = lane // 4, lane % 4
            parts = (2 * section, 1)
            parity = (item - (fresh_index("%ctaid.x") * total) // self.ctas) % 2
            head, request = item // requests, item % requests
            token = request * T
            slot, conv_slot, offset = self.item_slots(op.slots, op.accepted, request)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if slot <= 0:
                if tid < HEAD_DIM:
                    for t in cutlass.range_constexpr(T):
                        op.output[token + t, head * HEAD_DIM + tid] = BFloat16(0.0)
                cute.arch.barrier()
                self.stage_next(op, buffers, head, request, total, 1 - parity)
                cute.arch.cp_async_commit_group()
            else:
                # Per-head parameters (L2-resident weights).
                coeff = []
                bias = []
                for s in cutlass.range_constexpr(2):
                    ch = parts[s] * dim + head * HEAD_DIM + channel
                    coeff.append(
                        [
                            Float32(op.conv_weight[parts[s], e, head * HEAD_DIM + channel])
                            for e in range(4)
                        ]
                    )
                    if cutlass.const_expr(self.has_bias):
                        bias.append(Float32(op.conv_bias[ch]))
                    else:
                        bias.append(Float32(0.0))
                a, dt, weights = self.gate_operands(op, head, warp, lane)

                # Staged operands.
                taps = []
                inputs = []
                for s in cutlass.range_constexpr(2):
                    if cutlass.const_expr(self.conv_dim_first):
                        taps.append(
                            [convs[parts[s], channel * self.window + offset + j] for j in range(3)]
                        )
                    else:
                        taps.append([convs[parts[s], j * HEAD_DIM + channel] for j in range(3)])
                    inputs.append([xs[t, parts[s], channel] for t in range(T)])
                fas0 = Int32(fas.iterator.toint())
                activations = []
                for chunk in cutlass.range_constexpr(8):
                    col = 16 * chunk + 4 * quarter
                    activations.append(ld_shared_b32x2(fas0 + ((group % T) * HEAD_DIM + col) * 2))

                self.conv_phase(
                    taps, coeff, bias, inputs, (s_q, s_k, s_v), sums, op.kg_records, request, head
                )
                self.write_conv(op.conv_state, conv_slot, head, taps, inputs)
                self.gate_phase(op, weights, activations, a, dt, s_decay, request, head)
                cute.arch.barrier()
                self.normalize_qk(s_q, s_k, sums, op.scale)
                history = self.load_history(staged)
                cute.arch.barrier()  # the stage is free: item n + 1 streams in

                self.stage_next(op, buffers, head, request, total, 1 - parity)
                cute.arch.cp_async_commit_group()

                beta_now = s_beta[parity, None]
                self.recurrence(
                    op, history, (s_q, s_k, s_v, s_decay), beta_now, s_o, slot, request, head
                )
                cute.arch.barrier()
                if section == 0:
                    self.norm_sums(s_o, out_sums)
                cute.arch.barrier()
                # the output gate from its staged rows (no global read on the item's tail);
                # the norm weight read per item (L1), not held across the recurrence
                nw = Float32(op.norm_weight[channel])
                self.write_output(s_o, out_sums, (gs, parity), nw, op.eps, op.output, token, head)
            item = opaque(head) * requests + opaque(request) + 1
