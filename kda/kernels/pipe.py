"""KdaPipe: one persistent CTA per SM, warp-specialised, the state pages ahead.

KdaStream's CTA runs an item's phases one after the other (inputs, conv, gate, norms,
recurrence, output) with one page staged ahead; at two CTAs per SM an item took ~11 us
where the SM's share of the copy bandwidth allows ~8. KdaPipe splits the CTA's 512
threads into two groups that work on different items at once:

- the *prep* group (threads 0-255, KdaWide's thread layout): for item n + 1 the conv +
  SiLU, the raw gate (mma.sync; gate mode 3's undecided values recomputed four per round),
  the decays, the sums of q^2 and k^2, sigmoid(beta) and the sigmoid of the output gate,
  into vector slot ``(n + 1) % SLOTS`` of shared memory. Nothing on its path waits on
  global memory: the item's conv window, input rows, f_a rows and beta word were cp.asynced
  one item ahead (KdaStream's staging, f_a and beta parity-buffered), its head's f_b rows
  (16-byte granules XOR-swizzled by row: conflict-free mma fragments and exact-dot rows),
  conv weights, bias, dt_bias and a_log sit in a head cache refilled when a CTA's range
  reaches the next head, and the item slots are read two items ahead. At T <= 4 the raw
  gates of up to 8 / T items of one head are one mma tile (``gate_batch``: its eight token
  columns, at the batch's first item), each item's decays copied from it into its slot
  (not on fp32 pages at T = 1, ``batches_gate``: there each item's own tile);
- the *state* group (threads 256-511, KdaWide's layout on ``tid - 256``): item n's page
  from its shared stage into registers, q and k normalised, the delta rule
  (``dev.delta_rule``, KdaStream's streamed store), the gated RMSNorm and the output row
  (at T >= 3 the prep group writes the output: ``prep_output``, ``flush_outputs``);
  each thread cp.asyncs the page of item n + stages into the stage it just emptied, so
  ``stages - 1`` pages are in flight besides the one in registers. fp32 pages: two stages
  of thread-private 16-byte slots (no barrier). bf16 pages (``state_dtype="bf16"``,
  compile time): 32 KB stages, as many as fit (``pipe_layout``: four at T <= 2), staged
  as KdaWide's bf16 page (the 16 bytes of a row's threads 2p and 2p + 1 copied by one of
  the pair: half the cp.asyncs), so each pair meets at a warp barrier (``bar.warp.sync``,
  the pair is one warp's) after its wait (the partner's copies landed) and after reading
  its stage (before re-staging into it); widened to fp32 as read, rounded to nearest-even
  once per stored page (``cvt.rn.bf16x2.f32``, KdaStream's chunk writer).

The groups meet at named barriers only: ``FULL[s]`` (prep arrives, state syncs) when slot s
holds an item's vectors, ``EMPTY[s]`` (state arrives, prep syncs) when the state group is
done with them (three slots where they fit: the prep group may run two items ahead); each
group has its own barrier for its internal phases. Per item the math is KdaWide's call for
call (same rounding points and fp32 order: the same raw gates, q, k, v, decays, state and
outputs bit for bit as KdaStream). Padding items (slot <= 0) write zero output rows only.
PDL: the first pages, the head cache and the conv window are read before
``griddepcontrol.wait``, all else after it. No record mode (the launcher runs KdaStream
there). Each group divides by ``requests`` once, then steps (head, request) (``pipe_index``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm.cuteutil import (
    launch,
    ld_shared_b32x2,
    ld_shared_f32x4,
    smem_tensor,
    warp_sum,
)

from . import device as dev
from .device import HEAD_DIM, KCHUNKS, ROWS, THREADS
from .pipe_index import first_item, next_item
from .pipe_prep import BATCH_TOKENS, GATE_COLUMNS, PipePrep, batches_gate, cp_async_4
from .stream import (
    KdaStream,
    fresh_index,
    fresh_tid,
)

PIPE_THREADS = 2 * THREADS  # the prep group, then the state group
SMEM_LIMIT = 227 * 1024  # one CTA per SM (sm_90 / sm_100)
PAGE = ROWS * KCHUNKS * THREADS * 16  # one fp32 state page, bytes (bf16: half)
# from this T on the prep group writes the output (``prep_output``): the state group bounds
PREP_OUTPUT_TOKENS = 3
# named barriers (0 is __syncthreads)
PREP_BAR, STATE_BAR, FULL_BAR, EMPTY_BAR = 1, 2, 3, 6  # FULL / EMPTY: + slot (0 .. 2)

STAGES = 2  # fp32 page stages of the state group (three do not fit beside the head cache)
MAX_STAGES = 4  # bf16 pages: up to four 32 KB stages
# f_b rows of a head (bf16), conv weights and bias (at most fp32), dt_bias, a_log
HEAD_CACHE = HEAD_DIM * HEAD_DIM * 2 + 15 * HEAD_DIM * 4 + HEAD_DIM * 4 + 16


def pipe_smem_bytes(
    tokens, window, conv_bytes, conv_dim_first, slots=2, stages=STAGES, state_bytes=4
):
    """Shared memory of one KdaPipe CTA with ``slots`` vector slots and ``stages`` page
    stages of ``state_bytes`` per element (bytes, with 1 KB for alignment)."""
    conv = 3 * HEAD_DIM * (window if conv_dim_first else 3) * conv_bytes
    inputs = 6 * tokens * HEAD_DIM * 2 + 64  # x (3 rows), the output gate, f_a twice; beta
    # per slot: q, k, v, o, sigmoid(gate), decays (T rows with gate batches, else the
    # tile's 8), beta, slot, sums of q^2 / k^2
    batched = batches_gate(tokens, state_bytes)
    decays = tokens if batched else 8
    vectors = slots * ((5 * tokens + decays) * HEAD_DIM * 4 + 36 + tokens * 64)
    out_sums = tokens * 16
    # a gate batch's f_a rows (bf16) and its decays (fp32)
    batch = GATE_COLUMNS * HEAD_DIM * (2 + 4) if batched else 0
    pages = stages * PAGE * state_bytes // 4
    return pages + HEAD_CACHE + conv + inputs + vectors + out_sums + batch + 1024


def pipe_layout(tokens, window, conv_bytes, conv_dim_first, state_bytes=4):
    """(page stages, vector slots) that fit: the most stages (fp32: 2; bf16: up to
    ``MAX_STAGES``), then 3 slots, else 2; (0, 0): KdaPipe does not fit."""
    most = STAGES if state_bytes == 4 else MAX_STAGES
    for stages in range(most, 1, -1):
        for slots in (3, 2):
            need = pipe_smem_bytes(
                tokens, window, conv_bytes, conv_dim_first, slots, stages, state_bytes
            )
            if need <= SMEM_LIMIT:
                return stages, slots
    return 0, 0


def local_tid():
    """The thread's index within its group (``%tid.x`` & 255, read per use)."""
    return fresh_tid() & Int32(THREADS - 1)


