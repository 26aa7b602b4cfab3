"""GPU tests of ``kda.decode(..., kernel="lean")`` (KdaPrepare + KdaLean).

Against ``kda.reference.decode`` with the helpers and tolerances of
``test_kda_kernels_gpu`` (outputs within 1 bf16 ulp, state within 1e-5, conv pages
bitwise, untouched pages bitwise unchanged), and BITWISE against ``kernel="wide"`` on the
same inputs: outputs, state pool, conv pool and records, over several steps in a row and
under CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import (
    CASES,
    POISON,
    call_kernel,
    check_output,
    check_state,
    make_records,
    quantize_gate_inputs,
    run_case,
    written_pages,
)

from kda import synthetic as kt

pytestmark = pytest.mark.gpu


def _case_id(c):
    return "H{}B{}T{}-{}-b{}-r{}".format(*c[:3], "df" if c[3] else "wf", int(c[4]), int(c[5]))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lean_matches_reference(case):
    H, B, T, dim_first, bias, record, padding, gate_mode, conv_dtype, holes = case
    run_case(H, B, T, dim_first=dim_first, bias=bias, record=record, padding=padding,
             kernel="lean", gate_mode=gate_mode, conv_dtype=conv_dtype, holes=holes)  # fmt: skip


def _poisoned_records(record, B, H, T):
    return make_records(B, H, T, "cuda") if record else None


def _assert_same(wide, lean, what):
    """Bitwise equality (NaN poison included) of two tensors."""
    if wide.dtype.is_floating_point:
        same = wide.view(torch.int8 if wide.element_size() == 1 else torch.int16).equal(
            lean.view(torch.int8 if lean.element_size() == 1 else torch.int16)
        )
    else:
        same = torch.equal(wide, lean)
    if not same:
        diff = (wide.float() != lean.float()) & ~(wide.float().isnan() & lean.float().isnan())
        where = diff.nonzero()[:4].tolist()
        raise AssertionError(f"{what}: lean differs from wide at {where} ({int(diff.sum())})")


BITWISE_CASES = [
    # H, B, T, dim_first, bias, record, padding, gate_mode, conv dtype, holes
    (96, 130, 1, True, True, False, (7, 100), 0, torch.bfloat16, False),
    (12, 64, 1, False, False, False, (), 2, torch.float32, False),
    (6, 40, 4, True, False, False, (3,), 1, torch.bfloat16, True),
    (12, 33, 8, False, True, True, (0, 5), 0, torch.bfloat16, False),
    (6, 130, 2, True, True, True, (), 2, torch.float32, False),
    (1, 3, 5, False, True, False, (1,), 1, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", BITWISE_CASES, ids=_case_id)
def test_lean_bitwise_equals_wide(case):
    """Three steps in a row on twin pools: lean and wide give identical bits."""
    H, B, T, dim_first, bias, record, padding, gate_mode, conv_dtype, holes = case
    pages = 1 + B * T + 4
    wide = kt.make_layer(H, pages, window=T + 3, conv_dim_first=dim_first, bias=bias,
                         conv_dtype=conv_dtype, seed=11, device="cuda")  # fmt: skip
    lean = wide.clone()
    for i in range(3):
        step = kt.make_step(B, T, H, pages=pages, padding=padding, seed=30 + i, device="cuda")
        if gate_mode in (0, 1):
            quantize_gate_inputs(lean, step)
            wide.f_b = lean.f_b
        if holes and T > 1:
            s = step.slots.clone()
            for b in range(B):
                if int(step.accepted[b]) < T and b not in padding:
                    s[b, T - 1] = 0
            step.slots = s
        rec_w, rec_l = _poisoned_records(record, B, H, T), _poisoned_records(record, B, H, T)
        out_w = call_kernel(wide, step, "wide", records=rec_w, gate_mode=gate_mode)
        out_l = call_kernel(lean, step, "lean", records=rec_l, gate_mode=gate_mode)
        torch.cuda.synchronize()
        _assert_same(out_w, out_l, f"step {i} output")
        _assert_same(wide.state, lean.state, f"step {i} state")
        _assert_same(wide.conv_state, lean.conv_state, f"step {i} conv")
        if record:
            _assert_same(rec_w[0], rec_l[0], f"step {i} v_records")
            _assert_same(rec_w[1], rec_l[1], f"step {i} kg_records")


def test_lean_steps_against_reference():
    """Three decode steps then two verify steps on the same pools, lean vs reference."""
    H, B, pages = 6, 8, 40
    layer = kt.make_layer(H, pages, window=8, seed=3, device="cuda")
    ref_layer = layer.clone()
    for i in range(5):
        T = 1 if i < 3 else 3
        table = (1 + torch.arange(B * T, dtype=torch.int32).view(B, T)) % pages
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, padding=(i % B,),
                            seed=10 + i, device="cuda")  # fmt: skip
        before = layer.state.clone()
        ref = kt.run_reference(ref_layer, step)
        got = call_kernel(layer, step, "lean")
        check_state(layer.state, ref_layer.state, before, written_pages(step, None))
        assert torch.equal(layer.conv_state, ref_layer.conv_state)
        check_output(got, ref, H)
        layer.state.copy_(ref_layer.state)


@pytest.mark.parametrize("T", [1, 2])
def test_lean_cuda_graph_replay_bitwise(T):
    """One lean step captured in a CUDA graph, replayed with new inputs; each replay is
    bitwise the eager wide step on twin pools."""
    import kda

    H, B, pages = 12, 40, 1 + 40 * 2 + 4
    lean = kt.make_layer(H, pages, window=6, seed=5, device="cuda")
    wide = lean.clone()
    step = kt.make_step(B, T, H, pages=pages, padding=(2,), seed=6, device="cuda")
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16, device="cuda")

    def launch(layer, kernel, target):
        kda.decode(
            step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a,
            step.beta, layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate,
            layer.norm_weight, layer.f_b, lower_bound=kt.LOWER_BOUND, scale=kt.SCALE,
            eps=kt.EPS, accepted=step.accepted, kernel=kernel, out=target, gate_mode=2,
        )  # fmt: skip

    saved = lean.clone()
    launch(lean, "lean", out)  # compile outside the capture
    lean.state.copy_(saved.state)
    lean.conv_state.copy_(saved.conv_state)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch(lean, "lean", out)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(7):
        fresh = kt.make_step(B, T, H, pages=pages, padding=(2,), seed=20 + i, device="cuda")
        for name in ("x", "f_a", "beta", "gate") + (("accepted",) if T > 1 else ()):
            getattr(step, name).copy_(getattr(fresh, name))
        out.fill_(POISON)
        graph.replay()
        expect = torch.full_like(out, POISON)
        launch(wide, "wide", expect)
        torch.cuda.synchronize()
        _assert_same(expect, out, f"replay {i} output")
        _assert_same(wide.state, lean.state, f"replay {i} state")
        _assert_same(wide.conv_state, lean.conv_state, f"replay {i} conv")


def test_lean_pdl_after_producer():
    """With PDL the prepass waits for the kernel that writes its inputs."""
    H, B, pages = 12, 40, 50
    layer = kt.make_layer(H, pages, seed=7, device="cuda")
    step = kt.make_step(B, 1, H, pages=pages, seed=8, device="cuda")
    ref_layer = layer.clone()
    ref = kt.run_reference(ref_layer, step)
    source = step.x.clone()
    step.x.zero_()
    torch.cuda._sleep(2_000_000)  # a slow predecessor, then the producer of x
    step.x.copy_(source)
    got = call_kernel(layer, step, "lean", pdl=True)
    torch.cuda.synchronize()
    assert torch.equal(layer.conv_state, ref_layer.conv_state)
    check_output(got, ref, H)


def test_lean_bad_input_launches_nothing():
    import kda

    layer = kt.make_layer(2, 8, seed=1, device="cuda")
    step = kt.make_step(2, 2, 2, pages=8, seed=2, device="cuda")
    state0, conv0 = layer.state.clone(), layer.conv_state.clone()
    bad = step.accepted.clone()
    bad[0] = 3
    with pytest.raises(ValueError, match="accepted"):
        kda.decode(
            step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a,
            step.beta, layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate,
            layer.norm_weight, layer.f_b, lower_bound=kt.LOWER_BOUND, scale=kt.SCALE,
            eps=kt.EPS, accepted=bad, kernel="lean",
        )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(layer.state, state0) and torch.equal(layer.conv_state, conv0)
