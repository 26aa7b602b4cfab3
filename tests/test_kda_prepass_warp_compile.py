"""CPU compile checks of KdaPrepareWarp (``kda.prepass_warp``: the lean path's prepass with
one warp per item, ``kda.dispatch.LEAN_PREPASS = "warp"``) for sm_90a and sm_100a, and a
ptxas register / spill report next to KdaPrepare's where ptxas is on PATH."""

from __future__ import annotations

import re

import pytest
from compile_harness import ARCHS, compile_for, require_dsl
from test_kda_lean_compile import prepare_args, ptxas_report

pytestmark = pytest.mark.compile

WARP_CASES = [
    # heads, tokens, record, gate_mode, has_bias, conv_dim_first, window, pdl
    (2, 1, False, 0, True, True, 3, False),
    (3, 1, False, 1, False, False, 4, True),
    (2, 1, False, 2, True, False, 3, False),
    (3, 4, False, 1, False, False, 8, True),
    (2, 4, True, 0, False, True, 6, True),
    (2, 4, True, 2, True, True, 7, False),
    (2, 8, True, 2, True, False, 10, False),
    (2, 8, False, 1, True, True, 11, False),
    (3, 8, True, 0, False, False, 12, True),
    (2, 3, True, 1, True, False, 6, False),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", WARP_CASES, ids=lambda c: "H{}T{}r{}g{}b{}d{}W{}p{}".format(*c))
def test_prepare_warp_compiles(arch, case):
    require_dsl()
    from kda.prepass_warp import KdaPrepareWarp

    heads, tokens, record, gate_mode, has_bias, dim_first, window, pdl = case
    kernel = KdaPrepareWarp(heads, tokens, record, gate_mode, has_bias, arch=arch, pdl=pdl)
    args = prepare_args(
        heads, tokens, record=record, has_bias=has_bias, conv_dim_first=dim_first, window=window
    )
    assert compile_for(arch, kernel, *args) is not None


def test_prepare_warp_config():
    require_dsl()
    from kda.prepass_warp import KdaPrepareWarp, default_ctas_per_sm

    with pytest.raises(ValueError, match="tokens"):
        KdaPrepareWarp(2, 9)
    with pytest.raises(ValueError, match="record"):
        KdaPrepareWarp(2, 1, True)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        KdaPrepareWarp(2, 1, ctas_per_sm=-1)
    assert default_ctas_per_sm(1, 2) == 3 and default_ctas_per_sm(2, 0) == 3
    assert default_ctas_per_sm(2, 2) == 2 and default_ctas_per_sm(8, 0) == 2
    assert KdaPrepareWarp(2, 4).ctas_per_sm == 2


def test_lean_prepass_switch():
    from kda import dispatch

    assert dispatch.LEAN_PREPASS == "cta"  # the default stays KdaPrepare
    assert dispatch.LEAN_PREPASSES == ("cta", "warp")


REPORT_CASES = [
    # tokens, record, gate_mode
    (1, False, 0),
    (1, False, 2),
    (2, False, 1),
    (4, False, 0),
    (4, True, 1),
    (4, False, 2),
    (8, True, 0),
    (8, False, 1),
    (8, True, 2),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", REPORT_CASES, ids=lambda c: "T{}r{}g{}".format(*c))
def test_warp_static_resources(arch, case, tmp_path, capsys):
    """ptxas: KdaPrepareWarp fits its default CTAs per SM with no spills and no CTA
    barrier; prints its figures next to KdaPrepare's."""
    require_dsl()
    from kda.prepass import KdaPrepare
    from kda.prepass_warp import KdaPrepareWarp

    tokens, record, gate_mode = case
    args = prepare_args(6, tokens, record=record)
    for sub in ("warp", "cta"):
        (tmp_path / sub).mkdir()
    warp = KdaPrepareWarp(6, tokens, record, gate_mode, True, arch=arch)
    registers, stores, loads, text = ptxas_report(warp, args, tmp_path / "warp", arch)
    cta = ptxas_report(
        KdaPrepare(6, tokens, record, gate_mode, True, arch=arch), args, tmp_path / "cta", arch
    )
    with capsys.disabled():
        print(
            f"\n  {arch} T{tokens} r{int(record)} g{gate_mode}: warp {registers} registers "
            f"(cap {65536 // (256 * warp.ctas_per_sm)}), spill {stores} / {loads} B; "
            f"cta {cta[0]} registers, spill {cta[1]} / {cta[2]} B"
        )
    assert registers <= 65536 // (256 * warp.ctas_per_sm)
    assert (stores, loads) == (0, 0)
    assert re.search(r"\b(bar|barrier)\.(sync|arrive|red)", text) is None  # warps only
    assert "mma.sync" in text or gate_mode == 2
