"""KdaReplayStream: persistent KdaReplay. Each CTA walks a contiguous, head-major range of
(head, request) items and copies item n + 1's ring entries and checkpoint page while it
computes item n, so that a page is in flight for nearly all of an item's time.

Per item the math is KdaReplay's, phase for phase (its device functions, same operations in
the same order: outputs, ring entries, counters and folded pages bitwise KdaReplay's). What
differs is where the operands wait:

- the page goes from its shared slots into registers (64 per thread, KdaStream's layout)
  once the suffix phase is done; the fold and ``replay_rows`` read the registers, and the
  shared page buffer takes the next item's page at once;
- v_new entries are double-buffered (``r_v`` by item parity: the next item's copy lands
  while ``replay_rows`` reads the current one's), the bf16 k / raw-gate entries have their
  own buffer (dead after ``stage_entries``, no longer shared with the suffix outputs);
- cp.async groups: each item commits exactly two for the next item (its entries, then its
  page; empty for a padding item or past the CTA's range), so at an item's start the groups
  in flight are [entries, page]: ``wait_group(1)`` before the gate phase (the entries),
  ``wait_group(0)`` before the page is loaded to registers.

Shared memory (``kda.dispatch.replay_stream_smem_bytes``): 94 KB at R 8 T 1, 112 KB at R 16
T 1 (two CTAs per SM need <= 113 KB; larger R x T: ``kernel="wide"``). Padding items write
zero outputs only. PDL as KdaReplay: the first item's entries, counters and page are read
before ``griddepcontrol.wait``, every later item's after it.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm.cuteutil import launch, ld_shared_f32x4, smem_tensor, st_global_f32x4

from .device import CTAS_PER_SM, HEAD_DIM, KCHUNKS, LANES, ROWS, THREADS
from .dispatch import SMEM_PER_CTA, replay_stream_smem_bytes
from .replay import KdaReplay, ring_entry


class KdaReplayStream(KdaReplay):
    """KdaReplay's operands and semantics; ``ctas`` persistent CTAs (two per SM)."""

    def __init__(self, heads, size, tokens=1, gate_mode=3, has_bias=False, ctas=1, *,
                 arch="sm_90a", pdl=False):  # fmt: skip
        super().__init__(heads, size, tokens, gate_mode, has_bias, arch=arch, pdl=pdl)
        if ctas < 1:
            raise ValueError(f"ctas must be >= 1; got {ctas}")
        need = replay_stream_smem_bytes(size, tokens)
        if need > SMEM_PER_CTA:
            raise ValueError(
                f"KdaReplayStream needs {need} bytes of shared memory at R = {size}, "
                f"T = {tokens}; at most {SMEM_PER_CTA} (use KdaReplay)"
            )
        self.ctas = ctas

    def launch_grid(self, call, requests, stream):
        """``ctas`` persistent CTAs, two per SM."""
        launch(
            call,
            (self.ctas, 1, 1),
            (THREADS, 1, 1),
            stream,
            use_pdl=self.pdl,
            min_blocks_per_mp=CTAS_PER_SM,
            carveout=100,
        )

    def page_source(self, op, staged, slot, head):
        """``replay_rows`` reads the page from registers: ``staged`` is the history."""
        return staged

    def page_chunk(self, source, i, c, tid):
        return source[i][c]

    # ---------------------------------------------------------------- device side
    @cute.jit
    def item_of(self, op, item):
        """(head, request, state slot) of ``item`` (head-major: head * B + request)."""
        requests = op.output.shape[0] // self.tokens
        head, request = item // requests, item % requests
        slot = Int32(0)
        if cutlass.const_expr(self.tokens == 1):
            slot = Int32(op.slots[request])
        else:
            slot = Int32(op.slots[request, 0])
        return head, request, slot

    @cute.jit
    def held_entries(self, op, slot, head, request):
        """Entries the item keeps: committed plus the pending ones it commits (KdaReplay's)."""
        pending = Int32(op.ring_length[Int64(slot), head, 1])
        accepted = Int32(1)
        if cutlass.const_expr(self.tokens > 1):
            accepted = Int32(op.accepted[request])
        if accepted < pending:
            pending = accepted
        return Int32(op.ring_length[Int64(slot), head, 0]) + pending

    @cute.jit
    def stage_item(self, op, staged, r_raw, r_v, item, last):
        """cp.async of ``item``'s held ring entries (one group) and its page (the next
        group) when ``item < last`` and its slot is live; both groups committed either way."""
        if item < last:
            head, request, slot = self.item_of(op, item)
            if slot > 0:
                held = self.held_entries(op, slot, head, request)
                self.copy_entries(op, r_raw, r_v, held, slot, head)
        cute.arch.cp_async_commit_group()
        if item < last:
            head, request, slot = self.item_of(op, item)
            if slot > 0:
                self.stage_state(op.state, staged, head, slot)
        cute.arch.cp_async_commit_group()

    def ring_half(self, r_vs, parity):
        """The v_new buffer of item parity ``parity`` ([R, 128] fp32 of ``r_vs``)."""
        R = self.size
        layout = cute.make_layout((R, HEAD_DIM), stride=(HEAD_DIM, 1))
        return cute.make_tensor(r_vs.iterator + parity * (R * HEAD_DIM), layout)

    @cute.jit
    def fold_history(self, state, history, ring, slot, head, fold):
        """KdaReplay's ``fold_page`` on the page in registers (``apply_pair`` per entry and
        key pair, entries in order): with ``fold`` the R staged entries applied and the
        values written to the page; without, the entry loop runs zero times."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        r_k, r_d, r_v, _ = ring
        k0, d0 = Int32(r_k.iterator.toint()), Int32(r_d.iterator.toint())
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        state0 = Int64(state.iterator.toint()) + page * 4
        count = Int32(0)
        if fold:
            count = Int32(self.size)
        for c in cutlass.range_constexpr(KCHUNKS):
            h0, h1, h2, h3 = history[0][c]
            h4, h5, h6, h7 = history[1][c]
            key = 4 * (lane_in + LANES * c)
            for j in cutlass.range(count, unroll=1):
                offset = (j * HEAD_DIM + key) * 4
                d4 = ld_shared_f32x4(d0 + offset)
                k4 = ld_shared_f32x4(k0 + offset)
                v_low, v_high = r_v[j, base_row], r_v[j, base_row + 64]
                h0, h1 = self.apply_pair((h0, h1), (d4[0], d4[1]), (k4[0], k4[1]), v_low)
                h2, h3 = self.apply_pair((h2, h3), (d4[2], d4[3]), (k4[2], k4[3]), v_low)
                h4, h5 = self.apply_pair((h4, h5), (d4[0], d4[1]), (k4[0], k4[1]), v_high)
                h6, h7 = self.apply_pair((h6, h7), (d4[2], d4[3]), (k4[2], k4[3]), v_high)
            history[0][c] = [h0, h1, h2, h3]
            history[1][c] = [h4, h5, h6, h7]
            if fold:
                for r in cutlass.range_constexpr(ROWS):
                    offset = (base_row + 64 * r) * HEAD_DIM + key
                    st_global_f32x4(state0 + Int64(offset) * 4, history[r][c])

    @cute.kernel
    def kernel(self, op):
        R, T = self.size, self.tokens
        cta, _, _ = cute.arch.block_idx()
        requests = op.output.shape[0] // T
        total = self.heads * requests
        first = (cta * total) // self.ctas
        last = ((cta + 1) * total) // self.ctas

        smem = cutlass.memory.SmemAllocator()
        staged = smem_tensor(smem, Float32, (ROWS * KCHUNKS, THREADS, 4), align=128)
        s_q = smem_tensor(smem, Float32, (T, HEAD_DIM))
        s_k = smem_tensor(smem, Float32, (T, HEAD_DIM))
        s_v = smem_tensor(smem, Float32, (T, HEAD_DIM))
        s_o = smem_tensor(smem, Float32, (T, HEAD_DIM))
        s_decay = smem_tensor(smem, Float32, (8, HEAD_DIM))
        s_beta = smem_tensor(smem, Float32, (8,))
        smem_tensor(smem, BFloat16, (T, HEAD_DIM), align=16)  # unused (as KdaWide's)
        sums = smem_tensor(smem, Float32, (T, 2, 8))
        out_sums = smem_tensor(smem, Float32, (T, 4))
        r_k = smem_tensor(smem, Float32, (R, HEAD_DIM))
        r_d = smem_tensor(smem, Float32, (R, HEAD_DIM))
        r_vs = smem_tensor(smem, Float32, (2, R, HEAD_DIM))  # by item parity
        r_sums = smem_tensor(smem, Float32, (R, 4))
        r_raw = smem_tensor(smem, BFloat16, (R, 2 * HEAD_DIM), align=16)
        words = 2 * T * HEAD_DIM + 2 * T * R * 4 + T * 4
        suffix = smem_tensor(smem, Float32, (words,))
        s_dk = cute.make_tensor(
            suffix.iterator, cute.make_layout((T, HEAD_DIM), stride=(HEAD_DIM, 1))
        )
        s_dq = cute.make_tensor(
            suffix.iterator + T * HEAD_DIM, cute.make_layout((T, HEAD_DIM), stride=(HEAD_DIM, 1))
        )
        p_alpha = cute.make_tensor(
            suffix.iterator + 2 * T * HEAD_DIM, cute.make_layout((T, R, 4), stride=(4 * R, 4, 1))
        )
        p_gamma = cute.make_tensor(
            suffix.iterator + 2 * T * HEAD_DIM + T * R * 4,
            cute.make_layout((T, R, 4), stride=(4 * R, 4, 1)),
        )
        p_kq = cute.make_tensor(
            suffix.iterator + 2 * T * HEAD_DIM + 2 * T * R * 4,
            cute.make_layout((T, 4), stride=(4, 1)),
        )
        parts = (p_alpha, p_gamma, p_kq, s_dk, s_dq)

        # The first item's entries and page: predecessor-independent, before the PDL wait.
        self.stage_item(op, staged, r_raw, self.ring_half(r_vs, 0), first, last)
        item = first
        while item < last:
            tid, _, _ = cute.arch.thread_idx()
            lane, warp = tid % 32, tid // 32
            channel, section = tid % 128, tid // 128
            dim = self.heads * HEAD_DIM
            parity = (item - first) % 2
            head, request, slot = self.item_of(op, item)
            token = request * T
            offset = Int32(0)
            if cutlass.const_expr(T > 1):
                offset = Int32(op.accepted[request]) - 1
            if slot <= 0:
                cute.arch.griddepcontrol_wait()
                if tid < HEAD_DIM:
                    for t in cutlass.range_constexpr(T):
                        op.output[token + t, head * HEAD_DIM + tid] = BFloat16(0.0)
                cute.arch.griddepcontrol_launch_dependents()
                cute.arch.barrier()
                self.stage_item(op, staged, r_raw, self.ring_half(r_vs, 1 - parity), item + 1, last)
            else:
                ring = (r_k, r_d, self.ring_half(r_vs, parity), r_sums)
                held = self.held_entries(op, slot, head, request)
                fold = held + T > R
                entry = held
                if fold:
                    entry = Int32(0)
                parts_in = (2 * section, 1)  # s = 0: q or v; s = 1: k (threads 0-127)
                columns = [parts_in[s] * dim + head * HEAD_DIM + channel for s in range(2)]
                taps, coeff, bias = self.conv_operands(
                    op.conv_state, op.conv_weight, op.conv_bias, slot, offset, columns,
                    parts_in, [head * HEAD_DIM + channel] * 2,
                )  # fmt: skip
                nw = Float32(op.norm_weight[channel])
                a, dt, weights = self.gate_operands(op, head, warp, lane)
                inputs, activations = self.read_inputs(op, s_beta, columns, token, head)

                records = ring_entry(op.ring_kg, slot, entry, self.heads, R)
                self.conv_phase_unrecorded(
                    taps, coeff, bias, inputs, (s_q, s_k, s_v), sums, records, request, head
                )
                self.write_conv(op.conv_state, slot, head, taps, inputs)
                gate_op = SimpleNamespace(
                    f_a=op.f_a, f_b=op.f_b, a_log=op.a_log, dt_bias=op.dt_bias,
                    lower_bound=op.lower_bound, kg_records=records,
                )  # fmt: skip
                # The item's entries have landed (its page may not have): every thread's
                # copies, before the new records go over entry 0 of a folding ring.
                cute.arch.cp_async_wait_group(1)
                cute.arch.barrier()
                self.write_k_record(s_k, records, request, head)
                self.gate_phase(gate_op, weights, activations, a, dt, s_decay, request, head)
                self.stage_entries(op, held, ring, r_raw, head)
                cute.arch.barrier()
                self.normalize_qk(s_q, s_k, sums, op.scale)
                self.normalize_entries(r_k, r_sums, held)
                cute.arch.barrier()
                self.suffix_phase(ring, (s_q, s_k, s_decay), parts, entry)

                # The page into registers (each thread its own slots), then the buffers are
                # free for the next item: its entries (the other parity's v_new, the bf16
                # buffer read by stage_entries above) and page stream in from here on.
                cute.arch.cp_async_wait_group(0)
                history = self.load_history(staged)
                cute.arch.barrier()
                self.stage_item(op, staged, r_raw, self.ring_half(r_vs, 1 - parity), item + 1, last)
                self.fold_history(op.state, history, ring, slot, head, fold)
                cute.arch.barrier()  # the fold's reads of r_v before replay_rows writes it
                self.replay_rows(op, history, ring, parts, s_v, s_beta, s_o, entry, slot, head)
                cute.arch.barrier()

                if section == 0:
                    self.norm_sums(s_o, out_sums)
                cute.arch.barrier()
                self.write_output(s_o, out_sums, op.gate, nw, op.eps, op.output, token, head)
                if tid == 0:  # every thread read the counters before the barriers above
                    if cutlass.const_expr(T == 1):  # committed at once
                        op.ring_length[Int64(slot), head, 0] = entry + 1
                        op.ring_length[Int64(slot), head, 1] = Int32(0)
                    else:  # pending until the next step's accepted
                        op.ring_length[Int64(slot), head, 0] = entry
                        op.ring_length[Int64(slot), head, 1] = Int32(T)
            item = item + 1
