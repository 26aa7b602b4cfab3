"""Which KDA decode kernel runs a step, in plain Python (unit-tested on the CPU).

``choose(...)`` returns a ``Choice`` with the kernel name, its launch knobs and a
sentence saying why. The rule follows the kernels' costs and the H200 measurement
(``scripts/bench_kda.py``, 2026-11-29):

- KdaWide runs one CTA per (request, head) item, two CTAs per SM. When every item is
  resident in one wave (items <= 2 x SMs) nothing is left to overlap: Wide.
- Several waves, T = 1: KdaStream (persistent, two CTAs per SM) streams the next item's
  64 KB page and operands during the current recurrence: Stream (measured level with or
  slightly ahead of Wide: 113 vs 118 us at H = 12, B = 128).
- Several waves, T > 1: Wide. Stream holds the next item's operands and the current
  state together and spills at T >= 4 (ptxas: 0.3-1 KB of local memory per thread);
  measured 1618 (Wide) vs 1848 us (Stream) at H = 96, B = 128, T = 4.
- Wide with several waves prefetches into L2 the page of the item one wave ahead
  (``ahead`` = resident CTAs).
- A few items (``items * 2 <= SPLIT_MAX_CTAS_PER_SM * sms``): KdaSplit. One CTA per item
  would leave most SMs idle and the step latency-bound on one CTA's serial work (the
  recurrence over 128 rows); splitting each head's rows over a cluster of C CTAs cuts that
  by up to C at the price of repeated conv / gate work per CTA and two cluster exchanges.
  The cluster is the largest C in (8, 4, 2) with ``items * C <= SPLIT_MAX_CTAS_PER_SM *
  sms``: at most one CTA per SM.

Measured crossover (H200, ``python scripts/bench_kda.py --small``, CUDA graphs, us per
step; the best kernel of each row is the one this rule picks):

    H  B  T | items | wide | split2 | split4 | split8 | rule
    6  1  1 |   6   |  6.5 |   5.9  |   5.3  |   5.1  | split8
    6  2  1 |  12   |  7.6 |   6.9  |   6.5  |   6.3  | split8 (96 CTAs)
    6  4  1 |  24   |  7.8 |   7.2  |   6.9  |   7.7  | split4 (split8: 192 CTAs > 132 SMs)
    6  8  1 |  48   |  8.2 |   7.8  |   8.9  |  12.9  | split2
   12  4  1 |  48   |  8.3 |   7.8  |   8.7  |  12.7  | split2
   12  8  1 |  96   |  9.7 |  10.6  |  14.4  |  19.6  | wide (split2: 192 CTAs)
    6  1  4 |   6   | 15.8 |  12.6  |  10.9  |  10.1  | split8
   12  2  4 |  24   | 16.4 |  13.0  |  11.6  |  12.0  | split4
   12  4  4 |  48   | 16.9 |  14.1  |  14.4  |  21.7  | split2
   12  8  4 |  96   | 19.9 |  19.9  |  26.4  |  38.9  | wide

  Past one CTA per SM a cluster's CTAs share SMs and the split loses its point: every
  measured shape's best kernel is the rule's choice (within 1%).
"""

from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("auto", "wide", "stream", "split", "lean")  # "lean": opt-in only, never auto
CLUSTERS = (2, 4, 8)
CTAS_PER_SM = 2
# KdaSplit while its CTAs fit this many per SM (measured crossover: the table above; at
# H = 6 split runs up to B = 11 with cluster 2, B <= 2 with cluster 8).
SPLIT_MAX_CTAS_PER_SM = 1
# KdaSplit is in the auto choice (GPU-validated against the reference on the H200).
SPLIT_IN_AUTO = True
H200_SMS = 132
PACKED_FMA_ARCHS = ("sm_100a", "sm_100f", "sm_103a", "sm_110a")


@dataclass(frozen=True)
class Choice:
    kernel: str  # "wide", "stream", "split" or "lean"
    ctas: int  # CTAs launched (grid size for wide / split, persistent CTAs for stream / lean)
    ahead: int  # wide only: L2 prefetch distance in items (0: off)
    reason: str
    cluster: int = 1  # split only: CTAs per (request, head) item (2, 4 or 8)


def arch_of(capability) -> str:
    """CuTe DSL target for a CUDA compute capability ``(major, minor)``."""
    major, minor = capability
    if major < 9:
        raise ValueError(f"KDA kernels need sm_90 or newer; got sm_{major}{minor}")
    if major == 9:
        return "sm_90a"
    if major == 10:
        return "sm_100a" if minor == 0 else f"sm_10{minor}a"
    return f"sm_{major}{minor}a"


def has_packed_fma(arch: str) -> bool:
    """Packed fp32 FMA (``fma.rn.f32x2``) exists on Blackwell datacenter parts only."""
    return arch in PACKED_FMA_ARCHS


