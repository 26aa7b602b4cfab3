"""The softplus gate (``gate_form="softplus"``, Kimi-Linear's; fla's ``lower_bound=None``)
in ``kda.reference``: its softplus is torch's (beta 1, threshold 20) evaluated exactly, its
log-decay fla's naive ``naive_kda_gate`` (and the lower-bound form fla's
``naive_kda_lowerbound_gate``) up to fla's own fp32 roundings, and every entry refuses a bad
``gate_form`` or a bound that does not go with it, naming the argument, before any write.
The step, recover and replay with it: ``test_kda_reference.py``, ``test_kda_replay.py``."""

from __future__ import annotations

import _harness_fla as fh
import pytest
import torch
import torch.nn.functional as F

import kda
from kda import layer as kl
from kda import reference as R
from kda import synthetic as kt
from kda.operands import make_ring

U = 2.0**-24  # fp32 unit roundoff


def fp32_grid(low, high, count):
    """``count`` fp32 values spread over [low, high], the ends included."""
    return torch.linspace(low, high, count, dtype=torch.float64).float()


def test_softplus_is_torchs_exactly_rounded():
    """``_softplus`` is torch's float64 ``F.softplus`` rounded once to fp32, bit for bit,
    across the threshold (20) and far out on both sides; above ~14.6 both branches give
    ``x`` in fp32, so the threshold moves no bit."""
    x = torch.cat([
        fp32_grid(-200.0, 200.0, 40001),
        fp32_grid(19.0, 21.0, 4001),
        torch.tensor([20.0, -88.0, -104.0, -1e30, 1e30, 0.0, -0.0]),
    ])  # fmt: skip
    want = F.softplus(x.double()).float()
    assert torch.equal(R._softplus(x), want)
    high = x[x >= 14.6]
    assert torch.equal(R._softplus(high), high)
    finite = high[high < 700]  # exp in float64 stays finite
    assert torch.equal(torch.log1p(torch.exp(finite.double())).float(), finite)
    assert torch.isfinite(R._softplus(x)).all()


def gate_inputs(heads=4, rows=64, seed=0):
    """Raw gates (bf16 values) [rows, H, 128], A_log = log U(1, 16), dt_bias N(0, 1) with
    some channels far out (``kt.extreme_dt_bias``)."""
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(rows, heads, 128, generator=g) * 2).bfloat16().float()
    a_log = torch.log(torch.rand(heads, generator=g) * 15 + 1)
    layer = kt.make_layer(heads, 2, seed=seed)
    layer.dt_bias = torch.randn(heads * 128, generator=g)
    kt.extreme_dt_bias(layer, seed)
    return raw, a_log, layer.dt_bias


@pytest.mark.parametrize("seed", [0, 1])
def test_log_decay_is_flas_softplus_gate(seed):
    """``-exp(A_log) * softplus(g + dt_bias)`` as fla's ``naive_kda_gate`` computes it in
    fp32: fla's ``exp`` and ``softplus`` are fp32 functions (within an ulp or two each), ours
    exactly rounded, so the log-decays agree within 8 fp32 ulps of |g| (they differ, so
    the bound is not trivially met), and the decays ``exp(g)`` within 2^-20 absolutely."""
    if fh.fla_dir() is None:
        pytest.skip("fla-core is not installed")
    raw, a_log, dt_bias = gate_inputs(seed=seed)
    theirs = fh.softplus_gate()(raw[None], a_log, dt_bias)[0]
    ours = R._log_decay(raw, a_log, dt_bias, None, "softplus")
    assert ours.dtype == torch.float32 and (ours <= 0).all()
    err = (ours.double() - theirs.double()).abs()
    assert (err <= 8 * U * theirs.double().abs() + 2.0**-140).all(), err.max()
    assert (R._decay(raw, a_log, dt_bias, None, "softplus") - theirs.exp()).abs().max() <= 2**-20
    assert (ours < -20).any() and (ours > -1e-10).any()  # past the threshold, and near 1
    lower = R._log_decay(raw, a_log, dt_bias, -5.0, "lower-bound")
    assert not torch.allclose(lower, ours)  # the forms differ: the switch is live


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0])
def test_log_decay_is_flas_lower_bound_gate(lower_bound):
    """The lower-bound form against fla's ``naive_kda_lowerbound_gate``: decays within 2^-20
    (the sigmoid's fp32 evaluation in fla moves g by a few ulps of the sigmoid's argument)."""
    if fh.fla_dir() is None:
        pytest.skip("fla-core is not installed")
    raw, a_log, dt_bias = gate_inputs(seed=2)
    theirs = fh.lower_bound_gate()(raw[None], a_log, dt_bias, lower_bound)[0]
    ours = R._decay(raw, a_log, dt_bias, lower_bound, "lower-bound")
    assert (ours - theirs.exp()).abs().max() <= 2**-20


