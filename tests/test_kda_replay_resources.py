"""CPU check: KdaReplay fits its register budget (two CTAs of 256 threads per SM, 128
registers) without spilling, decode (T = 1) and verify (T = 2, 4, 8), ring lengths 2, 8
and 16, with the seed's gate (mode 0) and the default one (mode 3) (ptxas, sm_90a)."""

from __future__ import annotations

import re

import pytest
from compile_harness import ptxas_sm90a, require_dsl
from test_kda_replay_compile import replay_args

pytestmark = pytest.mark.compile

CASES = [
    # size R, tokens T, gate_mode (H 96, bias, dim-first conv cache, PDL)
    (8, 1, 0),
    (8, 1, 3),
    (2, 1, 3),
    (16, 1, 3),
    (8, 2, 3),
    (8, 4, 0),
    (8, 4, 3),
    (16, 8, 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "R{}-T{}-g{}".format(*c))
def test_replay_no_spills(case, tmp_path):
    cute = require_dsl()
    from kda.replay import KdaReplay

    size, tokens, gate_mode = case
    kernel = KdaReplay(96, size, tokens, gate_mode, True, arch="sm_90a", pdl=True)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    ptx = cute.compile(kernel, *replay_args(96, size, tokens), options=options).__ptx__
    report = ptxas_sm90a(ptx, tmp_path / "replay.ptx")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
    assert re.search(r"\b0 bytes stack frame", report), report
    registers = [int(v) for v in re.findall(r"Used (\d+) registers", report)]
    assert registers and max(registers) <= 128, report
    # the page is read once (16 cp.async of 16 bytes per thread) and written only by the
    # fold (16-byte stores in its rolled chunk loop: two per chunk); the ring's entries
    # arrive by cp.async too (64 R chunks over the threads, a k / raw-gate and a v_new form)
    ring_copies = 2 * -(-64 * size // 256)
    assert ptx.count("cp.async.cg.shared.global") == 16 + ring_copies, "page and ring copies"
    assert ptx.count("st.global.v4.f32") == 2, "fold stores"
