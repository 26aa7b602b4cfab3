"""KdaPipe's prep-group helpers (a mixin of ``pipe.KdaPipe``): the head cache's staging
(``stage_head``), the f_b fragments and rows from it, the gate batches (T <= 4), and
(``prep_output``, T >= 3) the gated RMSNorm of an item the state group is done with."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from tpcomm.cuteutil import cp_async_16, ld_shared_b32x2, warp_sum

from . import device as dev
from .device import HEAD_DIM, THREADS
from .stream import fresh_tid

__all__ = ["BATCH_TOKENS", "GATE_COLUMNS", "PipePrep", "batches_gate", "cp_async_4"]

# At T <= BATCH_TOKENS the raw gates of up to GATE_COLUMNS // T consecutive items of one
# head are one mma tile (its eight token columns: column j is token j % T of the batch's
# item j // T), computed when the first of them is prepared (``KdaPipe.batch_gate``)
GATE_COLUMNS = 8
BATCH_TOKENS = 4


def batches_gate(tokens, state_bytes):
    """Whether KdaPipe batches the gate over items (``gate_batch``): at T <= BATCH_TOKENS
    except on fp32 pages at T = 1. There the state group bounds the step and the batch's
    registers cost it spills (H 96 B 128 461 -> 478 us, H 12 B 128 67.7 -> 69.8; the same
    probe: bf16 T 1 H 96 B 128 420 -> 356 us, H 12 B 128 62.7 -> 51.6, fp32 T 2 111 -> 103);
    that case keeps the per-item tile's live columns (``gate_decays``)."""
    return tokens <= BATCH_TOKENS and not (tokens == 1 and state_bytes == 4)


def batch_size(n, count, request, requests, items):
    """The items of the gate batch starting at the range's item n (of ``count``), request
    ``request``: up to ``items`` (``GATE_COLUMNS // T``), within the head and the range."""
    size = cutlass.select_(requests - request < items, requests - request, items)
    return cutlass.select_(count - n < size, count - n, size)


def batch_follower(request, size, requests):
    """The request of the first item after a batch of ``size`` from ``request`` (the next
    head's first at the head's end): its f_a rows are the next batch's."""
    return cutlass.select_(request + size == requests, Int32(0), request + size)


def cp_async_4(shared: Int32, source: Int64):
    """4-byte ``cp.async.ca`` global -> shared."""
    cute.arch.inline_ptx(
        "cp.async.ca.shared.global [{$r0}], [{$r1}], 4;", read_only_args=[shared, source]
    )


