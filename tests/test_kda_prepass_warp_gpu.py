"""GPU tests of KdaPrepareWarp (``kda.dispatch.LEAN_PREPASS = "warp"``): its scratch (and
conv pages, kg_records) BITWISE equal to KdaPrepare's on twin inputs, untouched scratch
rows included (both start from the same NaN poison); and ``kernel="lean"`` with the warp
prepass bitwise equal to ``kernel="wide"`` (the checks of ``test_kda_lean_gpu``, rerun
with the switch flipped). The gate inputs are NOT quantised in the prepass comparison:
the mma chain orders themselves must agree."""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import CASES, call_kernel
from test_kda_lean_gpu import (
    BITWISE_CASES,
    _assert_same,
    _case_id,
    _poisoned_records,
)
from test_kda_lean_gpu import test_lean_bitwise_equals_wide as _lean_vs_wide
from test_kda_lean_gpu import test_lean_cuda_graph_replay_bitwise as _lean_graph_replay
from test_kda_lean_gpu import test_lean_matches_reference as _lean_vs_reference
from test_kda_lean_gpu import test_lean_pdl_after_producer as _lean_pdl

from kda import dispatch, ops
from kda import synthetic as kt

pytestmark = pytest.mark.gpu

SCRATCH_POISON = 0x7FC0DEAD  # a NaN payload neither prepass writes


def _run_lean(monkeypatch, prepass, layer, step, records, gate_mode):
    """One lean step with ``prepass``; returns (output, a copy of the whole scratch)."""
    monkeypatch.setattr(dispatch, "LEAN_PREPASS", prepass)
    B, T = step.slots.shape[0], step.x.shape[0] // step.slots.shape[0]
    scratch = ops._scratch(layer.state.device, B, T, layer.heads)
    scratch.view(torch.int32).fill_(SCRATCH_POISON)
    out = call_kernel(layer, step, "lean", records=records, gate_mode=gate_mode)
    torch.cuda.synchronize()
    return out, scratch.clone()


PREPASS_CASES = [
    *BITWISE_CASES,
    # H, B, T, dim_first, bias, record, padding, gate_mode, conv dtype, holes
    (96, 128, 1, False, True, False, (), 1, torch.bfloat16, False),
    (96, 128, 4, True, False, True, (9,), 0, torch.bfloat16, False),
    (12, 17, 8, True, True, True, (16,), 1, torch.float32, True),
    (6, 9, 3, False, False, False, (8,), 2, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", PREPASS_CASES, ids=_case_id)
def test_warp_prepass_scratch_bitwise(case, monkeypatch):
    """Two steps in a row on twin pools: warp and cta prepasses write identical bits."""
    H, B, T, dim_first, bias, record, padding, gate_mode, conv_dtype, holes = case
    pages = 1 + B * T + 4
    cta = kt.make_layer(H, pages, window=T + 3, conv_dim_first=dim_first, bias=bias,
                        conv_dtype=conv_dtype, seed=13, device="cuda")  # fmt: skip
    warp = cta.clone()
    for i in range(2):
        step = kt.make_step(B, T, H, pages=pages, padding=padding, seed=40 + i, device="cuda")
        if holes and T > 1:
            s = step.slots.clone()
            for b in range(B):
                if int(step.accepted[b]) < T and b not in padding:
                    s[b, T - 1] = 0
            step.slots = s
        rec_c, rec_w = _poisoned_records(record, B, H, T), _poisoned_records(record, B, H, T)
        out_c, scratch_c = _run_lean(monkeypatch, "cta", cta, step, rec_c, gate_mode)
        out_w, scratch_w = _run_lean(monkeypatch, "warp", warp, step, rec_w, gate_mode)
        _assert_same(scratch_c, scratch_w, f"step {i} scratch")
        _assert_same(cta.conv_state, warp.conv_state, f"step {i} conv")
        _assert_same(out_c, out_w, f"step {i} output")
        _assert_same(cta.state, warp.state, f"step {i} state")
        if record:
            _assert_same(rec_c[0], rec_w[0], f"step {i} v_records")
            _assert_same(rec_c[1], rec_w[1], f"step {i} kg_records")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lean_warp_matches_reference(case, monkeypatch):
    """kernel="lean" with the warp prepass against kda.reference (test_kda_kernels_gpu's
    cases, tolerances, poisoned outputs and untouched-page checks)."""
    monkeypatch.setattr(dispatch, "LEAN_PREPASS", "warp")
    _lean_vs_reference(case)


@pytest.mark.parametrize("case", BITWISE_CASES, ids=_case_id)
def test_lean_warp_bitwise_equals_wide(case, monkeypatch):
    monkeypatch.setattr(dispatch, "LEAN_PREPASS", "warp")
    _lean_vs_wide(case)


@pytest.mark.parametrize("T", [1, 2])
def test_lean_warp_cuda_graph_replay_bitwise(T, monkeypatch):
    monkeypatch.setattr(dispatch, "LEAN_PREPASS", "warp")
    _lean_graph_replay(T)


def test_lean_warp_pdl_after_producer(monkeypatch):
    monkeypatch.setattr(dispatch, "LEAN_PREPASS", "warp")
    _lean_pdl()


@pytest.mark.parametrize("T", [1, 4])
def test_lean_prepass_timing(T, monkeypatch, capsys):
    """Report only (no assertion): one lean step at H = 96, B = 128 with each prepass,
    CUDA events over 20 steps after a warm-up (the difference is the prepasses')."""
    H, B = 96, 128
    pages = 1 + B * T + 4
    layer = kt.make_layer(H, pages, window=T + 3, seed=3, device="cuda")
    step = kt.make_step(B, T, H, pages=pages, seed=4, device="cuda")
    times = {}
    for prepass in ("cta", "warp"):
        monkeypatch.setattr(dispatch, "LEAN_PREPASS", prepass)
        for _ in range(3):
            call_kernel(layer, step, "lean", gate_mode=0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call_kernel(layer, step, "lean", gate_mode=0)
        end.record()
        torch.cuda.synchronize()
        times[prepass] = start.elapsed_time(end) * 1000 / 20
    with capsys.disabled():
        print(f"\n  lean H{H} B{B} T{T}: cta {times['cta']:.1f} us, warp {times['warp']:.1f} us")
