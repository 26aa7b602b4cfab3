"""CPU check: KdaReplay fits its register budget (three CTAs of 256 threads per SM: 80
registers) with its spills bounded, decode (T = 1) and verify (T = 2, 4, 8), ring lengths
2, 8 and 16, with the seed's gate (mode 0) and the default one (mode 3) (ptxas, sm_90a).

At 80 registers a few values go to the stack (L1-resident): 12-28 bytes at T = 1, more per
verify token. Measured on the H200 (2026-12-01, ``bench_kda.py --replay-only``): three CTAs
per SM with these spills ran 1.03-1.15x faster than two CTAs per SM at 128 registers
without spills (and the page staged in shared memory) at T = 1 (H96 B128 R4: 491 us
against 535-541), four CTAs at 64 registers (~200 bytes of spills at T = 1) 0.73x. The
bounds below are the measured stack frames rounded up.
"""

from __future__ import annotations

import re

import pytest
from compile_harness import ptxas_sm90a, require_dsl
from test_kda_replay_compile import replay_args

pytestmark = pytest.mark.compile

CASES = [
    # size R, tokens T, gate_mode, stack bytes at most (H 96, bias, dim-first conv, PDL)
    (8, 1, 0, 32),
    (8, 1, 3, 32),
    (2, 1, 3, 32),
    (16, 1, 3, 32),
    (8, 2, 3, 80),
    (8, 4, 0, 160),
    (8, 4, 3, 160),
    (16, 8, 3, 240),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "R{}-T{}-g{}".format(*c))
def test_replay_registers_and_spills(case, tmp_path):
    cute = require_dsl()
    from kda.kernels.replay import FOLD_CHUNKS, KdaReplay

    size, tokens, gate_mode, stack = case
    kernel = KdaReplay(96, size, tokens, gate_mode, True, arch="sm_90a", pdl=True)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    ptx = cute.compile(kernel, *replay_args(96, size, tokens), options=options).__ptx__
    report = ptxas_sm90a(ptx, tmp_path / "replay.ptx")
    frames = [int(v) for v in re.findall(r"(\d+) bytes stack frame", report)]
    assert frames and max(frames) <= stack, report
    registers = [int(v) for v in re.findall(r"Used (\d+) registers", report)]
    assert registers and max(registers) <= 80, report
    # the page: one bulk L2 prefetch, then read where it lies, 16-byte loads (per token the
    # 16 chunks of the thread's two rows; the fold's 2 x FOLD_CHUNKS in its rolled chunk
    # loop) and written only by the fold (as many stores in that loop); the ring's entries
    # by cp.async
    # (64 R chunks over the threads, a k / raw-gate and a v_new form)
    ring_copies = 2 * -(-64 * size // 256)
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1, "page prefetch"
    assert ptx.count("ld.global.v4.f32") == 16 * tokens + 2 * FOLD_CHUNKS, "page loads"
    assert ptx.count("cp.async.cg.shared.global") == ring_copies, "ring copies"
    assert ptx.count("st.global.v4.f32") == 2 * FOLD_CHUNKS, "fold stores"