class PipePrep:
    """Needs ``tokens``, ``gate_mode``, ``project_gate`` and ``settling`` (KdaStream's),
    ``batch_gate`` and ``prep_barrier`` (the prep group's named barrier: KdaPipe's)."""

    def shared_rows(self, fa0, fb0):
        """Trace-time helper: the settle's row loader (``dev.GateTile.rows``): the
        undecided raw gates' f_a rows from the item's staged rows at ``fa0``, f_b rows from
        the head cache at ``fb0`` (swizzled)."""
        lane = cute.arch.lane_idx()

        def rows(t, feature):
            granule = lane // 2
            swizzled = (granule & 8) | ((granule ^ feature) & 7)
            words_a = ld_shared_b32x2(fa0 + t * (HEAD_DIM * 2) + lane * 8)
            words_b = ld_shared_b32x2(fb0 + feature * 256 + swizzled * 16 + (lane % 2) * 8)
            return words_a, words_b

        return rows

    @cute.jit
    def gate_weights(self, fb, tile, lane):
        """f_b A fragments of gate tile ``tile`` from the head cache (KdaWide's
        ``load_gate_weights`` order)."""
        group, quarter = lane // 4, lane % 4
        fb0 = Int32(fb.iterator.toint())
        weights = []
        for chunk in cutlass.range_constexpr(8):
            granule = 2 * chunk + quarter // 2
            swizzled = (granule & 8) | ((granule ^ group) & 7)
            offset = swizzled * 16 + (quarter % 2) * 8
            low = ld_shared_b32x2(fb0 + (16 * tile + group) * 256 + offset)
            high = ld_shared_b32x2(fb0 + (16 * tile + group + 8) * 256 + offset)
            weights.append((low[0], high[0], low[1], high[1]))
        return weights

    @cute.jit
    def gate_decays(self, op, weights, activations, a, dt, dt_row, s_decay, rows):
        """KdaStream's gate phase, the decays of tokens < T only: of the warp's tile (16
        features x 8 token columns, four accumulators per lane) the 16 T in use go to 16 T
        lanes (``i = 32 r + lane``: feature ``i % 16``, token ``i // 16``), one decay each
        per round instead of four per lane; ``dev.decay`` on the same fp32 values (bit for
        bit). Gate mode 3 then settles the tile (after a warp barrier: its stores follow
        the fast path's to the same places; no records, rows from shared memory)."""
        tid = fresh_tid()
        lane, warp = tid % 32, tid // 32
        acc, bound = self.project_gate(weights, activations)
        for r in cutlass.range_constexpr((self.tokens + 1) // 2):
            i = 32 * r + lane
            t, f = i // 16, i % 16
            source = (f % 8) * 4 + t // 2  # the lane of group f % 8, quarter t // 2
            values = [cute.arch.shuffle_sync(acc[e], offset=source) for e in range(4)]
            e = t % 2 + 2 * (f // 8)  # the accumulator of (token t, feature f) there
            value = cutlass.select_(e == 1, values[1], values[0])
            value = cutlass.select_(e == 2, values[2], value)
            value = cutlass.select_(e == 3, values[3], value)
            if t < self.tokens:
                feature = 16 * warp + f
                dt_f = Float32(dt_row[feature])
                raw_g = dev.to_bf16_f32(value)
                s_decay[t, feature] = dev.decay(a, raw_g, dt_f, op.lower_bound, self.softplus_gate)
        if cutlass.const_expr(self.gate_mode == 3):
            cute.arch.sync_warp()
            where = self.settling(s_decay, 16 * warp, warp, 0, 0, rows)
            dev.settle_gate(op, acc, bound, a, dt, where)

    @cute.jit
    def take_output(self, s_o, s_g, out_sums):
        """``prep_output``: the prep group's first half of an earlier item's output (its
        slot's o and sigmoid(gate), the state group done with them): the thread's channel
        (``tid % 128``) of each token into registers, per-warp sums of o^2 into ``out_sums``
        (warps 0-3)."""
        tid = fresh_tid()
        channel = tid % HEAD_DIM
        o = [s_o[t, channel] for t in range(self.tokens)]
        g = [s_g[t, channel] for t in range(self.tokens)]
        for t in cutlass.range_constexpr(self.tokens):
            total = warp_sum(o[t] * o[t])
            if (tid < HEAD_DIM) & (tid % 32 == 0):
                out_sums[t, tid // 32] = total
        return o, g

    @cute.jit
    def finish_output(self, op, taken, out_sums, live, item, requests):
        """The second half, after a prep barrier: the gated RMSNorm of ``item``'s rows
        (threads 0-127; KdaWide's ``write_output`` order), zero rows for a padding item.
        One division: at T >= ``PREP_OUTPUT_TOKENS`` it is noise beside the item."""
        tid = fresh_tid()
        o, g = taken
        head = item // requests
        request = item - head * requests
        if tid < HEAD_DIM:
            nw = Float32(op.norm_weight[tid])
            for t in cutlass.range_constexpr(self.tokens):
                sumsq = dev.quad_sum([out_sums[t, w] for w in range(4)])
                rstd = dev.rsqrt_f32(sumsq * (1.0 / HEAD_DIM) + op.eps)
                result = ((o[t] * rstd) * nw) * g[t]
                if live <= 0:
                    result = Float32(0.0)
                op.output[request * self.tokens + t, head * HEAD_DIM + tid] = BFloat16(result)

    @cute.jit
    def stage_batch_rows(self, op, rows, request, requests):
        """cp.async the f_a rows of the tokens of requests ``request`` .. (``GATE_COLUMNS``
        rows, not past the last request's) into ``rows`` (threads 0-127, 16 bytes each)."""
        tid = fresh_tid()
        row, k = tid // 16, tid % 16
        if (tid < GATE_COLUMNS * 16) & (row < (requests - request) * self.tokens):
            token = request * self.tokens + row
            source = Int64(op.f_a.iterator.toint()) + Int64(token * HEAD_DIM + 8 * k) * 2
            cp_async_16(Int32(rows.iterator.toint()) + (row * HEAD_DIM + 8 * k) * 2, source)

    @cute.jit
    def gate_batch(self, op, batch, caches, n, count, request, requests):
        """At the first item n of a batch: the raw gates and decays of items n .. n + size - 1
        (``batch_size``: one head) as one mma tile, column j token j % T of item n + j // T
        (f_a rows in ``batch[0]``), decays into row j of ``batch[1]``; gate mode 3 settles
        the columns < size T. Per value the same mma, bound, recompute and decay as one
        item's tile (column j: token j % T): the same decays bit for bit. Each warp writes
        and later reads its own 16 features of the decays; after a prep barrier (every warp
        done with the rows) the next batch's f_a rows are cp.asynced into the buffer (in the
        item's commit group, waited for with the next item's inputs)."""
        rows, decays = batch
        fb, _, _, dt_row, al = caches
        tid = fresh_tid()
        lane, warp = tid % 32, tid // 32
        group, quarter = lane // 4, lane % 4
        a = Float32(al[0])
        dt = [Float32(dt_row[16 * warp + group + 8 * i]) for i in range(2)]
        weights = self.gate_weights(fb, warp, lane)
        fa0 = Int32(rows.iterator.toint())
        activations = []
        for chunk in cutlass.range_constexpr(8):
            col = 16 * chunk + 4 * quarter
            activations.append(ld_shared_b32x2(fa0 + (group * HEAD_DIM + col) * 2))
        acc, bound = self.project_gate(weights, activations)
        for e in cutlass.range_constexpr(4):
            j = 2 * quarter + e % 2
            feature = 16 * warp + group + 8 * (e // 2)
            raw_g = dev.to_bf16_f32(acc[e])
            decays[j, feature] = dev.decay(a, raw_g, dt[e // 2], op.lower_bound, self.softplus_gate)
        size = batch_size(n, count, request, requests, GATE_COLUMNS // self.tokens)
        if cutlass.const_expr(self.gate_mode == 3):
            cute.arch.sync_warp()
            shared = self.shared_rows(fa0, Int32(fb.iterator.toint()))
            where = (decays, 16 * warp, warp, 0, 0, size * self.tokens, False, self.settle_batch)
            where = dev.GateTile(*where, shared, self.softplus_gate)
            dev.settle_gate(op, acc, bound, a, dt, where)
        cute.arch.barrier(barrier_id=self.prep_barrier, number_of_threads=THREADS)
        if n + size < count:
            self.stage_batch_rows(op, rows, batch_follower(request, size, requests), requests)

    @cute.jit
    def stage_head(self, op, cache, head):
        """cp.async ``head``'s parameters into a head cache: its 128 f_b rows (16-byte
        granules XOR-swizzled by row, conflict-free fragment and row reads), conv weights,
        bias, dt_bias and a_log."""
        fb, cw, cb, dt, al = cache
        tid = fresh_tid()
        dim = self.heads * HEAD_DIM
        base = Int64(op.f_b.iterator.toint()) + Int64(head * HEAD_DIM * HEAD_DIM) * 2
        fb0 = Int32(fb.iterator.toint())
        for j in cutlass.range_constexpr(HEAD_DIM * 16 // THREADS):
            g = tid + THREADS * j
            row, granule = g // 16, g % 16
            swizzled = (granule & 8) | ((granule ^ row) & 7)
            cp_async_16(fb0 + row * 256 + swizzled * 16, base + Int64(g * 16))
        # conv weights [part, tap, channel] and bias [part, channel] of the head's channels
        w_size = op.conv_weight.element_type.width // 8
        per_row = HEAD_DIM * w_size // 16
        w0 = Int64(op.conv_weight.iterator.toint())
        cw0 = Int32(cw.iterator.toint())
        for j in cutlass.range_constexpr((12 * per_row + THREADS - 1) // THREADS):
            g = tid + THREADS * j
            if g < 12 * per_row:
                row, k = g // per_row, g % per_row
                source = w0 + Int64((row * dim + head * HEAD_DIM) * w_size + k * 16)
                cp_async_16(cw0 + row * HEAD_DIM * w_size + k * 16, source)
        if cutlass.const_expr(self.has_bias):
            b_size = op.conv_bias.element_type.width // 8
            b_row = HEAD_DIM * b_size // 16
            b0 = Int64(op.conv_bias.iterator.toint())
            cb0 = Int32(cb.iterator.toint())
            if (tid >= 128) & (tid < 128 + 3 * b_row):
                row, k = (tid - 128) // b_row, (tid - 128) % b_row
                source = b0 + Int64((row * dim + head * HEAD_DIM) * b_size + k * 16)
                cp_async_16(cb0 + row * HEAD_DIM * b_size + k * 16, source)
        if (tid >= 192) & (tid < 224):
            k = tid - 192
            source = Int64(op.dt_bias.iterator.toint()) + Int64(head * HEAD_DIM * 4 + k * 16)
            cp_async_16(Int32(dt.iterator.toint()) + k * 16, source)
        if tid == 224:
            source = Int64(op.a_log.iterator.toint()) + Int64(head * 4)
            cp_async_4(Int32(al.iterator.toint()), source)
