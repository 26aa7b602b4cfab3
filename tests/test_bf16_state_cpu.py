"""CPU tests of bf16 state pages outside the kernels: the torch ops' fake implementations
take bf16 pools (and refuse other dtypes by name), ``DecodeLayer(state_dtype=)`` and
``load_rank(state_dtype=)`` check the pool's dtype, a bf16 layer's state moves through
export / import and the prefill hand-off, and the job runs end to end with
``--state-dtype bf16`` on the host backend (per-step and replay)."""

from __future__ import annotations

import pytest
import torch
from test_bad_input import decode_args, decode_op, recover_args
from test_engine_state import i32, make_layer, pools, snapshot
from test_launch import assert_ok, torchrun
from torch._subclasses.fake_tensor import FakeTensorMode

from engine import DecodeLayer
from engine import state as es
from engine.load import load_rank
from kda import synthetic as kt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_fakes_take_bf16_pools(dtype):
    """Under fake tensors (as ``torch.compile`` traces) ``kimi::kda_decode`` and
    ``kimi::kda_recover`` take a bf16 pool and refuse an fp16 one naming ``state``."""
    args, kw = decode_args()
    args["state"] = args["state"].to(dtype)
    rargs, rkw = recover_args()
    rargs[0] = rargs[0].to(dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        if dtype == torch.bfloat16:
            decode_op(args, kw, None)
            torch.ops.kimi.kda_recover(*rargs, rkw["lower_bound"], False, None)
        else:
            with pytest.raises(ValueError, match="state"):
                decode_op(args, kw, None)
            with pytest.raises(ValueError, match="state"):
                torch.ops.kimi.kda_recover(*rargs, rkw["lower_bound"], False, None)


def test_decode_layer_checks_state_dtype():
    """``state_dtype`` must be fp32 or bf16 and match the shard's pool: ValueError naming
    the argument; a bf16 layer records its dtype."""
    shard = kt.make_layer(2, 6, window=5, seed=1)
    ones = torch.ones(1024, dtype=torch.bfloat16)
    w_o = torch.zeros(1024, 256, dtype=torch.bfloat16)
    common = dict(rank=0, norm=ones, query=ones, out_norm=ones, sms=132)
    with pytest.raises(ValueError, match="state_dtype must be"):
        DecodeLayer(shard, w_o, {}, state_dtype=torch.float16, **common)
    with pytest.raises(ValueError, match="shard.state"):
        DecodeLayer(shard, w_o, {}, state_dtype=torch.bfloat16, **common)
    shard.state = shard.state.to(torch.bfloat16)
    with pytest.raises(ValueError, match="shard.state"):
        DecodeLayer(shard, w_o, {}, **common)  # the default: fp32
    layer = DecodeLayer(shard, w_o, {}, state_dtype=torch.bfloat16, kda_state="replay", **common)
    assert layer.state_dtype == torch.bfloat16 and layer.ring.v.dtype == torch.float32
    with pytest.raises(ValueError, match="state_dtype"):
        load_rank({}, rank=0, tp=1, pages=4, state_dtype=torch.float16)


def bf16_layer(kda_state):
    layer = make_layer(kda_state)
    layer.shard.state = layer.shard.state.to(torch.bfloat16)
    layer.state_dtype = torch.bfloat16
    return layer


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_bf16_export_import_round_trip(kda_state):
    """A bf16 layer's slots through a host blob come back bitwise; the blob records the
    state dtype, so an fp32 layer refuses it before writing."""
    layer = bf16_layer(kda_state)
    blob = layer.export_state(i32(2, 7, 2))
    assert blob.layout.state_dtype == torch.bfloat16
    before = snapshot(layer)
    layer.import_state(i32(1, 4, 9), blob)
    moved = {1: 2, 4: 7, 9: 2}
    for pool, old in zip(pools(layer), before, strict=True):
        for page in range(old.shape[0]):
            assert torch.equal(pool[page], old[moved.get(page, page)]), f"page {page}"
    other = make_layer(kda_state)
    kept = snapshot(other)
    with pytest.raises(ValueError, match="blob: its"):
        other.import_state(i32(1, 4, 9), blob)
    assert all(torch.equal(p, k) for p, k in zip(pools(other), kept, strict=True))


def test_bf16_prefill_hand_off_rounds_once():
    """fla's fp32 prefill state into a bf16 pool: rounded once (nearest even); handed back
    to a prefill as the widened fp32 pages."""
    layer = bf16_layer("per-step")
    S, H = layer.shard.state.shape[:2]
    final = torch.randn(2, H, 128, 128)
    convs = [torch.randn(2, H * 128, 4).bfloat16() for _ in range(3)]
    slots = i32(3, 5)
    es.handoff(layer.shard, slots, final, convs, rank=0, tp=1, state_v_first=True)
    assert torch.equal(layer.shard.state[slots.long()], final.to(torch.bfloat16))
    back = es.prefill_state(layer, slots)
    assert back.dtype == torch.float32 and torch.equal(back, final.to(torch.bfloat16).float())


@pytest.mark.distributed
@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_torchrun_bf16_state(kda_state):
    """The job on bf16 pages (host backend): every check against the references run on
    bf16 pages; replay's comparison with the per-step path is not made (docs/cli.md)."""
    p, lines = torchrun(2, "--heads", "4", "--requests", "3", "--tokens", "3", "--steps", "5",
                        "--state-dtype", "bf16", "--kda-state", kda_state)  # fmt: skip
    assert_ok(p, lines)
    assert "state pages bf16" in p.stdout
    pages = "checkpoint pages" if kda_state == "replay" else "state pages"
    assert f"ok   {pages} == unsharded (bitwise): 5/5 steps" in p.stdout
