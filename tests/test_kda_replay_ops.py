"""kda.replay_decode's host side on the CPU: the torch op ``kimi::kda_replay_decode`` (what
it mutates, its fake implementation through ``opcheck`` on meta tensors) and its
refusals (``ValueError`` before any launch, nothing written). The kernel: GPU tests in
test_kda_replay_gpu.py."""

from __future__ import annotations

import pytest
import torch

import kda
from kda import layer as kl
from kda import synthetic as kt
from kda.operands import Ring, make_ring

B, H, PAGES, R = 2, 3, 8, 4
OPCHECK_UTILS = (
    "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)  # fmt: skip


def _case(device="cpu", tokens=1):
    layer = kt.make_layer(H, PAGES, window=tokens + 2, seed=1, device=device)
    step = kt.make_step(B, tokens, H, pages=PAGES, seed=2, device=device)
    return layer, step, make_ring(layer.state, R)


def _replay(layer, step, ring, **kw):
    return kda.replay_decode(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, lower_bound=kl.LOWER_BOUND, scale=kl.SCALE, eps=kl.EPS,
        conv_dim_first=layer.conv_dim_first, ring=ring, **{"accepted": step.accepted, **kw},
    )  # fmt: skip


def test_op_mutates_the_pools_ring_and_output():
    op = torch.ops.kimi.kda_replay_decode.default
    written = {a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == {"conv_state", "state", "out", "ring_v", "ring_kg", "ring_length"}


def test_opcheck_on_meta():
    layer, step, ring = _case("meta")
    out = torch.empty(B, H * 128, dtype=torch.bfloat16, device="meta")
    args = (step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
            layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
            layer.f_b, out, None, *ring, kl.LOWER_BOUND, kl.SCALE, kl.EPS, True, 3,
            True)  # fmt: skip
    torch.library.opcheck(torch.ops.kimi.kda_replay_decode.default, args,
                          test_utils=OPCHECK_UTILS)  # fmt: skip


def _refused(match, layer, step, ring, **kw):
    pools = (layer.state, layer.conv_state, *(t for t in ring if isinstance(t, torch.Tensor)))
    before = [t.clone() for t in pools]
    with pytest.raises(ValueError, match=match):
        _replay(layer, step, ring, **kw)
    for a, b in zip(before, pools, strict=True):
        assert torch.equal(a, b), "written before the refusal"


def test_refusals_before_any_launch():
    layer, step, ring = _case()
    _refused("CUDA tensor", layer, step, ring)  # every check passed: the launch is refused
    _refused("ring must be", layer, step, tuple(ring))
    _refused("ring.kg", layer, step, ring._replace(kg=ring.kg.float()))
    _refused("ring.length", layer, step, ring._replace(length=ring.length[..., :1]))
    full = Ring(ring.v, ring.kg, ring.length.clone())
    full.length[int(step.slots[0])] = torch.tensor([R, 1], dtype=torch.int32)
    _refused(r"committed \+ pending <= R", layer, step, full)
    _refused("gate_mode must be 0, 1 or 3", layer, step, ring, gate_mode=4)
    _refused("gate_mode must be 0, 1 or 3", layer, step, ring, gate_mode=2)  # removed
    _refused("pdl", layer, step, ring, pdl=1)
    _refused("kernel must be one of", layer, step, ring, kernel="split")
    _refused("records must be None", layer, step, ring,
             records=(torch.zeros(1), torch.zeros(1)))  # fmt: skip
    bad = kl.Step(step.x, step.f_a, step.beta, step.gate, step.slots.clone(), None)
    bad.slots[1] = bad.slots[0]
    _refused("unique", layer, bad, ring)
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        kda.replay_decode(None, layer.conv_weight, layer.conv_bias, layer.conv_state,
                          step.f_a, step.beta, layer.a_log, layer.dt_bias, step.slots,
                          layer.state, step.gate, layer.norm_weight, layer.f_b,
                          lower_bound=-5.0, scale=0.1, eps=1e-6, ring=ring)  # fmt: skip


def test_verify_step_refusals():
    layer, step, ring = _case(tokens=3)
    _refused("CUDA tensor", layer, step, ring)  # every check passed
    _refused("accepted", layer, step, ring, accepted=None)
    small = make_ring(layer.state, 2)
    _refused("R = 2 must be >= the step's tokens T = 3", layer, step, small)


def test_removed_stream_kernel_is_refused_on_meta():
    """kernel="stream" (KdaReplayStream, removed: it measured behind KdaReplay) is refused
    by the op's fake implementation too (meta tensors), before anything is written."""
    layer, step, _ = _case("meta", tokens=2)
    ring = make_ring(layer.state, 16)
    with pytest.raises(ValueError, match="kernel must be one of"):
        _replay(layer, step, ring, kernel="stream")
    _replay(layer, step, ring, kernel="wide")  # the same step with KdaReplay: accepted