class KdaPipe(PipePrep, KdaStream):
    """KdaStream's operands and semantics (no record mode; fp32 or bf16 pages,
    ``state_dtype``); ``ctas`` persistent CTAs (one per SM); ``conv_bytes``: the conv
    cache's element size (its window's share of shared memory)."""

    # gate mode 3: undecided raw gates settled four per round, their rows read from shared
    # memory (``shared_rows``)
    settle_batch = 4
    prep_barrier = PREP_BAR

    def __init__(
        self,
        heads,
        tokens,
        gate_mode,
        has_bias,
        conv_dim_first,
        window,
        ctas,
        *,
        arch="sm_90a",
        pdl=False,
        conv_bytes=4,
        state_dtype="fp32",
        gate_form="lower-bound",
    ):
        super().__init__(
            heads,
            tokens,
            False,
            gate_mode,
            has_bias,
            conv_dim_first,
            window,
            ctas,
            arch=arch,
            pdl=pdl,
            state_dtype=state_dtype,
            gate_form=gate_form,
        )
        self.prep_output = tokens >= PREP_OUTPUT_TOKENS
        self.batch_gate = batches_gate(tokens, self.state_bytes)
        layout = pipe_layout(tokens, window, conv_bytes, conv_dim_first, self.state_bytes)
        self.stages, self.slots = layout
        if self.stages == 0:
            need = pipe_smem_bytes(
                tokens, window, conv_bytes, conv_dim_first, state_bytes=self.state_bytes
            )
            raise ValueError(
                f"KdaPipe needs {need} bytes of shared memory for W = {window}, T = {tokens}; "
                f"at most {SMEM_LIMIT} (use kernel='stream' or 'wide')"
            )

    def check_shared_memory(self, tokens, window, conv_dim_first):
        """KdaPipe's budget is its own (one CTA per SM): checked by ``__init__``."""

    def launch_grid(self, call, requests, stream):
        """``ctas`` CTAs of 512 threads, one per SM, all shared memory."""
        launch(call, (self.ctas, 1, 1), (PIPE_THREADS, 1, 1), stream, use_pdl=self.pdl)

    # The state group's helpers on its local thread index (KdaWide's layout on tid - 256).
    def thread_index(self):
        return local_tid()

    @cute.jit
    def load_history(self, staged):
        """The staged page into registers (state group): history[r][c][e] (a bf16 page's
        8-byte chunks widened)."""
        tid = local_tid()
        shared0 = Int32(staged.iterator.toint())
        history = []
        for r in cutlass.range_constexpr(ROWS):
            row = []
            for c in cutlass.range_constexpr(KCHUNKS):
                if cutlass.const_expr(self.bf16_state):
                    shared = shared0 + ((r * KCHUNKS + c) * THREADS + tid) * 8
                    row.append(list(dev.ld_shared_keys4(shared, True)))
                else:
                    shared = shared0 + ((r * KCHUNKS + c) * THREADS + tid) * 16
                    row.append(list(ld_shared_f32x4(shared)))
            history.append(row)
        return history

    def page_head(self, head):
        """``head`` as it is: KdaStream's ``opaque(head)`` in the chunk writer costs KdaPipe
        spills (fp32, T 4: 72 B against 20)."""
        return head

    @cute.jit
    def per_channel(self, body):
        """``body(t, channel)`` per token on the group's threads 0-127."""
        tid = local_tid()
        if tid < HEAD_DIM:
            for t in cutlass.range_constexpr(self.tokens):
                body(t, tid)

    @cute.jit
    def norm_sums(self, s_o, out_sums):
        """Per-warp sums of o^2 (the state group's threads 0-127)."""
        tid = local_tid()
        for t in cutlass.range_constexpr(self.tokens):
            o = s_o[t, tid]
            total = warp_sum(o * o)
            if tid % 32 == 0:
                out_sums[t, tid // 32] = total

    def output_gate(self, gate, token, t, head, channel):
        """sigmoid(output gate), computed by the prep group into the item's slot."""
        return gate[t, channel]

    @cute.jit
    def flush_outputs(self, op, v_o, v_g, v_slot, out_sums, first, count, requests):
        """``prep_output``, after the prep loop: the outputs of the range's last ``slots``
        items."""
        for j in cutlass.range_constexpr(self.slots):
            n = count - self.slots + j
            if n >= 0:
                s = n % self.slots
                cute.arch.barrier(barrier_id=EMPTY_BAR + s, number_of_threads=PIPE_THREADS)
                taken = self.take_output(v_o[s, None, None], v_g[s, None, None], out_sums)
                live = v_slot[s]
                cute.arch.barrier(barrier_id=PREP_BAR, number_of_threads=THREADS)
                self.finish_output(op, taken, out_sums, live, first + n, requests)
                cute.arch.barrier(barrier_id=PREP_BAR, number_of_threads=THREADS)

    # ------------------------------------------------------------------ the prep group
    def item_range(self, total):
        """(first, end) of this CTA's contiguous range of the ``total`` items."""
        cta = fresh_index("%ctaid.x")
        return (cta * total) // self.ctas, ((cta + 1) * total) // self.ctas

    @cute.jit
    def slots_of(self, op, n, count, request):
        """(state slot, conv slot, window offset) of the range's item ``n`` (of request
        ``request``); (0, 0, 0) past its ``count`` items."""
        slot, conv_slot, offset = Int32(0), Int32(0), Int32(0)
        if n < count:
            slot, conv_slot, offset = self.item_slots(op.slots, op.accepted, request)
        return slot, conv_slot, offset

    @cute.jit
    def stage_rows(self, op, buffers, head, request, parity):
        """The prep group's cp.asyncs of an item's input rows, f_a rows (into ``parity``)
        and beta words (the 4-byte word holding each token's beta)."""
        convs, xs, gs, fas, betas = buffers
        self.stage_inputs(op.x, op.gate, op.f_a, xs, gs, fas[parity, None, None], head, request, 0)
        tid = fresh_tid()
        if tid < self.tokens:
            size = op.beta.element_type.width // 8
            offset = ((request * self.tokens + tid) * self.heads + head) * size
            word = Int64(op.beta.iterator.toint()) + Int64(offset - offset % 4)
            cp_async_4(Int32(betas.iterator.toint()) + (parity * 8 + tid) * 4, word)

    @cute.jit
    def advance(self, op, buffers, head, request, nxt, parity):
        """After the current item's staged operands are read: cp.async the next item's
        window and rows (``nxt``: its (slot, conv slot, offset)); one commit group."""
        if nxt[0] > 0:
            convs = buffers[0]
            self.stage_conv(op.conv_state, convs, head, nxt[1], nxt[2])
            self.stage_rows(op, buffers, head, request, parity)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def next_head(self, op, caches, n, count, new_head, head):
        """When the range's item ``n`` starts a new head, ``new_head``: cp.async its
        parameters into the head cache (the current item is done with it); one commit group."""
        if (n < count) & (new_head != head):
            self.stage_head(op, caches, new_head)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def prep(self, op, buffers, caches, vectors, v_o, sums, out_sums, batch, requests, total):
        """The prep group's loop (threads 0-255); with ``prep_output`` also the output of
        item n - slots, which the state group left in slot n % slots, before item n's
        vectors go there."""
        T = self.tokens
        convs, xs, gs, fas, betas = buffers
        v_q, v_k, v_v, v_g, v_decay, v_beta, v_slot = vectors
        # (head, request) of items n (a), n + 1 (b), n + 2 (c) of the range's ``count``
        first = self.item_range(total)[0]
        count, head_a, request_a = first_item(*self.item_range(total), requests)
        slot_a, conv_a, offset_a = self.slots_of(op, 0, count, request_a)
        if count > 0:
            self.stage_head(op, caches, head_a)
            if slot_a > 0:
                self.stage_conv(op.conv_state, convs, head_a, conv_a, offset_a)
        cute.arch.griddepcontrol_wait()
        if slot_a > 0:
            self.stage_rows(op, buffers, head_a, request_a, 0)
        if cutlass.const_expr(self.batch_gate):  # noqa: SIM102 (trace-time, then runtime)
            if count > 0:  # the first batch's f_a rows (none in flight at an idle CTA's exit)
                self.stage_batch_rows(op, batch[0], request_a, requests)
        cute.arch.cp_async_commit_group()
        cute.arch.griddepcontrol_launch_dependents()
        head_b, request_b = next_item(head_a, request_a, requests)
        slot_b, conv_b, offset_b = self.slots_of(op, 1, count, request_b)
        items = GATE_COLUMNS // T  # a gate batch's items (T <= BATCH_TOKENS)
        place = Int32(items)  # the item's place in its gate batch
        n = Int32(0)
        while n < count:
            tid = fresh_tid()
            lane, warp, channel, section = dev.thread_layout(tid)
            group, quarter = lane // 4, lane % 4
            parts = (2 * section, 1)
            s, parity = n % self.slots, n % 2  # the vector slot, the staging parity
            head, request = head_a, request_a
            slot, conv_slot, offset = slot_a, conv_a, offset_a
            nxt = (slot_b, conv_b, offset_b)
            head_c, request_c = next_item(head_b, request_b, requests)
            slot_c, conv_c, offset_c = self.slots_of(op, n + 2, count, request_c)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier(barrier_id=PREP_BAR, number_of_threads=THREADS)
            fb, cw, cb, dt_row, al = caches
            if cutlass.const_expr(self.batch_gate):  # noqa: SIM102 (trace-time, then runtime)
                # a gate batch starts every ``items`` items and with every head
                if (place == items) | (request == 0):
                    place = Int32(0)
                    self.gate_batch(op, batch, caches, n, count, request, requests)
            if slot > 0:
                coeff = [[Float32(cw[parts[p], e, channel]) for e in range(4)] for p in range(2)]
                bias = [Float32(0.0), Float32(0.0)]
                if cutlass.const_expr(self.has_bias):
                    bias = [Float32(cb[parts[p], channel]) for p in range(2)]
                if cutlass.const_expr(not self.batch_gate):
                    a = Float32(al[0])
                    dt = [Float32(dt_row[16 * warp + group + 8 * i]) for i in range(2)]
                    weights = self.gate_weights(fb, warp, lane)
                size = op.beta.element_type.width // 8
                half = ((((request * T + tid) * self.heads + head) * size) % 4) // 2
                beta = Float32(betas[parity, tid % 8, half % (4 // size)])
                taps = []
                inputs = []
                for p in cutlass.range_constexpr(2):
                    if cutlass.const_expr(self.conv_dim_first):
                        taps.append(
                            [convs[parts[p], channel * self.window + offset + j] for j in range(3)]
                        )
                    else:
                        taps.append([convs[parts[p], j * HEAD_DIM + channel] for j in range(3)])
                    inputs.append([xs[t, parts[p], channel] for t in range(T)])
                fa0 = Int32(fas.iterator.toint()) + parity * (T * HEAD_DIM * 2)
                activations = []
                if cutlass.const_expr(not self.batch_gate):
                    for chunk in cutlass.range_constexpr(8):
                        col = 16 * chunk + 4 * quarter
                        address = fa0 + ((group % T) * HEAD_DIM + col) * 2
                        activations.append(ld_shared_b32x2(address))
                gates = [dev.sigmoid(Float32(gs[0, t, channel])) for t in range(T)]
                # the staging buffers are free: the next item's window and rows stream in
                cute.arch.barrier(barrier_id=PREP_BAR, number_of_threads=THREADS)
                self.advance(op, buffers, head_b, request_b, nxt, 1 - parity)
                if n >= self.slots:  # the state group is done with slot s (its last item)
                    cute.arch.barrier(barrier_id=EMPTY_BAR + s, number_of_threads=PIPE_THREADS)
                if cutlass.const_expr(self.prep_output):
                    taken = self.take_output(v_o[s, None, None], v_g[s, None, None], out_sums)
                    live = v_slot[s]
                elif tid == 0:
                    v_slot[s] = slot
                s_q, s_k, s_v = v_q[s, None, None], v_k[s, None, None], v_v[s, None, None]
                s_decay = v_decay[s, None, None]
                qkv = (s_q, s_k, s_v)
                item_sums = sums[s, None, None, None]
                self.conv_phase(
                    taps, coeff, bias, inputs, qkv, item_sums, op.kg_records, request, head
                )
                self.write_conv(op.conv_state, conv_slot, head, taps, inputs)
                rows = self.shared_rows(fa0, Int32(fb.iterator.toint()))
                if cutlass.const_expr(self.batch_gate):  # the warp's features of its batch rows
                    if lane < 16:
                        feature = 16 * warp + lane
                        for t in cutlass.range_constexpr(T):
                            s_decay[t, feature] = batch[1][place * T + t, feature]
                elif cutlass.const_expr(T <= BATCH_TOKENS):  # fp32, T 1: the live columns
                    self.gate_decays(op, weights, activations, a, dt, dt_row, s_decay, rows)
                else:  # T > BATCH_TOKENS: KdaStream's gate phase, the item's own tile
                    self.gate_phase(op, weights, activations, a, dt, s_decay, request, head, rows)
                if tid < T:
                    v_beta[s, tid] = dev.sigmoid(beta)
                if section == 0:
                    for t in cutlass.range_constexpr(T):
                        v_g[s, t, channel] = gates[t]
                cute.arch.barrier(barrier_id=PREP_BAR, number_of_threads=THREADS)
                self.next_head(op, caches, n + 1, count, head_b, head)
                if cutlass.const_expr(self.prep_output):  # noqa: SIM102 (trace-time, then runtime)
                    if n >= self.slots:
                        self.finish_output(
                            op, taken, out_sums, live, first + n - self.slots, requests
                        )
            else:
                cute.arch.barrier(barrier_id=PREP_BAR, number_of_threads=THREADS)
                self.advance(op, buffers, head_b, request_b, nxt, 1 - parity)
                self.next_head(op, caches, n + 1, count, head_b, head)
                if n >= self.slots:
                    cute.arch.barrier(barrier_id=EMPTY_BAR + s, number_of_threads=PIPE_THREADS)
                if cutlass.const_expr(self.prep_output):
                    taken = self.take_output(v_o[s, None, None], v_g[s, None, None], out_sums)
                    live = v_slot[s]
                    cute.arch.barrier(barrier_id=PREP_BAR, number_of_threads=THREADS)
                    if n >= self.slots:
                        self.finish_output(
                            op, taken, out_sums, live, first + n - self.slots, requests
                        )
                elif tid == 0:
                    v_slot[s] = slot
            if cutlass.const_expr(self.prep_output):  # noqa: SIM102 (trace-time, then runtime)
                if tid == 0:  # after every prep thread read the slot's last item
                    v_slot[s] = slot
            cute.arch.barrier_arrive(barrier_id=FULL_BAR + s, number_of_threads=PIPE_THREADS)
            slot_a, conv_a, offset_a = slot_b, conv_b, offset_b
            slot_b, conv_b, offset_b = slot_c, conv_c, offset_c
            head_a, request_a, head_b, request_b = head_b, request_b, head_c, request_c
            place = place + 1
            n = n + 1
        if cutlass.const_expr(self.prep_output):
            self.flush_outputs(op, v_o, v_g, v_slot, out_sums, first, count, requests)

    # ------------------------------------------------------------------ the state group
    @cute.jit
    def state_loop(self, op, staged, vectors, v_o, sums, out_sums, requests, total):
        """The state group's loop (threads 256-511)."""
        T = self.tokens
        v_q, v_k, v_v, v_g, v_decay, v_beta, v_slot = vectors
        # (head, request) of the range's item n; those of the items ``stages`` and
        # ``stages + 1`` on stepped from it afresh (carried, they cost spills)
        count, head, request = first_item(*self.item_range(total), requests)
        for j in cutlass.range_constexpr(self.stages):
            head_j, request_j = next_item(head, request, requests, j)
            ahead = self.slots_of(op, j, count, request_j)[0]
            if ahead > 0:
                self.stage_state(op.state, staged[j, None, None, None], head_j, ahead)
            cute.arch.cp_async_commit_group()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        nw = Float32(0.0)
        if cutlass.const_expr(not self.batch_gate):  # held (the batch's registers: re-read)
            nw = Float32(op.norm_weight[local_tid() % HEAD_DIM])
        request_j = next_item(head, request, requests, self.stages)[1]
        ahead = self.slots_of(op, self.stages, count, request_j)[0]
        n = Int32(0)
        while n < count:
            s = n % self.slots
            stage = n % self.stages
            token = request * T
            cute.arch.cp_async_wait_group(self.stages - 1)
            if cutlass.const_expr(self.bf16_state):  # the partner's copies have landed
                cute.arch.sync_warp()
            history = self.load_history(staged[stage, None, None, None])
            if cutlass.const_expr(self.bf16_state):  # the partner has read its slots
                cute.arch.sync_warp()
            head_far, request_far = next_item(head, request, requests, self.stages)
            if ahead > 0:  # the page of the item ``stages`` on, into the stage just read
                self.stage_state(op.state, staged[stage, None, None, None], head_far, ahead)
            cute.arch.cp_async_commit_group()
            request_far = next_item(head_far, request_far, requests)[1]
            ahead = self.slots_of(op, n + self.stages + 1, count, request_far)[0]
            cute.arch.barrier(barrier_id=FULL_BAR + s, number_of_threads=PIPE_THREADS)
            slot = v_slot[s]
            if slot > 0:
                # q and k normalised here (the prep group is the busier one)
                self.normalize_qk(
                    v_q[s, None, None], v_k[s, None, None], sums[s, None, None, None], op.scale
                )
                cute.arch.barrier(barrier_id=STATE_BAR, number_of_threads=THREADS)
                shared = (v_q[s, None, None], v_k[s, None, None], v_v[s, None, None])
                shared = (*shared, v_decay[s, None, None])
                s_o = v_o[s, None, None]
                self.recurrence(op, history, shared, v_beta[s, None], s_o, slot, request, head)
                if cutlass.const_expr(not self.prep_output):
                    cute.arch.barrier(barrier_id=STATE_BAR, number_of_threads=THREADS)
                    if local_tid() < HEAD_DIM:
                        self.norm_sums(s_o, out_sums)
                    cute.arch.barrier(barrier_id=STATE_BAR, number_of_threads=THREADS)
                    gate = v_g[s, None, None]
                    if cutlass.const_expr(self.batch_gate):
                        nw = Float32(op.norm_weight[local_tid() % HEAD_DIM])
                    self.write_output(s_o, out_sums, gate, nw, op.eps, op.output, token, head)
            elif cutlass.const_expr(not self.prep_output):
                tid = local_tid()
                if tid < HEAD_DIM:
                    for t in cutlass.range_constexpr(T):
                        op.output[token + t, head * HEAD_DIM + tid] = BFloat16(0.0)
            # slot s is free for the prep group's next use; prep_output: after every item
            # (its o to the prep group, which writes the output, then its next item)
            if n + (0 if self.prep_output else self.slots) < count:
                cute.arch.barrier_arrive(barrier_id=EMPTY_BAR + s, number_of_threads=PIPE_THREADS)
            head, request = next_item(head, request, requests)
            n = n + 1

    @cute.kernel
    def kernel(self, op):
        T = self.tokens
        tid, _, _ = cute.arch.thread_idx()
        requests = op.output.shape[0] // T
        total = self.heads * requests

        smem = cutlass.memory.SmemAllocator()
        staged_shape = (self.stages, ROWS * KCHUNKS, THREADS, self.chunk_words)
        staged = smem_tensor(smem, Float32, staged_shape, align=128)
        # the head cache: f_b rows (swizzled), conv weights, bias, dt_bias, a_log
        w_type, b_type = op.conv_weight.element_type, op.conv_bias.element_type
        caches = (
            smem_tensor(smem, BFloat16, (HEAD_DIM, HEAD_DIM), align=128),
            smem_tensor(smem, w_type, (3, 4, HEAD_DIM), align=16),
            smem_tensor(smem, b_type, (3, HEAD_DIM), align=16),
            smem_tensor(smem, Float32, (HEAD_DIM,), align=16),
            smem_tensor(smem, Float32, (4,), align=16),
        )
        conv_type = op.conv_state.element_type
        conv_cols = HEAD_DIM * self.window if self.conv_dim_first else 3 * HEAD_DIM
        convs = smem_tensor(smem, conv_type, (3, conv_cols), align=16)
        xs = smem_tensor(smem, BFloat16, (T, 3, HEAD_DIM), align=16)
        gs = smem_tensor(smem, BFloat16, (1, T, HEAD_DIM), align=16)
        fas = smem_tensor(smem, BFloat16, (2, T, HEAD_DIM), align=16)
        b_size = op.beta.element_type.width // 8
        betas = smem_tensor(smem, op.beta.element_type, (2, 8, 4 // b_size), align=16)
        # two slots of an item's vectors: q, k, v, sigmoid(gate), decays, beta,
        # the item's state slot; o
        slots = self.slots
        v_q, v_k, v_v, v_g, v_o = [
            smem_tensor(smem, Float32, (slots, T, HEAD_DIM), align=16) for _ in range(5)
        ]
        decays = T if self.batch_gate else 8  # gate_phase writes all the tile's 8 columns
        v_decay = smem_tensor(smem, Float32, (slots, decays, HEAD_DIM), align=16)
        v_beta = smem_tensor(smem, Float32, (slots, 8))
        v_slot = smem_tensor(smem, Int32, (slots,))
        sums = smem_tensor(smem, Float32, (slots, T, 2, 8))
        out_sums = smem_tensor(smem, Float32, (T, 4))
        vectors = (v_q, v_k, v_v, v_g, v_decay, v_beta, v_slot)
        batch = None
        if cutlass.const_expr(self.batch_gate):  # a gate batch's f_a rows, its decays
            batch = (
                smem_tensor(smem, BFloat16, (GATE_COLUMNS, HEAD_DIM), align=16),
                smem_tensor(smem, Float32, (GATE_COLUMNS, HEAD_DIM), align=16),
            )
        if tid < THREADS:
            buffers = (convs, xs, gs, fas, betas)
            self.prep(op, buffers, caches, vectors, v_o, sums, out_sums, batch, requests, total)
        else:
            self.state_loop(op, staged, vectors, v_o, sums, out_sums, requests, total)
