"""KdaPrepareWarp: KdaPrepare (``kda.prepass``) with one WARP per (request, head) item, the
alternative prepass of ``kda.decode(..., kernel="lean")`` selected by
``kda.dispatch.LEAN_PREPASS = "warp"``. Same arguments, same scratch layout, and the
scratch, conv pages and ``kg_records`` it writes are bitwise KdaPrepare's (= KdaWide's
values).

Why: KdaPrepare runs each item on a 256-thread CTA whose stages (slot -> conv window ->
SiLU -> block reductions -> gate mma -> decay) are separated by CTA barriers, one
latency-bound chain per CTA. Here a warp runs its item end to end with no CTA barrier
(warp shuffles only), and a CTA holds ``WARPS`` = 8 items: the requests ``8 g .. 8 g + 7``
of one head (grid ``(ceil(B / 8), H)``; the 8 warps read the same head's f_b rows, which
then come from L1). Latency is hidden across the many independent warps of an SM.

Mapping: lane ``l`` owns channels ``c_j = l + 32 j`` (j = 0..3) of q, k and v, i.e. lane
``l``'s ``j``-th channel is the channel of lane ``l`` of KdaWide's warp ``j`` (section 0).

Orders kept from KdaWide (each value goes through the same operations in the same order):
- conv (``KdaWide.convolve``): per token t, ``acc = bias`` (``0.0`` without bias), then
  for i = 0..3 ``acc = fma(Float32(term_{t+i}), coeff_i, acc)`` where terms 0..2 are the
  window taps ``conv_state[slot, ch, offset + 0..2]`` and term ``3 + u`` is
  ``x[token + u, ch]``; then ``dev.silu_bf16``.
- q^2 / k^2: Wide's per-warp ``warp_sum(v * v)`` (butterflies at shifts 16, 8, 4, 2, 1)
  over warp j's 32 channels is here the same butterfly over the 32 lanes of the lane's
  j-th channel (lane l of warp j holds channel 32 j + l in both), giving the four warp
  partials r_0..r_3; then ``dev.quad_sum`` = ``(r_0 + r_2) + (r_1 + r_3)``, ``+ 1e-6``,
  ``dev.rsqrt_f32``; q^ = ``(q * fq) * scale``, k^ = ``k * fk`` (Wide's ``normalize_qk``).
- gate (gate_mode 0 / 1): KdaWide's warp w computes the 16-feature tile m = w with
  ``dev.gate_projection``; here the item's warp runs the eight tiles m = 0..7 one after
  another, each with exactly Wide's warp-m fragments (A: f_b rows ``16 m + group (+ 8)``,
  the same K permutation; B: ``load_activations``, column n = token n % T) and the same
  chain order (mode 0: one chain of eight mma; mode 1: four chains of two, then
  ``0 + (((c0 + c1) + c2) + c3)``). An mma's element D[m, n] depends only on row m of A,
  column n of B and C[m, n], so the lane's four accumulators are Wide's warp-m lane's.
  raw gate = bf16(acc), decay = ``dev.decay(a_log, raw, dt_bias, lower_bound)``; columns
  t < T are written (the columns KdaPrepare copies out of ``s_decay``).
- gate (gate_mode 2, ``KdaWide.gate_phase_exact``): per (feature, token) one fp64
  accumulator, ``acc += Float64(a_k * w_k)`` for k = 0..127 in order (bf16 pairs of each
  16-byte chunk unpacked low half first), then ``to_bf16(Float32(acc))``; lane l takes
  features ``l + 32 j``, one token at a time, the f_a rows read straight from global
  (the same bits as Wide's shared copy).
- sigmoid(gate) and sigmoid(beta): ``dev.sigmoid`` of the bf16 input, as KdaPrepare.

Conv page (``KdaWide.write_conv``): window positions 0..T+1 of each channel get
``[tap1, tap2, x_0 .. x_{T-1}]`` in the page's dtype, written by the lane that read the
channel's taps. Records: ``kg_records[b, h, t, c]`` = bf16(k before normalisation),
``kg_records[b, h, t, 128 + f]`` = the bf16 raw gate (t < T). Padding (slot <= 0) and
warps past the last request write nothing.

PDL: as KdaPrepare: dependents released at the start; the window taps are read before
``griddepcontrol.wait`` (every warp waits, padding or not), all else after it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64

from tpcomm.cuteutil import bf16x2_to_f32, ld_global_b32x4, ld_global_nc_b32x2, warp_sum

from . import device as dev
from .device import HEAD_DIM
from .prepass import (
    SCRATCH_BETA,
    SCRATCH_DECAY,
    SCRATCH_GATE,
    SCRATCH_K,
    SCRATCH_Q,
    SCRATCH_V,
    KdaPrepare,
)

WARPS = 8  # items (warps) per CTA: requests 8 g .. 8 g + 7 of one head
LANE_CHANNELS = HEAD_DIM // 32  # channels per lane of each of q, k, v (l + 32 j)
GATE_TILES = HEAD_DIM // 16  # 16-feature mma tiles of the raw gate


def default_ctas_per_sm(tokens, gate_mode):
    """``__launch_bounds__`` minimum CTAs per SM (the register cap): 3 (80 registers, 24
    items per SM) where ptxas fits that without spilling (sm_90a / sm_100a: T = 1, and
    T = 2 with gate_mode 0 / 1), else 2 (128 registers, 16 items; T = 4 / 8 use 112-126
    registers and spill nothing; a cap of 3 spills 8-20 B at T = 4)."""
    return 3 if tokens == 1 or (tokens == 2 and gate_mode != 2) else 2


class KdaPrepareWarp(KdaPrepare):
    """KdaPrepare's work, one warp per item; ``heads``, ``tokens`` T (1..8), ``record``,
    ``gate_mode``, ``has_bias``; ``arch``; ``pdl``; ``ctas_per_sm``: ``__launch_bounds__``
    minimum CTAs per SM (0: none; None: ``default_ctas_per_sm``)."""

    def __init__(
        self,
        heads,
        tokens=1,
        record=False,
        gate_mode=0,
        has_bias=False,
        *,
        arch="sm_90a",
        pdl=False,
        ctas_per_sm=None,
    ):
        if ctas_per_sm is None:
            ctas_per_sm = default_ctas_per_sm(tokens, gate_mode)
        if ctas_per_sm < 0:
            raise ValueError(f"ctas_per_sm must be >= 0; got {ctas_per_sm}")
        super().__init__(heads, tokens, record, gate_mode, has_bias, arch=arch, pdl=pdl,
                         ctas_per_sm=ctas_per_sm)  # fmt: skip

    def launch_shape(self, requests):
        """(grid, block): ``WARPS`` consecutive requests of one head per CTA, a warp each
        (``KdaPrepare.__call__`` launches with it)."""
        return ((requests + WARPS - 1) // WARPS, self.heads, 1), (32 * WARPS, 1, 1)

    # ------------------------------------------------------------------ conv stage
    @cute.jit
    def channel_of(self, part, head, j):
        """Column of part ``part`` (0 q, 1 k, 2 v), lane channel ``j`` in x / conv_state."""
        lane = cute.arch.lane_idx()
        return part * (self.heads * HEAD_DIM) + head * HEAD_DIM + lane + 32 * j

    @cute.jit
    def load_taps(self, conv_state, conv_slot, offset, head, part):
        """Window taps ``offset + 0..2`` of the lane's channels of ``part``: taps[j][i]."""
        taps = []
        for j in cutlass.range_constexpr(LANE_CHANNELS):
            ch = self.channel_of(part, head, j)
            taps.append([conv_state[Int64(conv_slot), ch, offset + i] for i in range(3)])
        return taps

    @cute.jit
    def conv_part(self, part, taps, x, conv_weight, conv_bias, conv_state, conv_slot, head, token):
        """Part ``part``'s conv + SiLU of the lane's channels (out[t][j], KdaWide.convolve's
        order), and its conv page update (KdaWide.write_conv's values)."""
        lane = cute.arch.lane_idx()
        conv_type = conv_state.element_type
        out = [[None] * LANE_CHANNELS for _ in range(self.tokens)]
        for j in cutlass.range_constexpr(LANE_CHANNELS):
            ch = self.channel_of(part, head, j)
            coeff = [
                Float32(conv_weight[part, i, head * HEAD_DIM + lane + 32 * j]) for i in range(4)
            ]
            bias = Float32(conv_bias[ch]) if self.has_bias else Float32(0.0)
            inputs = [x[token + t, ch] for t in range(self.tokens)]
            column = self.convolve(taps[j], coeff, bias, inputs)
            for t in cutlass.range_constexpr(self.tokens):
                out[t][j] = column[t]
            conv_state[Int64(conv_slot), ch, 0] = conv_type(taps[j][1])
            conv_state[Int64(conv_slot), ch, 1] = conv_type(taps[j][2])
            for t in cutlass.range_constexpr(self.tokens):
                conv_state[Int64(conv_slot), ch, 2 + t] = conv_type(inputs[t])
        return out

    @cute.jit
    def norm_factor(self, values):
        """``rsqrt(quad_sum(warp sums of v^2) + 1e-6)`` of one token's 128 channels
        (``values[j]``: the lane's channel l + 32 j): KdaWide's per-warp butterflies, then
        its ``quad_sum`` and ``normalize_qk`` expression."""
        partial = [warp_sum(values[j] * values[j]) for j in range(LANE_CHANNELS)]
        return dev.rsqrt_f32(dev.quad_sum(partial) + 1.0e-6)

    # ------------------------------------------------------------------ gate stage
    @cute.jit
    def gate_tiles(
        self, f_b, f_a, a_log, dt_bias, lower_bound, kg_records, scratch, request, head, token
    ):
        """Raw gate (mma.sync, gate_mode 0 / 1) of the eight 16-feature tiles, each as
        KdaWide's warp m computes it; decay (and the raw-gate record) of columns t < T."""
        lane = cute.arch.lane_idx()
        group, quarter = lane // 4, lane % 4
        T = self.tokens
        a = Float32(a_log[head])
        activations = self.load_activations(f_a, token)
        for m in cutlass.range_constexpr(GATE_TILES):
            weights = self.load_gate_weights(f_b, head, m)
            dt = [Float32(dt_bias[head * HEAD_DIM + 16 * m + group + 8 * i]) for i in range(2)]
            acc = dev.gate_projection(weights, activations, self.gate_mode)
            for e in cutlass.range_constexpr(4):
                t = 2 * quarter + e % 2
                feature = 16 * m + group + 8 * (e // 2)
                if t < T:
                    raw_g = dev.to_bf16_f32(acc[e])
                    decay = dev.decay(a, raw_g, dt[e // 2], lower_bound)
                    scratch[request, t, head, SCRATCH_DECAY + feature] = decay
                    if cutlass.const_expr(self.record):
                        kg_records[request, head, t, HEAD_DIM + feature] = BFloat16(raw_g)

    @cute.jit
    def gate_exact(
        self, f_b, f_a, a_log, dt_bias, lower_bound, kg_records, scratch, request, head, token
    ):
        """Raw gate as ``KdaWide.gate_phase_exact``'s exactly rounded dot: per (feature,
        token) an fp64 sum over k = 0..127 in order; decay, the raw-gate record."""
        lane = cute.arch.lane_idx()
        T = self.tokens
        a = Float32(a_log[head])
        fa0 = Int64(f_a.iterator.toint()) + Int64(token * HEAD_DIM) * 2
        for j in cutlass.range(LANE_CHANNELS, unroll=1):
            feature = lane + 32 * j
            row0 = Int64(f_b.iterator.toint()) + Int64(head * HEAD_DIM + feature) * (HEAD_DIM * 2)
            dt = Float32(dt_bias[head * HEAD_DIM + feature])
            # One token at a time (ptxas: no spills at T = 8 under 128 registers; each
            # sum's order is k = 0..127 whatever the grouping).
            for first in cutlass.range_constexpr(T):
                tokens = [first]
                acc = [Float64(0.0) for _ in tokens]
                for chunk in cutlass.range_constexpr(16):
                    words = ld_global_nc_b32x2(row0 + chunk * 16)
                    words2 = ld_global_nc_b32x2(row0 + chunk * 16 + 8)
                    weights = []
                    for w in (*words, *words2):
                        weights.extend(bf16x2_to_f32(w))
                    for i, t in enumerate(tokens):
                        act_words = ld_global_b32x4(fa0 + (t * HEAD_DIM + 8 * chunk) * 2)
                        for e in cutlass.range_constexpr(4):
                            low, high = bf16x2_to_f32(act_words[e])
                            acc[i] = acc[i] + Float64(low * weights[2 * e])
                            acc[i] = acc[i] + Float64(high * weights[2 * e + 1])
                for i, t in enumerate(tokens):
                    raw_g = dev.to_bf16_f32(Float32(acc[i]))
                    scratch[request, t, head, SCRATCH_DECAY + feature] = dev.decay(
                        a, raw_g, dt, lower_bound
                    )
                    if cutlass.const_expr(self.record):
                        kg_records[request, head, t, HEAD_DIM + feature] = BFloat16(raw_g)

    # ------------------------------------------------------------------ the item
    @cute.jit
    def item(
        self, x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, gate,
        lower_bound, scale, f_b, kg_records, scratch, request, head, conv_slot, offset,
    ):  # fmt: skip
        """One (request, head) item on this warp: every scratch row, conv page and record
        KdaPrepare writes for it."""
        lane = cute.arch.lane_idx()
        T = self.tokens
        token = request * T
        # Predecessor-independent: the conv window taps (as KdaPrepare).
        taps = [self.load_taps(conv_state, conv_slot, offset, head, p) for p in range(3)]
        cute.arch.griddepcontrol_wait()

        # q: conv, norm, q^ = (q * fq) * scale.
        q = self.conv_part(
            0, taps[0], x, conv_weight, conv_bias, conv_state, conv_slot, head, token
        )
        for t in cutlass.range_constexpr(T):
            fq = self.norm_factor(q[t])
            for j in cutlass.range_constexpr(LANE_CHANNELS):
                scratch[request, t, head, SCRATCH_Q + lane + 32 * j] = (q[t][j] * fq) * scale
        # k: conv, the k record (before the norm), k^ = k * fk.
        k = self.conv_part(
            1, taps[1], x, conv_weight, conv_bias, conv_state, conv_slot, head, token
        )
        for t in cutlass.range_constexpr(T):
            if cutlass.const_expr(self.record):
                for j in cutlass.range_constexpr(LANE_CHANNELS):
                    kg_records[request, head, t, lane + 32 * j] = BFloat16(k[t][j])
            fk = self.norm_factor(k[t])
            for j in cutlass.range_constexpr(LANE_CHANNELS):
                scratch[request, t, head, SCRATCH_K + lane + 32 * j] = k[t][j] * fk
        # v: conv only.
        v = self.conv_part(
            2, taps[2], x, conv_weight, conv_bias, conv_state, conv_slot, head, token
        )
        for t in cutlass.range_constexpr(T):
            for j in cutlass.range_constexpr(LANE_CHANNELS):
                scratch[request, t, head, SCRATCH_V + lane + 32 * j] = v[t][j]

        gate_args = (f_b, f_a, a_log, dt_bias, lower_bound, kg_records, scratch, request, head)
        if cutlass.const_expr(self.gate_mode == 2):
            self.gate_exact(*gate_args, token)
        else:
            self.gate_tiles(*gate_args, token)

        # sigmoid(gate), sigmoid(beta).
        for t in cutlass.range_constexpr(T):
            for j in cutlass.range_constexpr(LANE_CHANNELS):
                g = Float32(gate[token + t, head * HEAD_DIM + lane + 32 * j])
                scratch[request, t, head, SCRATCH_GATE + lane + 32 * j] = dev.sigmoid(g)
        if lane < T:
            b = dev.sigmoid(Float32(beta[token + lane, head]))
            scratch[request, lane, head, SCRATCH_BETA] = b

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        conv_weight: cute.Tensor,
        conv_bias: cute.Tensor,
        conv_state: cute.Tensor,
        f_a: cute.Tensor,
        beta: cute.Tensor,
        a_log: cute.Tensor,
        dt_bias: cute.Tensor,
        slots: cute.Tensor,
        gate: cute.Tensor,
        lower_bound: Float32,
        scale: Float32,
        f_b: cute.Tensor,
        accepted: cute.Tensor,
        kg_records: cute.Tensor,
        scratch: cute.Tensor,
    ):
        tid, _, _ = cute.arch.thread_idx()
        group_of_requests, head, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tid // 32)
        request = group_of_requests * WARPS + warp
        requests = gate.shape[0] // self.tokens
        # KdaLean only reads the scratch after its own wait (this grid complete).
        cute.arch.griddepcontrol_launch_dependents()
        if request >= requests:
            cute.arch.griddepcontrol_wait()
        else:
            slot, conv_slot, offset = self.item_slots(slots, accepted, request)
            if slot <= 0:
                # Nothing to write; the wait keeps the completion order of a PDL chain.
                cute.arch.griddepcontrol_wait()
            else:
                self.item(
                    x, conv_weight, conv_bias, conv_state, f_a, beta, a_log, dt_bias, gate,
                    lower_bound, scale, f_b, kg_records, scratch, Int32(request), head,
                    conv_slot, offset,
                )  # fmt: skip
