"""CPU check: KdaPipe (512 threads, one CTA per SM: at most 128 registers) keeps its spills
bounded at T = 1, 2, 4 (and 6 on bf16 pages) with fp32 and bf16 pages (ptxas, sm_90a),
compiled as the launcher compiles it: the batch's extents dynamic (``dynamic_args``; with
``fake_args``' static extents the compiler folds ``// requests`` into multiplies and spills
less than the launched kernel). Measured 2026-12-01 (gate mode 3, dim-first conv, bytes
stored / loaded): fp32 24 / 12 at T = 1, 32 / 36 at T = 2; bf16 20 / 8 at T = 1, 20 / 12 at
T = 2; with the stepped (head, request) pairs (no division per item): fp32 0 / 0 and 16 /
20, bf16 16 / 12 and 8 / 8; with the prep group writing the output at T >= 3 (session 12):
fp32 36 / 24 at T = 4, bf16 40 / 40 at T = 4 and 156 / 180 at T = 6 (T = 3 spills 56 / 48
and is not dispatched to KdaPipe); with the gate batches at T <= 4 (session 12, branch
s12-gate8, T rows of decays per slot): fp32 32 / 24 at T = 2, 36 / 24 at T = 4 and bf16 4 /
4, 24 / 16, 64 / 84 at T = 1, 2, 4 (fp32 T = 1 keeps the per-item gate, ``batches_gate``: 0
/ 0); fp32 T = 3 28 / 24 (56 / 48 before the gate batches), T = 5 36 / 24 (session 13:
neither dispatched to KdaPipe yet, not timed); every one at the state loop's head or
prologue (its item pairs and slots kept across the page wait: a few local loads and stores
per item), none in the recurrence; ptxas moves them with any change of the kernel's shared-
memory offsets. The bounds leave a little room; a change past them should say why."""

from __future__ import annotations

import re

import pytest
from compile_harness import ptxas_sm90a, require_dsl
from test_kda_compile import dynamic_args

pytestmark = pytest.mark.compile

# (state dtype, tokens): most spill bytes (stores and loads each)
BOUNDS = {
    ("fp32", 1): 24,
    ("fp32", 2): 40,
    ("fp32", 3): 32,
    ("fp32", 4): 48,
    ("fp32", 5): 40,
    ("bf16", 1): 20,
    ("bf16", 2): 32,
    ("bf16", 4): 96,
    ("bf16", 6): 192,
}


@pytest.mark.parametrize("dtype,tokens", list(BOUNDS), ids=[f"{d}-T{t}" for d, t in BOUNDS])
def test_pipe_spills_bounded(dtype, tokens, tmp_path):
    cute = require_dsl()
    from kda.kernels.pipe import KdaPipe

    heads, window = 6, tokens + 2
    kernel = KdaPipe(heads, tokens, 3, True, True, window, 8, state_dtype=dtype)
    args = dynamic_args(heads, tokens, dtype, has_bias=True, conv_dim_first=True, window=window)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *args, options=options).__ptx__
    report = ptxas_sm90a(text, tmp_path / "kernel.ptx")
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert registers and max(registers) <= 128, report
    bound = BOUNDS[(dtype, tokens)]
    assert spills and all(int(st) <= bound and int(ld) <= bound for st, ld in spills), report
    print(f"KdaPipe {dtype} T {tokens}: {registers} registers, spills {spills}")
