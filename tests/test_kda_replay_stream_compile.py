"""CPU checks of KdaReplayStream (kda.replay_stream): it compiles for sm_90a and sm_100a,
and fits its register budget (two CTAs of 256 threads per SM, 128 registers) without
spilling at T = 1 (ring lengths 2, 8, 16; gate modes 3 and 0) and T = 2 (ptxas, sm_90a);
its shared-memory refusal."""

from __future__ import annotations

import re

import pytest
from compile_harness import ARCHS, compile_for, ptxas_sm90a, require_dsl
from test_kda_replay_compile import replay_args

pytestmark = pytest.mark.compile

CASES = [
    # heads, size, tokens, gate_mode, has_bias, conv_dim_first, pdl, ctas
    (96, 8, 1, 3, True, True, True, 264),
    (3, 16, 1, 3, False, False, False, 2),
    (6, 4, 2, 1, True, False, True, 5),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}R{}T{}g{}b{}d{}p{}c{}".format(*c))
def test_replay_stream_compiles(arch, case):
    require_dsl()
    from kda.replay_stream import KdaReplayStream

    heads, size, tokens, gate_mode, has_bias, dim_first, pdl, ctas = case
    kernel = KdaReplayStream(heads, size, tokens, gate_mode, has_bias, ctas, arch=arch, pdl=pdl)
    args = replay_args(heads, size, tokens, has_bias=has_bias, conv_dim_first=dim_first)
    assert compile_for(arch, kernel, *args) is not None


SPILL_CASES = [
    # size R, tokens T, gate_mode (H 96, bias, dim-first conv cache, PDL, 264 CTAs)
    (8, 1, 3),
    (8, 1, 0),
    (16, 1, 3),
    (2, 1, 3),
    (8, 2, 3),
]


@pytest.mark.parametrize("case", SPILL_CASES, ids=lambda c: "R{}-T{}-g{}".format(*c))
def test_replay_stream_no_spills(case, tmp_path):
    cute = require_dsl()
    from kda.replay_stream import KdaReplayStream

    size, tokens, gate_mode = case
    kernel = KdaReplayStream(96, size, tokens, gate_mode, True, 264, arch="sm_90a", pdl=True)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    ptx = cute.compile(kernel, *replay_args(96, size, tokens), options=options).__ptx__
    report = ptxas_sm90a(ptx, tmp_path / "replay_stream.ptx")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
    assert re.search(r"\b0 bytes stack frame", report), report
    registers = [int(v) for v in re.findall(r"Used (\d+) registers", report)]
    assert registers and max(registers) <= 128, report
    # Three copy sites (the first item; after a padding item; after a live item's page is
    # in registers), each the page (16 cp.async of 16 bytes per thread) and the ring's
    # entries (64 R chunks over the threads, a k / raw-gate and a v_new form); the fold's
    # page writes unrolled over the 8 key chunks of both rows.
    ring_copies = 2 * -(-64 * size // 256)
    assert ptx.count("cp.async.cg.shared.global") == 3 * (16 + ring_copies), "copies"
    assert ptx.count("st.global.v4.f32") == 16, "fold stores"
    assert len(re.findall(r"cp.async.wait_group\s+1;", ptx)) == 1
    assert len(re.findall(r"cp.async.wait_group\s+0;", ptx)) == 1


def test_refuses_what_does_not_fit_two_ctas_per_sm():
    require_dsl()
    from kda.replay_stream import KdaReplayStream

    with pytest.raises(ValueError, match="shared memory"):
        KdaReplayStream(3, 16, 2)
    with pytest.raises(ValueError, match="ctas"):
        KdaReplayStream(3, 8, 1, ctas=0)
