"""Device math shared by the KDA kernels, in one place: the delta rule of KdaWide,
KdaStream and KdaSplit (``delta_rule``), the record staging and fold of KdaRecover and
KdaReplay, the gate projection and its settling, the rounding helpers.

Thread layout (KdaWide, KdaStream; KdaSplit: its own rows and lanes): 256 threads = 8
warps per (request, head) item. Thread ``tid`` owns value rows ``tid // LANES`` and
``tid // LANES + 64`` of the head's fp32 state, keys ``4 * (tid % LANES + LANES * c) +
[0, 4)`` for chunk ``c`` in 0..KCHUNKS-1 (a quarter of two rows), ``ROWS * KCHUNKS * 4 =
64`` registers. The LANES threads of a row are adjacent lanes, so a row's dot product is
a butterfly over LANES lanes.

Numerics (the reference's rounding points; only fp32 reduction order differs):
- SiLU ``x / (1 + exp(-x))`` (IEEE division, ``add.rn`` so that nothing is contracted)
  rounded to bf16, bit for bit the reference's: a fast fp32 ``exp`` first; only when that
  quotient lies within ``SILU_MARGIN`` fp32 ulps of a bf16 rounding midpoint (where the
  fast exp's 2-ulp error could flip the bf16 bit) is it recomputed with ``exp`` evaluated
  in fp64 and rounded once to fp32, as the reference does (a rare, divergent branch);
- decay ``exp(lower_bound * sigmoid(exp(a_log) * (raw_g + dt_bias)))`` (or, the kernels'
  compile-time ``gate_form`` "softplus", ``exp(-exp(a_log) * softplus(raw_g + dt_bias))``,
  softplus ``x`` above 20 else ``log1p(exp(x))``: libdevice's ``log1pf``, within 1-2 ulp,
  so no ``1 + exp(x)`` cancels) and the sigmoids with the fast fp32 ``exp`` (within a few
  fp32 ulps of the reference: state and outputs are compared with tolerances, and the
  recover kernel uses the same function). The decay's absolute error stays a few fp32
  ulps in either form: a relative error e of the log-decay ``g <= 0`` moves ``exp(g)`` by
  ``exp(g) |g| e <= e / 2.7``; ``raw_g`` and ``raw_g + dt_bias`` are the reference's bits;
- ``rsqrt(s)`` as ``1 / sqrt(s)`` (both correctly rounded);
- recurrence products with ``fma2`` / ``mul2`` on pairs of keys: Blackwell's packed
  ``fma.rn.f32x2`` / ``mul.rn.f32x2`` when ``packed`` (sm_100a), else two scalar
  ``fma.rn.f32`` / ``mul.rn.f32`` in the same per-element order (sm_90a has no f32x2).
Dot products: ACCUMULATORS pairs of partial sums per row, ``(2c + p) % ACCUMULATORS``
picks the pair of key pair ``p`` of chunk ``c``; the pairs are tree-summed, then
butterfly-summed over the row's LANES lanes.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Float64, Int32, Int64, Uint32

from tpcomm.cuteutil import (
    bf16x2_to_f32,
    cvt_bf16x2,
    ld_global_b32x2,
    ld_global_f32x4,
    ld_global_nc_b32x2,
    ld_shared_b32x2,
    ld_shared_f32x4,
    mma_bf16_16816,
    st_global_b32x2,
    st_global_f32x4,
    warp_sum,
    xor_sum,
)

from ..dispatch import CTAS_PER_SM, GATE_ERROR, GATE_FLOOR, GATE_MODES, has_packed_fma  # noqa: F401  (re-exported to the kernels)
from ..validate import GATE_FORMS, HEAD_DIM  # noqa: F401  (HEAD_DIM: re-exported)
from .scalar import (  # noqa: F401  (the scalar math, re-exported to the kernels)
    SILU_MARGIN,
    SOFTPLUS_THRESHOLD,
    add_rn,
    decay,
    exp_f32,
    exp_f32_exact,
    f32_bits,
    rsqrt_f32,
    sigmoid,
    silu_bf16,
    softplus,
    to_bf16_f32,
)

THREADS = 256  # 8 warps per item
LANES = 4  # threads per state row
ROWS = 2  # value rows per thread (r and r + 64)
KCHUNKS = 8  # 16-byte key chunks per row per thread
ACCUMULATORS = 4  # pairs of partial dot-product sums per row


# State pages: the kernels' ``state_dtype`` and its bytes per element. A bf16 page is
# widened to fp32 when loaded (exact) and rounded to nearest-even once when stored
# (``cvt.rn.bf16x2.f32``); four keys of a row are 16 bytes of an fp32 page, 8 of a bf16 one.
STATE_BYTES = {"fp32": 4, "bf16": 2}


def softplus_gate(gate_form: str) -> bool:
    """Whether a kernel's ``gate_form`` (``kda.validate.GATE_FORMS``) is the softplus gate
    (``decay``'s trace-time switch); ValueError naming ``gate_form`` else."""
    if gate_form not in GATE_FORMS:
        raise ValueError(f"gate_form must be one of {GATE_FORMS}; got {gate_form!r}")
    return gate_form == "softplus"


def state_bytes(state_dtype: str) -> int:
    """Bytes per state element of ``state_dtype`` ("fp32" or "bf16"); ValueError else."""
    if state_dtype not in STATE_BYTES:
        raise ValueError(f"state_dtype must be 'fp32' or 'bf16'; got {state_dtype!r}")
    return STATE_BYTES[state_dtype]


def widen_bf16x4(words):
    """Four bf16 (two words, lower key in the low half) as four exact fp32."""
    low0, high0 = bf16x2_to_f32(words[0])
    low1, high1 = bf16x2_to_f32(words[1])
    return (low0, high0, low1, high1)


def ld_shared_keys4(shared: Int32, bf16: bool):
    """Four keys of a state row as fp32 from shared memory (a bf16 page's 8 bytes
    widened); weak."""
    if bf16:
        return widen_bf16x4(ld_shared_b32x2(shared))
    return ld_shared_f32x4(shared)


def ld_global_keys4(address: Int64, bf16: bool):
    """Four keys of a state row as fp32 from a page in global memory; weak."""
    if bf16:
        return widen_bf16x4(ld_global_b32x2(address))
    return ld_global_f32x4(address)


def st_global_keys4(address: Int64, values, bf16: bool):
    """Four fp32 keys of a state row to a page in global memory: a bf16 page's rounded to
    nearest-even (the page's one rounding); weak."""
    if bf16:
        v = list(values)
        st_global_b32x2(address, (cvt_bf16x2(v[0], v[1]), cvt_bf16x2(v[2], v[3])))
    else:
        st_global_f32x4(address, values)


def thread_layout(tid):
    """(lane, warp, channel, section) of thread ``tid``: its lane and warp, its channel of
    the head's 128 and its half of the 256 threads."""
    return tid % 32, tid // 32, tid % 128, tid // 128


def fma2(a, b, c, packed: bool):
    """Element-wise ``fma(a[i], b[i], c[i])`` on a pair (packed on Blackwell)."""
    if packed:
        return cute.arch.fma_packed_f32x2(a, b, c)
    return (cute.math.fma(a[0], b[0], c[0]), cute.math.fma(a[1], b[1], c[1]))


def mul2(a, b, packed: bool):
    """Element-wise ``a[i] * b[i]`` on a pair (packed on Blackwell)."""
    if packed:
        return cute.arch.mul_packed_f32x2(a, b)
    return (a[0] * b[0], a[1] * b[1])


def decay_and_dot(h, dots, c, d4, k4, packed: bool):
    """The recurrence's first pass on one state row's key chunk ``c`` (four fp32 ``h``):
    decay it in place (``h *= d``) and add ``h . k`` into the row's accumulator pairs
    ``dots`` (pair ``(2 c + p) % ACCUMULATORS``), in KdaWide's order."""
    for p in range(2):
        j = (2 * c + p) % ACCUMULATORS
        pair = mul2((h[2 * p], h[2 * p + 1]), (d4[2 * p], d4[2 * p + 1]), packed)
        h[2 * p], h[2 * p + 1] = pair[0], pair[1]
        acc = fma2(pair, (k4[2 * p], k4[2 * p + 1]), (dots[2 * j], dots[2 * j + 1]), packed)
        dots[2 * j], dots[2 * j + 1] = acc[0], acc[1]


def update_and_out(h, outs, c, k4, q4, v, packed: bool):
    """The second pass on the same chunk: the rank-1 update ``h += k v_new`` in place, then
    ``h . q`` into the row's output accumulator pairs ``outs``, in KdaWide's order."""
    for p in range(2):
        j = (2 * c + p) % ACCUMULATORS
        pair = fma2((k4[2 * p], k4[2 * p + 1]), (v, v), (h[2 * p], h[2 * p + 1]), packed)
        h[2 * p], h[2 * p + 1] = pair[0], pair[1]
        acc = fma2(pair, (q4[2 * p], q4[2 * p + 1]), (outs[2 * j], outs[2 * j + 1]), packed)
        outs[2 * j], outs[2 * j + 1] = acc[0], acc[1]


@cute.jit
def delta_rule(
    history,
    shared,
    s_beta,
    s_o,
    state,
    lane_in,
    lanes: cutlass.Constexpr,
    row,
    tokens: cutlass.Constexpr,
    packed: cutlass.Constexpr,
    write_v=None,
    target=None,
    store=None,
    streamed: cutlass.Constexpr = False,
    load=ld_shared_f32x4,
    beta_first: cutlass.Constexpr = True,
):
    """The delta rule per token on a thread's register state (KdaWide, KdaStream, KdaSplit):
    ``history[i][c]`` the four fp32 of chunk ``c`` of the thread's row ``i``, the row's keys
    ``4 (lane_in + lanes c) + [0, 4)`` (a row's ``lanes`` threads adjacent lanes); first pass
    ``S *= d``, ``S . k``; ``v_new = (v - S . k) beta``; second pass ``S += k v_new``,
    ``S . q``; o (bf16) into ``s_o[t, row(i)]``. The variants' differences, all trace time:
    ``row(i)`` the row's index in ``s_v`` / ``s_o``; ``load`` the loader of d and k (q: a
    plain shared load); ``write_v(t, row, v)`` the v record; ``target(t)`` the slot of the
    state after token t (None: not stored) and ``store(state0, target)`` its store, after
    the outputs or, ``streamed``, before the second pass, returning the writer ``(i, c,
    values)`` of each updated chunk; ``beta_first``: beta read before the rows' dots."""
    s_q, s_k, s_v, s_decay = shared
    q0, k0 = Int32(s_q.iterator.toint()), Int32(s_k.iterator.toint())
    d0 = Int32(s_decay.iterator.toint())
    state0 = Int64(state.iterator.toint())
    rows, chunks = len(history), len(history[0])
    for t in cutlass.range_constexpr(tokens):
        chunk_offset = [(t * HEAD_DIM + 4 * (lane_in + lanes * c)) * 4 for c in range(chunks)]
        dots = [[Float32(0.0)] * (2 * ACCUMULATORS) for _ in range(rows)]
        for c in cutlass.range_constexpr(chunks):
            d4 = load(d0 + chunk_offset[c])
            k4 = load(k0 + chunk_offset[c])
            for i in cutlass.range_constexpr(rows):
                decay_and_dot(history[i][c], dots[i], c, d4, k4, packed)
        if cutlass.const_expr(beta_first):
            beta_t = s_beta[t]
        v_new = []
        for i in cutlass.range_constexpr(rows):
            dot = xor_sum(tree_sum(dots[i]), lanes)
            value_row = row(i)
            if cutlass.const_expr(beta_first):
                v = (s_v[t, value_row] - dot) * beta_t
            else:
                v = (s_v[t, value_row] - dot) * s_beta[t]
            v_new.append(v)
            if cutlass.const_expr(write_v is not None):
                write_v(t, value_row, v)
        if cutlass.const_expr(streamed and target is not None):
            store_chunk = store(state0, target(t))
        outs = [[Float32(0.0)] * (2 * ACCUMULATORS) for _ in range(rows)]
        for c in cutlass.range_constexpr(chunks):
            k4 = load(k0 + chunk_offset[c])
            q4 = ld_shared_f32x4(q0 + chunk_offset[c])
            for i in cutlass.range_constexpr(rows):
                update_and_out(history[i][c], outs[i], c, k4, q4, v_new[i], packed)
                if cutlass.const_expr(streamed and target is not None):
                    store_chunk(i, c, history[i][c])
        for i in cutlass.range_constexpr(rows):
            o = xor_sum(tree_sum(outs[i]), lanes)
            if lane_in == 0:
                s_o[t, row(i)] = to_bf16_f32(o)
        if cutlass.const_expr(not streamed and target is not None):
            store(state0, target(t))


def apply_record(h, d4, k4, v, packed: bool):
    """One recorded token on a state row's key chunk (four fp32 ``h``, in place), per key
    pair ``S * decay`` then ``fma(k^, v_new, .)`` (KdaRecover's and KdaReplay's fold)."""
    for p in range(2):
        two = slice(2 * p, 2 * p + 2)
        pair = fma2(k4[two], (v, v), mul2(h[two], d4[two], packed), packed)
        h[2 * p], h[2 * p + 1] = pair[0], pair[1]


@cute.jit
def normalize_rows(rows: cute.Tensor, sums: cute.Tensor, count, n: cutlass.Constexpr):
    """``rows[i] *= rsqrt(sum rows[i]^2 + 1e-6)`` in place for the ``n`` rows of a head's
    128 channels (threads 0-127, one channel each; ``sums[i, w]``: the four warps' partial
    sums of squares), ``-0.0`` past row ``count``: KdaReplay's ring keys, KdaRecover's k."""
    tid, _, _ = cute.arch.thread_idx()
    channel, section = tid % 128, tid // 128
    if section == 0:
        for i in cutlass.range_constexpr(n):
            if i < count:
                fk = rsqrt_f32(quad_sum([sums[i, w] for w in range(4)]) + 1.0e-6)
                rows[i, channel] = rows[i, channel] * fk
            else:
                rows[i, channel] = Float32(-0.0)


@cute.jit
def stage_records(
    op,
    head,
    count,
    n: cutlass.Constexpr,
    rows,
    kg,
    v=None,
    keys_past=True,
    softplus_gate: cutlass.Constexpr = False,
):
    """Records j < ``n`` of a head decoded into shared (KdaRecover's tokens, KdaReplay's
    ring entries): k as fp32 into ``s_k[j, channel]`` (threads 0-127, per-warp sums of
    k^2 into ``sums[j, warp]``), the decay of the bf16 raw gate into ``s_decay`` and
    v_new (``v(j, channel)``; None: in place already) into ``s_v`` (threads 128-255); the
    neutral record (decay 1, v_new +0) past ``count``. ``rows``: (s_k, s_decay, s_v,
    sums); ``kg(j, column)``: column ``column`` of record j's k | raw gate (bf16);
    ``keys_past``: k read past ``count`` too (else +0 there); ``softplus_gate``: the
    decay's form (``decay``)."""
    tid, _, _ = cute.arch.thread_idx()
    lane, warp, channel, section = thread_layout(tid)
    s_k, s_decay, s_v, sums = rows
    if section == 0:
        for j in cutlass.range_constexpr(n):
            if cutlass.const_expr(keys_past):
                k = Float32(kg(j, channel))
            else:
                k = Float32(0.0)
                if j < count:
                    k = Float32(kg(j, channel))
            s_k[j, channel] = k
            squares = warp_sum(k * k)
            if lane == 0:
                sums[j, warp] = squares
    else:
        a = Float32(op.a_log[head])
        dt = Float32(op.dt_bias[head * HEAD_DIM + channel])
        for j in cutlass.range_constexpr(n):
            if j < count:
                raw_g = Float32(kg(j, HEAD_DIM + channel))
                s_decay[j, channel] = decay(a, raw_g, dt, op.lower_bound, softplus_gate)
                if cutlass.const_expr(v is not None):
                    s_v[j, channel] = Float32(v(j, channel))
            else:
                s_decay[j, channel] = Float32(1.0)
                s_v[j, channel] = Float32(0.0)


def tree_sum(values):
    """Pairwise (tree) sum of a power-of-two list of partial sums."""
    values = list(values)
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def quad_sum(r):
    """The four warps' partial sums of a 128-channel head: ``(w0 + w2) + (w1 + w3)``."""
    return (r[0] + r[2]) + (r[1] + r[3])


def gate_projection(weights, activations, gate_mode: int):
    """A warp's raw gate tile D[16 features, 8 tokens] over K = 128 (eight k16 chunks):
    ``gate_mode`` 0 (and 3) one chain of eight MMAs; 1 four chains of two, added in chain
    order after a leading ``0 +``. Returns the four fp32 accumulators of the thread."""
    zero = Float32(0.0)
    chains = 4 if gate_mode == 1 else 1
    acc = [[zero] * 4 for _ in range(chains)]
    for chunk in range(8):
        chain = chunk // 2 if gate_mode == 1 else 0
        acc[chain] = list(mma_bf16_16816(weights[chunk], activations[chunk], acc[chain]))
    if gate_mode != 1:
        return acc[0]
    return [zero + (((acc[0][e] + acc[1][e]) + acc[2][e]) + acc[3][e]) for e in range(4)]


# Error bound of mode 0's chain (gate mode 3; the constants live in kda.dispatch, whose
# tests model the chain in plain torch). mma.sync's fp32 accumulation is not IEEE:
# the bf16 x bf16 products are exact, but each instruction adds its 16 products to the
# accumulator c_j with significands aligned to the largest addend and the bits below
# 24 significant bits of it truncated, then normalises toward zero (tensor-core studies,
# e.g. Fasi et al. 2021; step sizes 4..16 depending on the generation). Whatever the
# internal block or tree structure, one instruction makes at most 32 such truncations
# (<= 16 alignment losses per addition step + one normalisation per step, <= 16 steps
# counted as 16 + s <= 32), each smaller than 2^-23 times a magnitude bounded by
# |c_j| + P_j (P_j = sum of the chunk's |products|). So the chain's fp32 result differs
# from the exact dot by less than
#     2^-23 * 32 * sum_j (|c_j| + P_j) = 2^-18 * (sum_{j=1..7} |c_j| + sum |f_a f_b|),
# with c_j the computed accumulators entering chunk j. sum |f_a f_b| comes from the same
# chain over |f_a|, |f_b| (by the same bound, low by < 8 * 2^-18 = 2^-15 relative: covered
# by the 1/16 margin, as are the fp32 roundings of the bound and the reference's fp64 sum);
# GATE_FLOOR covers flushed subnormals (< 2^-126 per step, 8 .. 128 steps).


def abs_bf16x2(word):
    """Both bf16 halves of a 32-bit word made non-negative (sign bits cleared)."""
    return cute.arch.inline_ptx(
        "and.b32 {$w0}, {$r0}, 0x7fff7fff;", write_only_types=[Uint32], read_only_args=[word]
    )


def gate_projection_bounded(weights, activations):
    """Mode 0's chain (bitwise its accumulators) and, per accumulator, a bound on its
    distance from the exact dot (see GATE_ERROR). Returns (accumulators, bounds)."""
    zero = Float32(0.0)
    acc = [zero] * 4
    mag = [zero] * 4
    spread = [zero] * 4  # sum_j |c_j|
    for chunk in range(8):
        if chunk > 0:
            spread = [spread[e] + cute.math.absf(acc[e]) for e in range(4)]
        acc = list(mma_bf16_16816(weights[chunk], activations[chunk], acc))
    for chunk in range(8):
        magnitudes = [abs_bf16x2(w) for w in weights[chunk]]
        mag = list(mma_bf16_16816(magnitudes, [abs_bf16x2(w) for w in activations[chunk]], mag))
    bound = [
        cute.math.fma(spread[e] + mag[e], Float32(GATE_ERROR), Float32(GATE_FLOOR))
        for e in range(4)
    ]
    return acc, bound


def gate_straddles(value, bound):
    """Whether ``value +- bound`` round to different bf16 (bit patterns, so a sign of zero
    counts): then the bf16 rounding of the exact dot is not decided by ``value``. Rounding
    real -> fp32 -> bf16 is monotone, so equal ends decide every point between."""
    low = f32_bits(to_bf16_f32(value - bound))
    high = f32_bits(to_bf16_f32(value + bound))
    return low != high


def select_i32(cond, a, b):
    """``a if cond else b`` on the device (Int32, no branch)."""
    return cutlass.select_(cond, Int32(a), Int32(b))


def next_flagged(words, select=select_i32, popc=cute.arch.popc):
    """The next undecided value of the four ballot words (``words[e]`` bit l: lane l's
    accumulator e): the lowest lane of the first non-empty word. Returns (found, e, lane,
    the words without it), by selects only (``select``, ``popc``: the device's by
    default; the CPU test passes Python's)."""
    e, word = 3, words[3]
    for i in (2, 1, 0):
        e = select(words[i] != 0, i, e)
        word = select(words[i] != 0, words[i], word)
    lane = popc((word & (0 - word)) - 1)
    rest = [select(e == i, words[i] & (words[i] - 1), words[i]) for i in range(4)]
    return word != 0, e, lane, rest


def exact_dots_warp(rows):
    """The exactly rounded fp32 dots of several pairs of 128-element bf16 rows, computed by
    the whole warp: ``rows`` holds per pair lane l's words of elements 4l..4l+3 of both
    rows (loaded beforehand, so that the loads of all pairs are in flight together); the
    products are exact in fp32, summed in fp64 (as the reference does) in one fixed order,
    the butterflies of the pairs interleaved, and rounded once to fp32."""
    totals = []
    for a, b in rows:
        terms = []
        for i in range(2):
            a_low, a_high = bf16x2_to_f32(a[i])
            b_low, b_high = bf16x2_to_f32(b[i])
            terms.append(Float64(a_low * b_low) + Float64(a_high * b_high))
        totals.append(terms[0] + terms[1])
    for shift in (16, 8, 4, 2, 1):
        totals = [x + cute.arch.shuffle_sync_bfly(x, offset=shift) for x in totals]
    return [Float32(x) for x in totals]


def exact_dot_warp(row_a, row_b):
    """``exact_dots_warp`` of one pair of rows at global addresses ``row_a``, ``row_b``
    (uniform across the warp), loaded here."""
    lane = cute.arch.lane_idx()
    a = ld_global_b32x2(row_a + Int64(lane * 8))
    b = ld_global_nc_b32x2(row_b + Int64(lane * 8))
    return exact_dots_warp([(a, b)])[0]


class GateTile(NamedTuple):
    """Where gate mode 3 settles a warp's tile: decays in ``s_gate[t, first + row]``, row
    ``r`` feature ``16 tile + r`` of ``head``, ``request``'s tokens < ``tokens``; raw-gate
    records with ``record``; ``batch`` values per round."""

    s_gate: object
    first: object
    tile: object
    request: object
    head: object
    tokens: int
    record: bool
    batch: int
    # ``rows(t, feature)``: the lane's words of f_a row t and of the head's f_b row
    # ``feature`` (batched rounds only; None: from global memory; KdaPipe: shared copies)
    rows: object = None
    softplus_gate: bool = False  # the decay's form (``decay``)


@cute.jit
def settle_gate(op, acc, bound, a, dt, where: GateTile):
    """Gate mode 3, after the fast path wrote its decays (and records): the accumulators
    whose bound straddles a bf16 rounding (tokens < T only) are recomputed exactly by the
    whole warp, and the owning lane rewrites ``s_gate[t, first + row]`` (and the raw-gate
    record) from the exact raw gate (``where``). ``batch`` 1: one value at a time
    (``settle_each``); more (up to 32): ``batch`` values per round (``settle_rounds``,
    which takes ``a``, ``dt``: the lane's a_log and dt_bias of rows ``lane // 4``, + 8)."""
    tokens, batch = where.tokens, where.batch
    lane = cute.arch.lane_idx()
    flags = []
    for e in cutlass.range_constexpr(4):
        t = 2 * (lane % 4) + e % 2
        flags.append(cute.arch.vote_ballot_sync(gate_straddles(acc[e], bound[e]) & (t < tokens)))
    if cutlass.const_expr(batch == 1):
        settle_each(op, lane, flags, where)
    else:
        settle_rounds(op, flags, a, dt, where)


@cute.jit
def settle_each(op, lane, flags, where: GateTile):
    """``settle_gate`` lane by lane (lowest first), a lane's flagged accumulators in turn:
    each value's f_a and f_b rows loaded and summed alone; the owner reloads a_log and its
    dt_bias (no registers held across the loop)."""
    s_gate, first, tile, request, head, tokens, record = where[:7]
    stride = HEAD_DIM * 2  # bytes per f_a / f_b row
    lanes = (flags[0] | flags[1]) | (flags[2] | flags[3])
    while lanes != 0:
        source = cute.arch.popc((lanes & (0 - lanes)) - 1)
        for e in cutlass.range_constexpr(4):
            if (flags[e] >> source) & 1 != 0:
                t = 2 * (source % 4) + e % 2
                feature = 16 * tile + source // 4 + 8 * (e // 2)
                row_a = Int64(op.f_a.iterator.toint()) + Int64(request * tokens + t) * stride
                row_b = Int64(op.f_b.iterator.toint()) + Int64(head * HEAD_DIM + feature) * stride
                exact = exact_dot_warp(row_a, row_b)
                if lane == source:
                    raw_g = to_bf16_f32(exact)
                    dt = Float32(op.dt_bias[head * HEAD_DIM + feature])
                    a = Float32(op.a_log[head])
                    column = first + source // 4 + 8 * (e // 2)
                    s_gate[t, column] = decay(a, raw_g, dt, op.lower_bound, where.softplus_gate)
                    if cutlass.const_expr(record):
                        op.kg_records[request, head, t, HEAD_DIM + feature] = BFloat16(raw_g)
        lanes = lanes & (lanes - 1)


@cute.jit
def settle_rounds(op, flags, a, dt, where: GateTile):
    """``settle_gate`` ``batch`` values per round (``next_flagged`` order): the f_a and f_b
    row loads of a round are issued together, the butterflies interleaved, lane ``l``
    computes the decay of the round's value ``l % batch`` (dt_bias shuffled from the
    owner), the owner writes it."""
    s_gate, first, tile, request, head, tokens, record, batch, shared_rows = where[:9]
    lane = cute.arch.lane_idx()
    w0, w1, w2, w3 = flags
    rows_a = Int64(op.f_a.iterator.toint()) + Int64(request * tokens) * (HEAD_DIM * 2)
    rows_b = Int64(op.f_b.iterator.toint()) + Int64(head * HEAD_DIM + 16 * tile) * (HEAD_DIM * 2)
    while ((w0 | w1) | (w2 | w3)) != 0:
        words = [w0, w1, w2, w3]
        found, es, sources = [], [], []
        for k in cutlass.range_constexpr(batch):
            valid, e, source, words = next_flagged(words)
            if cutlass.const_expr(k > 0):  # an empty slot repeats the first one's value
                e, source = select_i32(valid, e, es[0]), select_i32(valid, source, sources[0])
            found.append(valid)
            es.append(e)
            sources.append(source)
        w0, w1, w2, w3 = words
        ts = [2 * (sources[k] % 4) + es[k] % 2 for k in range(batch)]
        rows = [sources[k] // 4 + 8 * (es[k] // 2) for k in range(batch)]
        loaded = []
        for k in cutlass.range_constexpr(batch):
            if cutlass.const_expr(shared_rows is not None):
                loaded.append(shared_rows(ts[k], 16 * tile + rows[k]))
            else:
                words_a = ld_global_b32x2(rows_a + Int64(ts[k] * (HEAD_DIM * 2) + lane * 8))
                words_b = ld_global_nc_b32x2(rows_b + Int64(rows[k] * (HEAD_DIM * 2) + lane * 8))
                loaded.append((words_a, words_b))
        raws = [to_bf16_f32(x) for x in exact_dots_warp(loaded)]
        mine = lane % batch
        raw_g, e, source = raws[0], es[0], sources[0]
        for k in cutlass.range_constexpr(1, batch):
            raw_g = cutlass.select_(mine == k, raws[k], raw_g)
            e, source = select_i32(mine == k, es[k], e), select_i32(mine == k, sources[k], source)
        dt_low = cute.arch.shuffle_sync(dt[0], offset=source)
        dt_high = cute.arch.shuffle_sync(dt[1], offset=source)
        dt_e = cutlass.select_(e >= 2, dt_high, dt_low)
        value = decay(a, raw_g, dt_e, op.lower_bound, where.softplus_gate)
        for k in cutlass.range_constexpr(batch):
            value_k = cute.arch.shuffle_sync(value, offset=k)
            if found[k] & (lane == sources[k]):
                s_gate[ts[k], first + rows[k]] = value_k
                if cutlass.const_expr(record):
                    feature = 16 * tile + rows[k]
                    op.kg_records[request, head, ts[k], HEAD_DIM + feature] = BFloat16(raws[k])
