"""GPU: the kernels' validation before launch. Two live requests on one state page, and
(``validate="full"``) NaN / Inf inputs, are refused with a ValueError naming the argument
before any launch: the poisoned output, the state and conv pools, the records are bitwise
unchanged. The checked mode on good inputs launches the same kernel (same bits), and is
refused while a CUDA graph is captured."""

from __future__ import annotations

import pytest
import torch

from kda import layer as kl
from kda import synthetic as kt

pytestmark = pytest.mark.gpu

KERNELS = [("wide", None), ("stream", None), ("split", 2)]
B, H, T = 4, 3, 3


def setup(seed=0):
    pages = 1 + B * T + 2
    layer = kt.make_layer(H, pages, window=T + 2, seed=seed, device="cuda")
    step = kt.make_step(B, T, H, pages=pages, padding=(3,), seed=seed + 1, device="cuda")
    return layer, step


def launch(layer, step, kernel, cluster, out, **kw):
    import kda

    return kda.decode(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, lower_bound=kl.LOWER_BOUND, scale=kl.SCALE, eps=kl.EPS,
        accepted=step.accepted, conv_dim_first=layer.conv_dim_first, kernel=kernel,
        cluster=cluster, gate_mode=3, out=out, **kw,
    )  # fmt: skip


def snapshot(*tensors):
    return [t.clone() for t in tensors]


def unchanged(tensors, before):
    torch.cuda.synchronize()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)), "a refused call wrote"


def nan_at(t, index):
    t = t.clone()
    t[index] = float("nan")
    return t


@pytest.mark.parametrize("kernel,cluster", KERNELS)
def test_duplicate_pages_refused_before_launch(kernel, cluster):
    layer, step = setup()
    out = torch.full((B * T, H * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    for b, t in ((1, 2), (1, 0)):
        bad = step.slots.clone()
        bad[b, t] = step.slots[0, t]
        step_bad = kl.Step(step.x, step.f_a, step.beta, step.gate, bad, step.accepted)
        watched = [out, layer.state, layer.conv_state]
        before = snapshot(*watched)
        with pytest.raises(ValueError, match="slots"):
            launch(layer, step_bad, kernel, cluster, out)
        unchanged(watched, before)


@pytest.mark.parametrize("kernel,cluster", KERNELS)
@pytest.mark.parametrize("name", ["x", "beta", "f_a", "gate", "a_log", "state"])
def test_checked_mode_refuses_non_finite(kernel, cluster, name):
    layer, step = setup(seed=4)
    out = torch.full((B * T, H * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    if name == "a_log":
        layer.a_log = nan_at(layer.a_log, 1)
    elif name == "state":
        layer.state[int(step.slots[0, int(step.accepted[0]) - 1])] = float("inf")
    else:
        setattr(step, name, nan_at(getattr(step, name), 0))  # row 0: request 0, live
    watched = [out, layer.state, layer.conv_state]
    before = snapshot(*watched)
    with pytest.raises(ValueError, match=name):
        launch(layer, step, kernel, cluster, out, validate="full")
    unchanged(watched, before)


@pytest.mark.parametrize("kernel,cluster", KERNELS)
def test_checked_mode_launches_the_same_kernel(kernel, cluster):
    layer, step = setup(seed=8)
    fast_layer = layer.clone()
    out_full = launch(layer, step, kernel, cluster, None, validate="full")
    out_fast = launch(fast_layer, step, kernel, cluster, None)
    torch.cuda.synchronize()
    assert torch.equal(out_full, out_fast)
    assert torch.equal(layer.state, fast_layer.state)
    assert torch.equal(layer.conv_state, fast_layer.conv_state)


def test_checked_mode_refused_in_graph_capture():
    layer, step = setup(seed=12)
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16, device="cuda")
    launch(layer, step, "auto", None, out)  # compile outside the capture
    torch.cuda.synchronize()
    before = snapshot(out, layer.state, layer.conv_state)
    graph = torch.cuda.CUDAGraph()
    scratch = torch.zeros(16, device="cuda")
    with torch.cuda.graph(graph):
        scratch.add_(1.0)
        with pytest.raises(ValueError, match="validate"):
            launch(layer, step, "auto", None, out, validate="full")
    unchanged([out, layer.state, layer.conv_state], before)


def test_recover_checked_mode_and_duplicates():
    import kda

    layer, step = setup(seed=16)
    v = torch.randn(B, H, T, 128, device="cuda")
    kg = torch.randn(B, H, T, 256, device="cuda").to(torch.bfloat16)
    accepted = torch.full((B,), T, dtype=torch.int32, device="cuda")
    before = snapshot(layer.state)
    args = (layer.a_log, layer.dt_bias, accepted, step.accepted)
    with pytest.raises(ValueError, match="v_records"):
        kda.recover(layer.state, step.slots, nan_at(v, (0, 0, 0)), kg, *args,
                    lower_bound=kl.LOWER_BOUND, validate="full")  # fmt: skip
    bad = step.slots.clone()
    bad[2] = step.slots[0]
    with pytest.raises(ValueError, match="slots"):
        kda.recover(layer.state, bad, v, kg, *args, lower_bound=kl.LOWER_BOUND)
    unchanged([layer.state], before)
