"""Which KDA decode kernel runs a step, in plain Python (unit-tested on the CPU).

``choose(...)`` returns a ``Choice``: the kernel, its launch knobs and a sentence saying
why. Wide for one wave of items, Pipe / Stream for several waves, Split for a few items
(at most one cluster CTA per SM; at T = 1 cluster 2 up to two per SM); the rule and its
H200 measurements: docs/kda_dispatch.md.
"""

from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("auto", "wide", "stream", "split", "pipe")
CLUSTERS = (2, 4, 8)
GATE_MODES = (0, 1, 3)  # raw gate: 0/1 seed mma orders, 3 bounded + exact (default)
# Gate mode 3's bound on the mma chain's error (derivation: kda.kernels.device, above
# gate_projection_bounded): GATE_ERROR * (sum_j |c_j| + sum |f_a f_b|) + GATE_FLOOR.
GATE_ERROR = 2.0**-18 * (1.0 + 1.0 / 16.0)
GATE_FLOOR = 2.0**-118
CTAS_PER_SM = 2
# KdaSplit while its CTAs fit this many per SM (the measured crossover: docs/kda_dispatch.md).
SPLIT_MAX_CTAS_PER_SM = 1
# ... and, at T = 1, cluster 2 while its CTAs fit two per SM (all co-resident). H200,
# 2026-12-06, bench_kda.py --splits --pdl (docs/data/kda_peer_splits_h200.json), us: H 12 B 8
# (96 items) split2 7.9 / wide 10.0, H 3 B 32 7.9 / 9.9; past it H 6 B 32 (192 items, 384
# CTAs) split2 16.3 / wide 12.9. Larger clusters past one per SM lose (H 6 B 8: split4 6.2 /
# split2 5.7; H 3 B 8: split8 5.4 / split4 4.5).
SPLIT_PAIR_MAX_CTAS_PER_SM = 2
# KdaStream for several waves up to this many tokens, KdaWide past it. Measured on the H200
# with the default gate (bench_kda.py --verify, docs/kda_dispatch.md): Stream ahead of Wide
# on every row at T = 2 and 4 (3-10%), behind at T = 8 (up to 1.5x: T = 5..8 still spill).
STREAM_MAX_TOKENS = 4
# KdaPipe (fp32 or bf16 pages) for several waves at these tokens per step. H200, 2026-12-01,
# bench_kda.py, us per step pipe / stream / wide (docs/kda_dispatch.md): T 1 H96 B128
# 482 / 545 / -, H12 B128 70 / 81 / -; T 2 H96 B128 805 / 816, H12 B128 108 / 119. At T >= 3
# the prep group writes the output (KdaPipe.prep_output): T 4 pipe ahead of stream on every
# several-wave row (H96 B128 1284 / 1322, H12 B128 171 / 190, H12 B32 50 / 63), T 6 ahead of
# stream and wide (H96 B128 1765 / 1829 / 1955, H12 B128 241 / 267 / 273). T 3 behind
# stream (H96 B128 1317 / 1087, H12 B128 168 / 158: its ptxas spills are the highest,
# 56 / 48 B against 36 / 24 at T 4) and T 5 not yet measured: stream / wide there. T 7-8
# do not fit pipe's shared memory at W = T + 2.
PIPE_TOKENS = (1, 2, 4, 6)
H200_SMS = 132
PACKED_FMA_ARCHS = ("sm_100a", "sm_100f", "sm_103a", "sm_110a")


@dataclass(frozen=True)
class Choice:
    kernel: str  # "wide", "stream", "split" or "pipe"
    ctas: int  # CTAs launched (grid size for wide / split, persistent CTAs for stream / pipe)
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


def split_cluster(items: int, sms: int, tokens: int = 1) -> int:
    """The largest cluster in (8, 4, 2) whose CTAs fit ``SPLIT_MAX_CTAS_PER_SM`` per SM; at
    T = 1 else cluster 2 while its CTAs fit ``SPLIT_PAIR_MAX_CTAS_PER_SM`` per SM (0: none
    fits, KdaSplit is not the choice)."""
    for cluster in reversed(CLUSTERS):
        if items * cluster <= SPLIT_MAX_CTAS_PER_SM * sms:
            return cluster
    if tokens == 1 and items * CLUSTERS[0] <= SPLIT_PAIR_MAX_CTAS_PER_SM * sms:
        return CLUSTERS[0]
    return 0


