"""KdaReplay: one replay decode (T = 1) or verify (T = 2..8) step per (request, head) item,
the device side of ``kda.replay_decode`` (math: ``kda.reference.replay_decode``).

KdaWide's thread layout, prologue (conv, gate, normalised q and k) and epilogue (gated
RMSNorm) are reused as they are; the recurrence is replaced by the replay math. Per item,
with ``n`` the entries the step keeps (``ring.length[slot, head]``: the committed ones plus
the pending ones it commits, one at T = 1 (token 0 of a verify step before: the conv
window's offset 0), ``accepted[b]`` in a verify step):

- prefetches the checkpoint page into L2 at the start (one bulk prefetch) and reads it
  where it lies, late (the fold, then per token ``replay_rows``, two chunks of both rows in
  flight at a time): no page in shared memory, so three CTAs fit an SM; reads the entries
  ``j < n`` (k_j, raw_g_j bf16, v_new_j fp32, ~1 KB each) by cp.async into shared (awaited
  before the gate phase); decays ``d_j`` with ``kda.kernels.device.decay`` (the per-step kernels'
  function), ``k^_j`` as KdaRecover;
- a full ring (``n + T > R``) is folded first: each thread applies the R staged entries
  (neutral past ``n``) to its 64 page values (``S * d_j`` then ``fma(k^_j, v_j, .)``,
  KdaRecover's order) and writes them back to the page (each thread reads back only what it
  wrote), and the step continues with ``n = 0``;
- per token t: suffix products ``P_j`` newest first (this step's earlier tokens, then the
  ring's entries; never divided), ``alpha_j = (P_j k^_j) . k^``, ``gamma_j = (P_j k^_j)
  . q^`` (threads 0-127 and 128-255), ``D k^`` and ``D q^``;
- per token and value row (the page re-read per token, not held in registers):
  ``s_k = C (D k^) + sum_j v_j alpha_j``, ``v_new = (v - s_k) beta``,
  ``o = s_q + v_new (k^ . q^)`` with ``s_q = C (D q^) + sum_j v_j gamma_j``;
- writes ring entries ``n .. n + T - 1`` (v_new fp32; k and raw_g bf16 through KdaWide's
  record writes), the head's counters (``(n + 1, 0)``; a verify step's ``(n, T)``: its
  entries pending), the conv page and the output. No page write unless folding.

Padding (slot <= 0): zero output rows, nothing else read or written. PDL as KdaWide: the
ring, counters and conv window are read, and the state page prefetched into L2, before
``griddepcontrol.wait`` (the kernel right before must not write them; the page itself is
read after the wait); gate mode 3 may re-read f_a rows after the release.

bf16 checkpoint pages (``state_dtype``): read widened to fp32 wherever the page is read
(the fold, ``replay_rows``); a fold rounds its page to nearest-even once when it writes it
back, and the step's tokens then read the page as stored, as the reference does.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm.cuteutil import (
    cp_async_16,
    ld_shared_f32x4,
    prefetch_l2_bulk,
    smem_tensor,
    warp_sum,
    xor_sum,
)

from ..dispatch import REPLAY_CTAS_PER_SM
from ..operands import MAX_RING, MIN_RING, ReplayKernelOperands
from . import device as dev
from .device import HEAD_DIM, KCHUNKS, LANES, ROWS, THREADS
from .wide import KdaWide


def st_shared_f32x4(shared: Int32, values):
    """Weak 16-byte shared store of four fp32."""
    cute.arch.inline_ptx(
        "st.shared.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[shared, *[Float32(v) for v in values]],
    )


@cute.jit
def ring_entry(ring_kg, slot, entry, heads: cutlass.Constexpr, size: cutlass.Constexpr):
    """Ring entry ``entry`` of ``slot`` as the record tensor KdaWide's phases write:
    ``[request, head, t, column]`` (request stride 0) is ``ring_kg[slot, entry + t, head,
    column]`` (``ring_kg`` contiguous [S, R, H, 256])."""
    start = ring_kg.iterator + cute.crd2idx((Int64(slot), entry, 0, 0), ring_kg.layout)
    width = 2 * HEAD_DIM
    layout = cute.make_layout((1, heads, size, width), stride=(0, width, heads * width, 1))
    return cute.make_tensor(start, layout)


FOLD_CHUNKS = 4  # fold_page's key chunks (of both rows) in flight at a time
PAIRS = 2  # pairs of partial sums per row and vector (two vectors: half KdaWide's registers)


class KdaReplay(KdaWide):
    """``heads`` H, ring ``size`` R (2..16), ``tokens`` T (1: decode, slots [B]; 2..8:
    verify, slots [B, >= T] and accepted [B]; T <= R), ``gate_mode`` / ``has_bias`` /
    ``arch`` / ``pdl`` / ``state_dtype`` / ``gate_form`` as KdaWide's."""

    def __init__(
        self,
        heads,
        size,
        tokens=1,
        gate_mode=3,
        has_bias=False,
        *,
        arch="sm_90a",
        pdl=False,
        state_dtype="fp32",
        gate_form="lower-bound",
    ):
        super().__init__(
            heads,
            tokens,
            False,
            gate_mode,
            has_bias,
            0,
            arch=arch,
            pdl=pdl,
            state_dtype=state_dtype,
            gate_form=gate_form,
        )
        if not MIN_RING <= size <= MAX_RING or tokens > size:
            raise ValueError(f"size must be in {MIN_RING}..{MAX_RING} and >= tokens; got {size}")
        self.size = size
        # KdaWide's phases write the k and raw-gate records: here into the ring entry.
        self.record = True

    @cute.jit
    def __call__(self, op: ReplayKernelOperands, stream):
        """Launch on ``stream`` (``op``: ``kda.operands.ReplayKernelOperands``)."""
        self.launch_grid(self.kernel(op), op.output.shape[0] // self.tokens, stream)

    # KdaWide's grid, more CTAs per SM (no staged page: ~15 KB of shared memory; 80
    # registers)
    ctas_per_sm = REPLAY_CTAS_PER_SM

    # ---------------------------------------------------------------- device side
    @cute.jit
    def copy_entries(self, op, r_raw, r_v, held, slot, head):
        """cp.async of the entries j < ``held`` into shared, 16 bytes a thread at a time:
        k and raw_g (bf16) into ``r_raw``, v_new (fp32) into ``r_v``; no registers held."""
        tid, _, _ = cute.arch.thread_idx()
        raw0, v0 = Int32(r_raw.iterator.toint()), Int32(r_v.iterator.toint())
        kg0, vg0 = Int64(op.ring_kg.iterator.toint()), Int64(op.ring_v.iterator.toint())
        chunks = 64 * self.size  # 32 of k / raw_g and 32 of v_new per entry
        for i in cutlass.range_constexpr((chunks + THREADS - 1) // THREADS):
            index = i * THREADS + tid
            j, part = index // 64, index % 64
            if (index < chunks) & (j < held):
                if part < 32:
                    at = cute.crd2idx((Int64(slot), j, head, 0), op.ring_kg.layout)
                    cp_async_16(raw0 + (j * 2 * HEAD_DIM) * 2 + part * 16, kg0 + at * 2 + part * 16)
                else:
                    at = cute.crd2idx((Int64(slot), j, head, 0), op.ring_v.layout)
                    cp_async_16(
                        v0 + (j * HEAD_DIM) * 4 + (part - 32) * 16, vg0 + at * 4 + (part - 32) * 16
                    )

    @cute.jit
    def stage_entries(self, op, held, ring, r_raw, head):
        """The copied entries j < ``held`` decoded in shared (``dev.stage_records``): k as
        fp32 with per-warp sums of k^2, the decay; the neutral entry (k +0, decay 1, v_new
        +0) past ``held``."""
        entry = lambda j, c: r_raw[j, c]  # noqa: E731
        gate = dict(keys_past=False, softplus_gate=self.softplus_gate)
        dev.stage_records(op, head, held, self.size, ring, entry, **gate)

    def conv_phase_unrecorded(self, *args):
        """KdaWide's conv phase without its k record (trace time): the record is written
        after the ring's copies landed (``write_k_record``), as a folding ring's entry 0
        may still be in flight to shared before that."""
        self.record = False
        try:
            self.conv_phase(*args)
        finally:
            self.record = True

    def write_k_record(self, s_k, records, request, head):
        """The k record (bf16 of the un-normalised k, exact) from ``s_k`` (threads 0-127)."""

        def write(t, channel):
            records[request, head, t, channel] = BFloat16(s_k[t, channel])

        self.per_channel(write)

    @cute.jit
    def fold_page(self, state, ring, slot, head):
        """Apply the R staged entries to the thread's page values where they lie and write
        them back: FOLD_CHUNKS key chunks of both rows at a time (their loads all in flight
        before the first entry is applied), the entries unrolled."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        r_k, r_d, r_v, _ = ring
        k0, d0 = Int32(r_k.iterator.toint()), Int32(r_d.iterator.toint())
        size = self.state_bytes
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        state0 = Int64(state.iterator.toint()) + page * size
        for group in cutlass.range(KCHUNKS // FOLD_CHUNKS, unroll=1):
            keys = [4 * (lane_in + LANES * (FOLD_CHUNKS * group + g)) for g in range(FOLD_CHUNKS)]
            rows = []  # per chunk: (address, values) of row base_row, then of base_row + 64
            for g in cutlass.range_constexpr(FOLD_CHUNKS):
                for r in cutlass.range_constexpr(2):
                    at = state0 + Int64((base_row + 64 * r) * HEAD_DIM + keys[g]) * size
                    rows.append((at, list(dev.ld_global_keys4(at, self.bf16_state))))
            for j in cutlass.range_constexpr(self.size):
                v_row = (r_v[j, base_row], r_v[j, base_row + 64])
                for g in cutlass.range_constexpr(FOLD_CHUNKS):
                    offset = (j * HEAD_DIM + keys[g]) * 4
                    d4 = ld_shared_f32x4(d0 + offset)
                    k4 = ld_shared_f32x4(k0 + offset)
                    for r in cutlass.range_constexpr(2):
                        dev.apply_record(rows[2 * g + r][1], d4, k4, v_row[r], self.packed)
            for at, h in rows:  # a bf16 page rounded here, once per fold
                dev.st_global_keys4(at, tuple(h), self.bf16_state)

    @cute.jit
    def suffix_chain(self, ring, shared, t, x, entries, partials, scaled):
        """Token ``t``'s suffix products at the thread's key, newest entry first (this
        step's tokens t - 1 .. 0 at entries ``entries + t'``, then the ring's): per entry j,
        the warp's partial sum of ``(P_j k^_j) x`` into ``partials[t, j, warp]``; then
        ``scaled[t] = D x`` (``x``: this thread's element of token t's k^ or q^)."""
        tid, _, _ = cute.arch.thread_idx()
        lane, warp = tid % 32, (tid // 32) % 4  # the warp within the thread's half
        channel = tid % 128
        r_k, r_d, _, _ = ring
        s_k, s_decay = shared
        prod = s_decay[t, channel]
        # Unrolled, the stores last: the warp sums are independent (in flight together);
        # the product chain makes the same multiplications in the same order (the ring's
        # slots past ``entries`` multiply by 1.0, exactly).
        mine = []
        for u in cutlass.range_constexpr(t):
            before = t - 1 - u
            mine.append(warp_sum((prod * s_k[before, channel]) * x))
            prod = prod * s_decay[before, channel]
        ring_parts = []
        for i in cutlass.range_constexpr(self.size):
            j = self.size - 1 - i
            ring_parts.append(warp_sum((prod * r_k[j, channel]) * x))
            prod = prod * Float32(cutlass.select_(j < entries, r_d[j, channel], Float32(1.0)))
        if lane == 0:
            # every slot (those past ``entries`` unread), then this step's tokens over them
            for i in cutlass.range_constexpr(self.size):
                partials[t, self.size - 1 - i, warp] = ring_parts[i]
            for u in cutlass.range_constexpr(t):
                partials[t, entries + t - 1 - u, warp] = mine[u]
        scaled[t, channel] = prod * x

    @cute.jit
    def suffix_phase(self, ring, shared, parts, entries):
        """Per token: alpha partials and D k^ (threads 0-127, with the k^ . q^ partials),
        gamma partials and D q^ (threads 128-255)."""
        tid, _, _ = cute.arch.thread_idx()
        lane, warp, channel, section = dev.thread_layout(tid)
        s_q, s_k, s_decay = shared
        p_alpha, p_gamma, p_kq, s_dk, s_dq = parts
        if section == 0:
            for t in cutlass.range_constexpr(self.tokens):
                k = s_k[t, channel]
                kq = warp_sum(k * s_q[t, channel])
                if lane == 0:
                    p_kq[t, warp] = kq
                self.suffix_chain(ring, (s_k, s_decay), t, k, entries, p_alpha, s_dk)
        else:
            for t in cutlass.range_constexpr(self.tokens):
                q = s_q[t, channel]
                self.suffix_chain(ring, (s_k, s_decay), t, q, entries, p_gamma, s_dq)

    def page_source(self, op, staged, slot, head):
        """Trace-time hook of ``replay_rows``: where the page comes from (here its global
        address: the page is read where it lies, L2-prefetched at the item's start)."""
        page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
        return Int64(op.state.iterator.toint()) + page * self.state_bytes

    def page_chunk(self, source, i, c, tid):
        """Trace-time hook: chunk ``c`` of the thread's row ``i`` (four fp32; a bf16 page's
        widened) of the page (a weak load: a fold earlier in the item wrote it, from this
        thread)."""
        base_row, lane_in = tid // LANES, tid % LANES
        offset = (base_row + 64 * i) * HEAD_DIM + 4 * (lane_in + LANES * c)
        return dev.ld_global_keys4(source + Int64(offset) * self.state_bytes, self.bf16_state)

    def fma_into(self, acc, j, pair, x):
        """Trace-time helper: ``acc``'s pair ``j`` += ``pair * x`` (two keys, fma2)."""
        out = dev.fma2(pair, (x[0], x[1]), (acc[2 * j], acc[2 * j + 1]), self.packed)
        acc[2 * j], acc[2 * j + 1] = out[0], out[1]

    @cute.jit
    def replay_rows(self, op, staged, ring, parts, s_v, s_beta, s_o, entries, slot, head):
        """Per token and value row: C (D k^) and C (D q^) from the page (re-read per token
        where it lies, not held in registers: ``page_chunk``), the
        ring's and this step's earlier tokens' terms, v_new (into ring entry ``entries +
        t``, and the staged entry for the later tokens) and o (bf16, into ``s_o``)."""
        tid, _, _ = cute.arch.thread_idx()
        base_row, lane_in = tid // LANES, tid % LANES
        _, _, r_v, _ = ring
        p_alpha, p_gamma, p_kq, s_dk, s_dq = parts
        dk0, dq0 = Int32(s_dk.iterator.toint()), Int32(s_dq.iterator.toint())
        alpha0, gamma0 = Int32(p_alpha.iterator.toint()), Int32(p_gamma.iterator.toint())
        kq0 = Int32(p_kq.iterator.toint())
        source = self.page_source(op, staged, slot, head)
        rows = tuple(range(ROWS))
        for t in cutlass.range_constexpr(self.tokens):
            sk = [[Float32(0.0)] * (2 * PAIRS) for _ in rows]
            sq = [[Float32(0.0)] * (2 * PAIRS) for _ in rows]
            # Chunks in pairs: both rows' chunks of a pair are read before their products
            # (four loads in flight), the products in the same order as chunk by chunk.
            for c2 in cutlass.range_constexpr(KCHUNKS // 2):
                chunks = [
                    [self.page_chunk(source, i, 2 * c2 + d, tid) for i in range(ROWS)]
                    for d in range(2)
                ]
                for d in cutlass.range_constexpr(2):
                    c = 2 * c2 + d
                    offset = (t * HEAD_DIM + 4 * (lane_in + LANES * c)) * 4
                    dk4 = ld_shared_f32x4(dk0 + offset)
                    dq4 = ld_shared_f32x4(dq0 + offset)
                    for i in cutlass.range_constexpr(ROWS):
                        h = chunks[d][i]
                        for p in cutlass.range_constexpr(2):
                            j = (2 * c + p) % PAIRS
                            pair = (h[2 * p], h[2 * p + 1])
                            self.fma_into(sk[i], j, pair, dk4[2 * p : 2 * p + 2])
                            self.fma_into(sq[i], j, pair, dq4[2 * p : 2 * p + 2])
            kq = dev.quad_sum(ld_shared_f32x4(kq0 + t * 16))
            beta_t = s_beta[t]
            s_k = [xor_sum(dev.tree_sum(sk[i]), LANES) for i in rows]
            s_q = [xor_sum(dev.tree_sum(sq[i]), LANES) for i in rows]
            # The ring's entries, then this step's earlier tokens (entries + t' < R):
            # unrolled over R, the entries past them skipped by predicate. alpha_j and
            # gamma_j (the four warps' partials: one 16-byte load each) once for both rows.
            for j in cutlass.range_constexpr(self.size):
                at = ((t * self.size + j) * 4) * 4
                alpha = dev.quad_sum(ld_shared_f32x4(alpha0 + at))
                gamma = dev.quad_sum(ld_shared_f32x4(gamma0 + at))
                live = j < entries + t
                for i, r in enumerate(rows):
                    v_j = r_v[j, base_row + 64 * r]
                    s_k[i] = Float32(
                        cutlass.select_(live, cute.math.fma(v_j, alpha, s_k[i]), s_k[i])
                    )
                    s_q[i] = Float32(
                        cutlass.select_(live, cute.math.fma(v_j, gamma, s_q[i]), s_q[i])
                    )
            for i, r in enumerate(rows):
                row = base_row + 64 * r
                v_new = (s_v[t, row] - s_k[i]) * beta_t
                o = cute.math.fma(v_new, kq, s_q[i])
                # Every lane of the row holds the same v_new: each stores it (the staged ring
                # entry, free after a fold or past the held entries) and reads back its own.
                r_v[entries + t, row] = v_new
                if lane_in == 0:
                    op.ring_v[Int64(slot), entries + t, head, row] = v_new
                    s_o[t, row] = dev.to_bf16_f32(o)

    @cute.kernel
    def kernel(self, op):
        R, T = self.size, self.tokens
        tid, _, _ = cute.arch.thread_idx()
        head, request, _ = cute.arch.block_idx()
        thread = dev.thread_layout(tid)  # (lane, warp, channel, section)
        section = thread[3]
        token = request * T
        # The state and conv slot; the conv window's offset (a verify step's: accepted - 1).
        if cutlass.const_expr(T == 1):
            slot, offset = Int32(op.slots[request]), Int32(0)
        else:
            slot, offset = Int32(op.slots[request, 0]), Int32(op.accepted[request]) - 1
        if slot <= 0:
            self.write_padding(op.output, token, head, tid, tid, HEAD_DIM)
        else:
            smem = cutlass.memory.SmemAllocator()
            # q, k, v, o of the item's tokens
            s_q, s_k, s_v, s_o = [smem_tensor(smem, Float32, (T, HEAD_DIM)) for _ in range(4)]
            s_decay = smem_tensor(smem, Float32, (8, HEAD_DIM))
            s_beta = smem_tensor(smem, Float32, (8,))
            sums = smem_tensor(smem, Float32, (T, 2, 8))
            out_sums = smem_tensor(smem, Float32, (T, 4))
            r_k = smem_tensor(smem, Float32, (R, HEAD_DIM))
            r_d = smem_tensor(smem, Float32, (R, HEAD_DIM))
            r_v = smem_tensor(smem, Float32, (R, HEAD_DIM))
            r_sums = smem_tensor(smem, Float32, (R, 4))
            # The copied entries (bf16 k / raw gate), dead after stage_entries (barrier
            # before normalisation), share their space with the suffix phase's outputs
            # (written after the next barrier).
            words = 2 * T * HEAD_DIM + 2 * T * R * 4 + T * 4
            union = smem_tensor(smem, Float32, (max(R * HEAD_DIM, words),))
            r_raw = cute.make_tensor(
                cute.recast_ptr(union.iterator, dtype=BFloat16),
                cute.make_layout((R, 2 * HEAD_DIM), stride=(2 * HEAD_DIM, 1)),
            )
            s_dk = cute.make_tensor(
                union.iterator, cute.make_layout((T, HEAD_DIM), stride=(HEAD_DIM, 1))
            )
            s_dq = cute.make_tensor(
                union.iterator + T * HEAD_DIM,
                cute.make_layout((T, HEAD_DIM), stride=(HEAD_DIM, 1)),
            )
            p_alpha = cute.make_tensor(
                union.iterator + 2 * T * HEAD_DIM,
                cute.make_layout((T, R, 4), stride=(4 * R, 4, 1)),
            )
            p_gamma = cute.make_tensor(
                union.iterator + 2 * T * HEAD_DIM + T * R * 4,
                cute.make_layout((T, R, 4), stride=(4 * R, 4, 1)),
            )
            p_kq = cute.make_tensor(
                union.iterator + 2 * T * HEAD_DIM + 2 * T * R * 4,
                cute.make_layout((T, 4), stride=(4, 1)),
            )
            ring = (r_k, r_d, r_v, r_sums)
            parts = (p_alpha, p_gamma, p_kq, s_dk, s_dq)

            # Entries held: the committed ones and the pending ones this step commits (one
            # at T = 1; accepted[b] of them in a verify step; the rest are dropped).
            pending = Int32(op.ring_length[Int64(slot), head, 1])
            accepted = Int32(1)
            if cutlass.const_expr(T > 1):
                accepted = Int32(op.accepted[request])
            if accepted < pending:
                pending = accepted
            held = Int32(op.ring_length[Int64(slot), head, 0]) + pending
            fold = held + T > R
            entry = held
            if fold:
                entry = Int32(0)
            # Predecessor-independent, all in flight at once: the page into L2 (read where
            # it lies by the fold and replay_rows), the ring's entries (cp.async, awaited
            # before the gate phase), the conv window and the weights.
            if tid == 0:
                page = (Int64(slot) * self.heads + head) * (HEAD_DIM * HEAD_DIM)
                address = Int64(op.state.iterator.toint()) + page * self.state_bytes
                prefetch_l2_bulk(address, self.page_bytes)
            self.copy_entries(op, r_raw, r_v, held, slot, head)
            cute.arch.cp_async_commit_group()
            conv, nw, gate = self.item_operands(op, thread, slot, offset, s_beta, token, head)

            records = ring_entry(op.ring_kg, slot, entry, self.heads, R)
            self.conv_phase_unrecorded(*conv, (s_q, s_k, s_v), sums, records, request, head)
            self.write_conv(op.conv_state, slot, head, conv[0], conv[3])
            gate_op = SimpleNamespace(
                f_a=op.f_a,
                f_b=op.f_b,
                a_log=op.a_log,
                dt_bias=op.dt_bias,
                lower_bound=op.lower_bound,
                kg_records=records,
            )
            # The ring's entries have landed (every thread's copies: before the new k and
            # raw-gate records go over entry 0 of a folding ring).
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            self.write_k_record(s_k, records, request, head)
            self.gate_phase(gate_op, *gate, s_decay, request, head)
            self.stage_entries(op, held, ring, r_raw, head)
            cute.arch.barrier()
            self.normalize_qk(s_q, s_k, sums, op.scale)
            dev.normalize_rows(r_k, r_sums, held, self.size)
            cute.arch.barrier()
            self.suffix_phase(ring, (s_q, s_k, s_decay), parts, entry)

            if fold:
                self.fold_page(op.state, ring, slot, head)
            cute.arch.barrier()
            self.replay_rows(op, None, ring, parts, s_v, s_beta, s_o, entry, slot, head)
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
