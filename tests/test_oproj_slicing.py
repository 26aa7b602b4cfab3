"""CPU tests of the o-projection's hidden-width geometry (``plan.slicing``): the rule that
splits any multiple of 256 over a consumer cluster, the groups it allows, twoshot where
``hid % (8 TP) == 0`` and one-shot elsewhere, and the refusals naming the argument."""

import pytest
import torch

from tpcomm.oproj import bound
from tpcomm.oproj import plan as P

WIDTHS = range(256, 8192 + 1, 256)


@pytest.mark.parametrize(
    "hid, ctas, columns",
    [
        (256, 1, 256),
        (512, 1, 512),
        (768, 1, 768),
        (1024, 1, 1024),
        (1280, 5, 256),  # 1 x 1280 would pass 1024 columns: 5 x 256
        (2048, 2, 1024),
        (2304, 3, 768),  # Kimi-Linear: 9 x 256
        (2816, 1, 2816),  # 11 x 256: no n <= 8 but 1 divides 11
        (5120, 5, 1024),
        (6912, 3, 2304),  # 27 x 256: 9 and 27 CTAs exceed 8
        (7168, 7, 1024),  # Kimi-K3
        (8192, 8, 1024),
    ],
)
def test_slicing_examples(hid, ctas, columns):
    s = P.slicing(hid)
    assert (s.ctas, s.columns, s.threads) == (ctas, columns, columns // 8)


@pytest.mark.parametrize("hid", WIDTHS)
def test_slicing_rule(hid):
    """Whole warps per group, at most 8 CTAs tiling HID; the fewest CTAs with slices of at
    most 1024 columns, else the most CTAs; multiples of 1024 keep 1024-column slices."""
    s = P.slicing(hid)
    assert 1 <= s.ctas <= P.MAX_CLUSTER and s.ctas * s.columns == hid
    assert s.columns % 256 == 0 and s.threads % 32 == 0 and s.threads <= P.MAX_CTA_THREADS
    assert s.warps == s.columns // 256
    ns = [n for n in range(1, 9) if (hid // 256) % n == 0]
    narrow = [n for n in ns if hid // n <= 1024]
    assert s.ctas == (min(narrow) if narrow else max(ns))
    if hid % 1024 == 0:
        assert (s.ctas, s.columns) == (hid // 1024, 1024)
    assert s.max_groups == min(4, 1024 // s.threads) >= 1


@pytest.mark.parametrize("hid", [0, -1024, 100, 1000, 1024 + 128, 8192 + 256, 1024.0, True, "1024"])
def test_hidden_refused_naming_it(hid):
    P.slicing(1024)  # cached: an equal float or bool is still refused
    with pytest.raises(ValueError, match="hidden"):
        P.check_hidden(hid)
    with pytest.raises(ValueError, match="hid"):
        P.slicing(hid)
    with pytest.raises(ValueError, match="hid"):
        P.choose(8, 4, hid)


def test_groups_bounded_by_the_slice():
    """A CTA holds at most 1024 threads: wide slices allow fewer groups, which ``choose``
    takes (each polling more slots) and ``check_config`` enforces, naming groups."""
    assert P.choose(16, 4, 2816, twoshot=False).groups == 2  # 352-thread groups
    assert P.choose(16, 4, 4352, twoshot=False).groups == 1  # 544
    assert P.choose(16, 4, 2304, twoshot=False).groups == 4
    P.check_config(16, 2816, 8, 2, 0)
    with pytest.raises(ValueError, match="groups"):
        P.check_config(16, 2816, 8, 3, 0)
    with pytest.raises(ValueError, match="groups"):
        P.check_config(16, 4352, 8, 2, 0)


def test_launch_bound_and_shared_memory_follow_the_slice():
    assert [P.min_blocks_per_sm(g) for g in (1, 2, 3, 4)] == [8, 4, 2, 2]
    assert [P.min_blocks_per_sm(g, 96) for g in (1, 4)] == [10, 2]
    assert P.min_blocks_per_sm(1, 992) == 1
    # prefetch rows and warp sums scale with the slice; 1024-column slices as before
    assert P.smem_bytes(2304, 0, 1) < P.smem_bytes(1024, 0, 1) < P.smem_bytes(2816, 0, 1)
    layout = dict(enumerate(P.smem_layout(2304, 8, 4)))
    assert layout[1][0] == 12 * 96 * 16 and layout[2][0] == 3 * 96 * 32
    assert P.hint_quota(2304, 5) == 15 and P.hint_quota(7168, 5) == 35


def twoshot_tps(hid):
    return [tp for tp in range(1, 17) if hid % (8 * tp) == 0]


def test_twoshot_pairs():
    """Twoshot holds where rank s's HID / TP columns are whole 16-byte groups: every
    power-of-two TP for every width; odd factors of TP must divide HID / 256."""
    assert twoshot_tps(2304) == [1, 2, 3, 4, 6, 8, 9, 12, 16]
    assert twoshot_tps(5120) == [1, 2, 4, 5, 8, 10, 16]
    assert twoshot_tps(7168) == [1, 2, 4, 7, 8, 14, 16]
    assert twoshot_tps(256) == [1, 2, 4, 8, 16]
    for hid in WIDTHS:
        assert {1, 2, 4, 8, 16} <= set(twoshot_tps(hid))


@pytest.mark.parametrize("hid", [256, 2304, 5120, 7168])
@pytest.mark.parametrize("tp", range(8, 17))
def test_plan_takes_twoshot_where_it_holds(hid, tp):
    """Above the measured crossover (TP >= 8, 64 rows) the per-rank plan is twoshot exactly
    where the divisibility holds, else one-shot saying why; asking for it there is refused."""
    p = P.choose(tp, 64, hid)
    assert p.twoshot == (hid % (8 * tp) == 0), p.reason
    if not p.twoshot:
        assert "twoshot needs hid divisible by 8 * TP" in p.reason
        with pytest.raises(ValueError, match="twoshot"):
            P.choose(tp, 64, hid, twoshot=True)
        with pytest.raises(ValueError, match="twoshot"):
            P.check_config(tp, hid, 2, 1, 0, twoshot=True)


@pytest.mark.parametrize("hid", [256, 1280, 2304, 2816])
def test_bound_tree_dot_follows_the_slicing(hid):
    """The allowance's model of the consumer's dot order reshapes by the slice's warps and
    stays within the fp32 error bound of the exact dot."""
    g = torch.Generator().manual_seed(hid)
    a, b = torch.randn(3, hid, generator=g), torch.randn(3, hid, generator=g)
    exact = (a.double() * b.double()).sum(-1)
    got = bound.tree_dot(a, b).double()
    scale = (a.double() * b.double()).abs().sum(-1)
    assert ((got - exact).abs() <= hid * bound.U * scale).all()