LEAN_SMEM_PER_SM = 228 * 1024  # sm_90 / sm_100: shared memory per SM (1 KB reserved per CTA)
# Three KdaLean CTAs per SM cap registers at 80: ptxas (sm_90a, T = 1) then spills ~300 B
# per thread in the recurrence; at two (128 registers) it spills nothing. Off until a
# measurement says otherwise.
LEAN_THREE_PER_SM = False
# KdaLean is launched as a programmatic dependent of KdaPrepare (it stages its first state
# page while the prepass finishes); False: a plain stream-ordered second launch.
LEAN_PDL = True
# The lean path's prepass: "cta" (kda.prepass.KdaPrepare: one 256-thread CTA per item) or
# "warp" (kda.prepass_warp.KdaPrepareWarp: one warp per item, 8 items per CTA, no CTA
# barrier; bitwise the same scratch, conv pages and records; GPU-tested). The lean path
# measured slower than KdaStream on the H200 (bench_kda --lean, H 96 B 128 T 1: 640 us vs
# 556 us; H 12 B 128 T 4: 222 us vs 201 us for KdaWide), so "auto" never picks it.
LEAN_PREPASS = "cta"
LEAN_PREPASSES = ("cta", "warp")


def lean_smem_bytes(tokens: int) -> int:
    """Shared memory of one KdaLean CTA (bytes): the staged state page (64 KB), two
    parities of the item vectors (q^, k^, v, decay, sigmoid(gate): 5 x T x 128 fp32, and
    T 16-byte beta granules), o (T x 128 fp32), the o^2 warp sums, 256 B of alignment."""
    page = 128 * 128 * 4
    vectors = 2 * (5 * tokens * 128 * 4 + tokens * 16)
    return page + vectors + tokens * 128 * 4 + tokens * 4 * 4 + 256


def lean_ctas_per_sm(tokens: int, three: bool | None = None) -> int:
    """KdaLean's resident CTAs per SM (256 threads each; the register cap follows:
    65536 / (256 x CTAs)): 3 where ``three`` (default ``LEAN_THREE_PER_SM``) and three
    CTAs' shared memory fit (T = 1 only), else 2."""
    three = LEAN_THREE_PER_SM if three is None else three
    fits = 3 * (lean_smem_bytes(tokens) + 1024) <= LEAN_SMEM_PER_SM
    return 3 if three and fits else 2


def split_cluster(items: int, sms: int) -> int:
    """The largest cluster in (8, 4, 2) whose CTAs fit ``SPLIT_MAX_CTAS_PER_SM`` per SM
    (0: not even cluster 2 fits, KdaSplit is not the choice)."""
    for cluster in reversed(CLUSTERS):
        if items * cluster <= SPLIT_MAX_CTAS_PER_SM * sms:
            return cluster
    return 0


def choose(
    requests: int,
    heads: int,
    tokens: int,
    *,
    sms: int = H200_SMS,
    kernel: str = "auto",
    cluster: int | None = None,
    split_in_auto: bool | None = None,
):
    """Pick the kernel for ``requests`` x ``heads`` items of ``tokens`` tokens each;
    ``cluster`` forces KdaSplit's cluster size (only with ``kernel="split"``)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
    if requests < 1 or heads < 1 or not 1 <= tokens <= 8 or sms < 1:
        raise ValueError(
            f"need requests >= 1, heads >= 1, tokens in 1..8, sms >= 1; "
            f"got {requests}, {heads}, {tokens}, {sms}"
        )
    if cluster is not None and (kernel != "split" or cluster not in CLUSTERS):
        raise ValueError(
            f"cluster must be None or one of {CLUSTERS} with kernel='split'; "
            f"got cluster={cluster!r}, kernel={kernel!r}"
        )
    items = requests * heads
    resident = CTAS_PER_SM * sms
    waves = -(-items // resident)
    fits = split_cluster(items, sms)
    use_split = SPLIT_IN_AUTO if split_in_auto is None else split_in_auto
    if kernel == "auto":
        if fits and use_split:
            kernel = "split"
            why = (
                f"{items} items x cluster {fits} <= {SPLIT_MAX_CTAS_PER_SM} CTA(s) per SM on "
                f"{sms} SMs: split spreads each head's rows over the idle SMs"
            )
        elif items <= resident:
            kernel, why = "wide", f"{items} items fit one wave of {resident} resident CTAs: wide"
        elif tokens == 1:
            kernel = "stream"
            why = (
                f"{items} items are {waves} waves of {resident} resident CTAs, T = 1: stream "
                "overlaps each next item's state load with the current recurrence"
            )
        else:
            kernel = "wide"
            why = (
                f"{items} items are {waves} waves of {resident} resident CTAs but T = {tokens}"
                " > 1: wide (stream spills registers at T >= 4), L2 prefetch one wave ahead"
            )
    else:
        why = f"kernel={kernel!r} requested ({items} items, {waves} wave(s) of {resident})"
    if kernel == "split":
        size = cluster or fits or CLUSTERS[0]
        return Choice("split", items * size, 0, why, cluster=size)
    if kernel == "wide":
        ahead = resident if items > resident else 0
        return Choice("wide", items, ahead, why)
    if kernel == "lean":
        return Choice("lean", min(items, lean_ctas_per_sm(tokens) * sms), 0, why)
    return Choice("stream", min(items, resident), 0, why)
