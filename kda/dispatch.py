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
"""

from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("auto", "wide", "stream")
CTAS_PER_SM = 2
H200_SMS = 132
PACKED_FMA_ARCHS = ("sm_100a", "sm_100f", "sm_103a", "sm_110a")


@dataclass(frozen=True)
class Choice:
    kernel: str  # "wide" or "stream"
    ctas: int  # CTAs launched (grid size for wide, persistent CTAs for stream)
    ahead: int  # wide only: L2 prefetch distance in items (0: off)
    reason: str


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


def choose(requests: int, heads: int, tokens: int, *, sms: int = H200_SMS, kernel: str = "auto"):
    """Pick the kernel for ``requests`` x ``heads`` items of ``tokens`` tokens each."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
    if requests < 1 or heads < 1 or not 1 <= tokens <= 8 or sms < 1:
        raise ValueError(
            f"need requests >= 1, heads >= 1, tokens in 1..8, sms >= 1; "
            f"got {requests}, {heads}, {tokens}, {sms}"
        )
    items = requests * heads
    resident = CTAS_PER_SM * sms
    waves = -(-items // resident)
    if kernel == "auto":
        if items <= resident:
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
    if kernel == "wide":
        ahead = resident if items > resident else 0
        return Choice("wide", items, ahead, why)
    return Choice("stream", min(items, resident), 0, why)
