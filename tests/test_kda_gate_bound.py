"""CPU check of gate mode 3's error bound (``kda.dispatch.GATE_ERROR``, ``GATE_FLOOR``) on
a plain-torch model of mma.sync's fp32 accumulation: the products are exact; each
hardware step adds ``n`` of a k16 chunk's products to the accumulator with significands
aligned to the largest addend, ``extra`` bits kept below its 24, the rest truncated, and
the sum normalised toward zero. The kernel's test (``gate_straddles``: ``dot -+ bound``
round to different bf16) must flag every value whose bf16 rounding differs from the
exactly rounded dot's, for every step size and alignment width modelled; a bound 2^12
times smaller must not (so the data has flips to catch)."""

from __future__ import annotations

import pytest
import torch

from kda.dispatch import GATE_ERROR, GATE_FLOOR

K, CHUNK = 128, 16


def _truncate_to_fp32(x):
    """``x`` (float64) rounded toward zero to 24 significant bits (fp32 range)."""
    mag = x.abs()
    exp = torch.floor(torch.log2(mag.clamp_min(2.0**-126)))
    unit = torch.exp2(exp - 23)
    return torch.where(mag == 0, x, torch.trunc(x / unit) * unit)


def _mma_step(acc, products, extra):
    """One hardware step: ``acc`` + the products (float64, exact values) aligned to the
    largest addend's exponent with ``extra`` bits below its 24, truncated, summed exactly,
    normalised toward zero."""
    terms = torch.cat([acc[:, None], products], dim=1)
    top = terms.abs().amax(dim=1, keepdim=True).clamp_min(2.0**-126)
    unit = torch.exp2(torch.floor(torch.log2(top)) - 23 - extra)
    aligned = torch.trunc(terms / unit) * unit  # toward zero; sums of < 2^31 units: exact
    return _truncate_to_fp32(aligned.sum(dim=1))


def mma_chain(a, b, step, extra):
    """Mode 0's chain of eight k16 MMAs on bf16 rows ``a``, ``b`` [N, 128]: returns the
    fp32 result and ``sum_{j=1..7} |c_j|`` (accumulators entering chunks 1..7, summed in
    fp32 as the kernel does)."""
    products = a.double() * b.double()
    acc = torch.zeros(a.shape[0], dtype=torch.float64)
    spread = torch.zeros(a.shape[0], dtype=torch.float32)
    for chunk in range(K // CHUNK):
        if chunk > 0:
            spread = spread + acc.float().abs()
        for s in range(0, CHUNK, step):
            acc = _mma_step(acc, products[:, chunk * CHUNK + s : chunk * CHUNK + s + step], extra)
    return acc.float(), spread


def flagged(a, b, step, extra, error=GATE_ERROR):
    """The kernel's decision per dot: (mma value, straddles)."""
    value, spread = mma_chain(a, b, step, extra)
    mag, _ = mma_chain(a.abs(), b.abs(), step, extra)
    bound = torch.addcmul(
        torch.full_like(value, GATE_FLOOR), spread + mag, torch.full_like(value, error)
    )  # fp32 fma up to one rounding: the margin in GATE_ERROR covers it
    low = (value - bound).to(torch.bfloat16).view(torch.int16)
    high = (value + bound).to(torch.bfloat16).view(torch.int16)
    return value, low != high


def _rows(n, seed, scale):
    """``n`` random bf16 row pairs (f_a-like ``a`` at ``scale``, f_b-like ``b``); the second
    half cancels: its two halves' products nearly opposite, so the dot is ~1/100 of
    ``sum |a b|`` and the order's error large against the dot's bf16 ulp."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, K, generator=g) * scale
    b = torch.randn(n, K, generator=g) * K**-0.5
    half, h = n // 2, K // 2
    noise = 1.0 + 2.0**-6 * torch.randn(n - half, h, generator=g)
    a[half:, h:] = a[half:, :h] * noise
    b[half:, h:] = -b[half:, :h]
    return a.to(torch.bfloat16), b.to(torch.bfloat16)


@pytest.mark.parametrize("step,extra", [(16, 0), (8, 0), (4, 0), (16, 3)])
def test_bound_flags_every_flip(step, extra):
    n = 16000
    a, b = _rows(n, 7 + step + extra, 0.7)
    exact = (a.double() * b.double()).sum(-1).float()
    value, flag = flagged(a, b, step, extra)
    bits = value.to(torch.bfloat16).view(torch.int16)
    flips = bits != exact.to(torch.bfloat16).view(torch.int16)
    assert not (flips & ~flag).any(), f"{int((flips & ~flag).sum())} unflagged flips"
    # The fast path serves most plain values; the flips exist (a bound 2^14 times smaller
    # misses some, so the check above can fail).
    rate = flag[: n // 2].float().mean().item()
    assert rate < 0.1, rate
    _, tight = flagged(a, b, step, extra, error=GATE_ERROR * 2.0**-14)
    assert (flips & ~tight).any()
    print(f"step {step} extra {extra}: flips {int(flips.sum())}, flagged {rate:.4f} (plain)")


def test_bound_contains_the_exact_dot():
    """Stronger than the flip check: |mma - exact| <= bound for every modelled value, at
    f_a scales from 2^-20 to 2^20 (not powers of two too); the plain rows' flag rate (exact
    recomputes) stays under 10% at every scale."""
    for scale in (2.0**-20, 1.0, 0.7, 3.0, 2.0**20):
        a, b = _rows(4000, 3, scale)
        exact = (a.double() * b.double()).sum(-1)
        for step, extra in ((16, 0), (4, 0)):
            value, spread = mma_chain(a, b, step, extra)
            mag, _ = mma_chain(a.abs(), b.abs(), step, extra)
            bound = (spread + mag).double() * GATE_ERROR + GATE_FLOOR
            assert ((value.double() - exact).abs() <= bound).all(), (scale, step)
        rate = flagged(a, b, 16, 0)[1][:2000].float().mean().item()
        assert rate < 0.1, (scale, rate)
        print(f"scale {scale}: flagged {rate:.4f} (plain)")


def test_next_flagged_takes_every_flag_once():
    """``kda.kernels.device.next_flagged`` (settle_rounds' picker, run here on Python ints): rounds
    of KdaSplit's ``settle_batch`` picks take every flagged (accumulator, lane) of the four
    ballot words once, accumulator-major and lowest lane first, then report nothing found."""
    pytest.importorskip("cutlass")
    from kda.kernels.device import next_flagged
    from kda.kernels.split import KdaSplit

    batch = KdaSplit.settle_batch
    assert batch > 1

    def select(cond, a, b):
        return a if cond else b

    def popc(x):
        return bin(x & 0xFFFFFFFF).count("1")

    g = torch.Generator().manual_seed(5)
    cases = [[0, 0, 0, 0], [1 << 31, 0, 0, 1], [0, 0xFFFFFFFF, 0, 0x80000001]]
    for _ in range(200):
        bits = torch.rand(4, 32, generator=g) < torch.rand(1, generator=g).item() * 0.3
        cases.append([sum(1 << i for i in range(32) if bits[e, i]) for e in range(4)])
    for words in cases:
        expected = [(e, lane) for e in range(4) for lane in range(32) if words[e] >> lane & 1]
        taken, rounds = [], 0
        while any(words):
            rounds += 1
            for _ in range(batch):
                found, e, lane, words = next_flagged(words, select, popc)
                if found:
                    taken.append((e, lane))
                else:
                    assert words == [0, 0, 0, 0]
        assert taken == expected
        assert rounds == -(-len(expected) // batch)