def _step(T=2, B=3, H=2, seed=4):
    pages = 1 + B * T + 2
    layer = kt.make_layer(H, pages, window=T + 2, seed=seed)
    return layer, kt.make_step(B, T, H, pages=pages, seed=seed + 1)


BAD_GATES = [
    (dict(gate_form="relu"), "gate_form must be one of"),
    (dict(gate_form=None), "gate_form must be one of"),
    (dict(gate_form="softplus", lower_bound=-5.0), "lower_bound must be None with gate_form"),
    (dict(gate_form="lower-bound", lower_bound=None), "lower_bound must be a finite real"),
    (dict(gate_form="lower-bound", lower_bound=0.5), "lower_bound must be <= 0"),
]


@pytest.mark.parametrize("gate, match", BAD_GATES)
def test_entries_refuse_a_bad_gate_before_any_write(gate, match):
    """``kda.reference.decode`` / ``replay_decode`` / ``recover`` / ``materialize``, and the
    CPU ops ``kda.decode`` (refused before its device check) and ``kda.fold``: ValueError
    naming the argument, pools untouched."""
    layer, step = _step()
    ring = make_ring(layer.state, 4)
    ring.length[1:] = torch.tensor([1, 0], dtype=torch.int32)
    B, H, T = 3, 2, 2
    records = (torch.zeros(B, H, T, 128), torch.zeros(B, H, T, 256, dtype=torch.bfloat16))
    pools = (layer.state, layer.conv_state, *ring)
    before = [t.clone() for t in pools]
    operands = kl.step_operands(layer, step) | gate
    args = (layer.state, step.slots, *records, layer.a_log, layer.dt_bias)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    calls = [
        lambda: R.decode(**operands),
        lambda: R.replay_decode(**operands, ring=ring),
        lambda: kda.decode(**operands),
        lambda: R.recover(*args, step.accepted, step.accepted, **gate),
        lambda: R.materialize(layer.state, ring, layer.a_log, layer.dt_bias, **gate),
        lambda: kda.fold(layer.state, ring, layer.a_log, layer.dt_bias, slots, **gate),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()
    for a, b in zip(before, pools, strict=True):
        assert torch.equal(a, b), "written before the refusal"


def test_softplus_fold_op_is_materialize():
    """``kda.fold`` on a CPU pool with the softplus gate runs ``materialize`` with it."""
    layer, _ = _step()
    ring = make_ring(layer.state, 4)
    g = torch.Generator().manual_seed(9)
    ring.v.copy_(torch.randn(ring.v.shape, generator=g))
    ring.kg.copy_(torch.randn(ring.kg.shape, generator=g).bfloat16())
    ring.length[1:4] = torch.tensor([3, 1], dtype=torch.int32)
    want, want_ring = layer.state.clone(), make_ring(layer.state, 4)
    for a, b in zip(want_ring, ring, strict=True):
        a.copy_(b)
    slots = torch.tensor([1, 3], dtype=torch.int32)
    gate = dict(gate_form="softplus")
    R.materialize(want, want_ring, layer.a_log, layer.dt_bias, slots=slots, **gate)
    lower = layer.state.clone()
    R.materialize(lower, make_ring(layer.state, 4)._replace(
        v=ring.v.clone(), kg=ring.kg.clone(), length=ring.length.clone()),
        layer.a_log, layer.dt_bias, slots=slots, lower_bound=-5.0)  # fmt: skip
    kda.fold(layer.state, ring, layer.a_log, layer.dt_bias, slots, **gate)
    assert torch.equal(layer.state, want) and torch.equal(ring.length, want_ring.length)
    assert not torch.equal(lower[1], want[1])  # the lower-bound fold differs