def choose(
    requests: int,
    heads: int,
    tokens: int,
    *,
    sms: int = H200_SMS,
    kernel: str = "auto",
    cluster: int | None = None,
    records: bool = False,
):
    """Pick the kernel for ``requests`` x ``heads`` items of ``tokens`` tokens each;
    ``cluster`` forces KdaSplit's cluster size (only with ``kernel="split"``); ``records``:
    the step writes records (a verify step to recover from), which KdaPipe has no mode for."""
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
    fits = split_cluster(items, sms, tokens)
    if kernel == "auto":
        if fits:
            kernel = "split"
            per_sm = -(-items * fits // sms)
            why = (
                f"{items} items x cluster {fits} fit {per_sm} CTA(s) per SM on {sms} SMs: "
                "split spreads each head's rows over the idle SMs"
            )
        elif items <= resident:
            kernel, why = "wide", f"{items} items fit one wave of {resident} resident CTAs: wide"
        elif tokens in PIPE_TOKENS and not records:
            kernel = "pipe"
            why = (
                f"{items} items are {waves} waves of {resident} resident CTAs, T = {tokens}: "
                "pipe (one CTA per SM: one warp group prepares the next item's vectors while "
                "the other runs the recurrence, several pages in flight; stream where pipe "
                "cannot run: record mode, a window past its shared memory)"
            )
        elif tokens <= STREAM_MAX_TOKENS:
            kernel = "stream"
            why = (
                f"{items} items are {waves} waves of {resident} resident CTAs, T = {tokens} "
                f"{'with records' if records else f'not in {PIPE_TOKENS}'}: stream overlaps "
                "each next item's state load with the current recurrence (pipe has no record "
                "mode, and is measured behind or not measured at the other T)"
            )
        else:
            kernel = "wide"
            why = (
                f"{items} items are {waves} waves of {resident} resident CTAs but T = {tokens}"
                f" > {STREAM_MAX_TOKENS}: wide (stream measured behind there), L2 prefetch"
                " one wave ahead"
            )
    else:
        why = f"kernel={kernel!r} requested ({items} items, {waves} wave(s) of {resident})"
    if kernel == "split":
        size = cluster or fits or CLUSTERS[0]
        return Choice("split", items * size, 0, why, cluster=size)
    if kernel == "wide":
        ahead = resident if items > resident else 0
        return Choice("wide", items, ahead, why)
    if kernel == "pipe":
        return Choice("pipe", min(items, sms), 0, why)
    return Choice("stream", min(items, resident), 0, why)


# ``kda.replay_decode``'s kernel: KdaReplay, one CTA per item, three per SM. A persistent
# variant that copied each next item's page during the current one (KdaReplayStream, two CTAs
# per SM) ran at 0.77-0.94x of its speed at T = 1 and won 3 of 12 T = 4 rows by <= 5% on the
# H200 (2026-12-01, ``bench_kda.py --replay-only``), so it went; two CTAs per SM for verify
# steps (128 registers, no spills) ran at 0.86-1.10x of three, slower at the large shapes.
# Replay itself pays only from ~400 items at R 4 / 8 (docs/replay.md): below that,
# or at R 16, the per-step path is faster, and the engine's state mode decides, not this.
REPLAY_KERNELS = ("auto", "wide")
REPLAY_CTAS_PER_SM = 3


def choose_replay(requests, heads, tokens, size, *, sms=H200_SMS, kernel="auto") -> Choice:
    """The replay step's kernel for ``requests`` x ``heads`` items of ``tokens`` tokens and
    a ring of ``size``: KdaReplay ("wide"), one CTA per item."""
    if kernel not in REPLAY_KERNELS:
        raise ValueError(f"kernel must be one of {REPLAY_KERNELS}; got {kernel!r}")
    items = requests * heads
    resident = REPLAY_CTAS_PER_SM * sms
    why = (
        f"{items} items, T = {tokens}, R = {size}: wide, one CTA per item ({resident} resident: "
        f"{REPLAY_CTAS_PER_SM} per SM, the page read where it lies)"
    )
    return Choice("wide", items, 0, why)
