"""GPU tests of KdaReplayStream (``kda.replay_decode(kernel="stream")``, persistent):
against kda.reference.replay_decode step by step (as test_kda_replay_gpu.py, fewer cases;
few persistent CTAs, so that each walks many items: padding items, folds and both v_new
parities inside one CTA's range), and bitwise against KdaReplay (``kernel="wide"``) on the
same pools: outputs, checkpoint pages, conv pages and ring, every step (the same device
functions in the same order), including the benchmark's shape through the dispatcher.
"""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import POISON, SCALARS, check_output, quantize_gate_inputs
from test_kda_replay_gpu import check_ring_v, check_step, copy_ring, plan_step, run

import kda
from kda import dispatch, replay_ops
from kda import reference as ref
from kda import synthetic as kt
from kda.operands import DecodeOperands, make_ring

pytestmark = pytest.mark.gpu


def stream_decode(*args, ring, ctas, gate_mode=3, pdl=False, out=None, **kwargs):
    """``kda.replay_decode`` with KdaReplayStream on ``ctas`` persistent CTAs."""
    op = DecodeOperands(*args, **kwargs)
    if out is None:
        out = torch.empty(op.x.shape[0], op.gate.shape[1], dtype=torch.bfloat16, device="cuda")
    replay_ops.launch(op, ring, out, gate_mode=gate_mode, pdl=pdl, kernel="stream", ctas=ctas)
    return out


CASES = [
    # H, R, T, conv_dim_first, bias, gate_mode, pdl, scalars, ctas
    (3, 8, 1, True, True, 3, False, 0, 2),
    (6, 16, 1, False, False, 3, True, 1, 5),
    (3, 4, 1, False, True, 0, False, 2, 1),
    (6, 2, 1, True, False, 3, True, 0, 4),
    (6, 8, 2, True, True, 3, False, 1, 3),
    (3, 4, 4, False, True, 3, True, 2, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}R{}T{}d{}b{}g{}p{}s{}c{}".format(*c))
def test_stream_matches_reference(case):
    """Step by step against the reference (outputs poisoned, pools and ring checked as in
    test_kda_replay_gpu.py). Decode: requests move to fresh slots now and then; verify:
    random acceptance."""
    H, size, T, dim_first, bias, gate_mode, pdl, which, ctas = case
    scalars = SCALARS[which]
    B = 7
    pages = 1 + B * T + 3
    layer = kt.make_layer(H, pages, window=T + 2 + which, conv_dim_first=dim_first, bias=bias,
                          seed=size + T, device="cuda")  # fmt: skip
    ring = make_ring(layer.state, size)
    g = torch.Generator().manual_seed(size + T + ctas)
    table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    free = list(range(1 + B * T, pages))
    folds = 0
    for n in range(2 * size + 7):
        if T == 1 and n % 7 == 5:  # a request leaves; a new one joins on a fresh slot
            b = int(torch.randint(B, (1,), generator=g))
            free.append(int(table[b, 0]))
            table[b, 0] = free.pop(0)
            fresh = int(table[b, 0])
            layer.state[fresh] = 0
            layer.conv_state[fresh] = 0
            ring.length[fresh] = 0
        padding = [b for b in range(B) if torch.rand(1, generator=g) < 0.25]
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, padding=padding,
                            seed=200 + n, device="cuda")  # fmt: skip
        if padding and n % 2:  # slot 0 is padding too
            step.slots.view(B, -1)[padding[0]] = 0
        if gate_mode in (0, 1):
            quantize_gate_inputs(layer, step)
        owners, firsts, folded = plan_step(ring, step, size, T)
        folds += len(folded)
        before = (layer.state.clone(), layer.conv_state.clone(), copy_ring(ring))
        want_layer, want_ring = layer.clone(), copy_ring(ring)
        o32, o_abs, v_abs = (torch.zeros(B * T, H * 128, device="cuda") for _ in range(3))
        want = run(ref.replay_decode, want_layer, step, want_ring, scalars, o_out=o32,
                   o_abs=o_abs, v_abs=v_abs)  # fmt: skip
        out = torch.full((B * T, H * 128), POISON, dtype=torch.bfloat16, device="cuda")
        run(stream_decode, layer, step, ring, scalars, gate_mode=gate_mode, pdl=pdl, out=out,
            ctas=ctas)  # fmt: skip
        torch.cuda.synchronize()
        padded = torch.tensor([b in padding for b in range(B)], device="cuda")
        padded = padded.repeat_interleave(T)
        assert torch.equal(out[padded], torch.zeros_like(out[padded])), "padding rows"
        check_output(out, want, H, (o32, o_abs))
        written = check_step(layer, ring, want_layer, want_ring, before, firsts, folded, T)
        check_ring_v(ring, want_ring, written, owners, firsts, v_abs, T)
        # The next step starts from the reference's pools.
        layer.state.copy_(want_layer.state)
        ring.v.copy_(want_ring.v)
    assert folds > 0, "no ring folded"


def filled_ring(layer, size, seed):
    """A ring with finite entries and staggered fill levels (slot s holds s % size)."""
    ring = make_ring(layer.state, size)
    g = torch.Generator(device="cuda").manual_seed(seed)
    ring.v.copy_(torch.randn(ring.v.shape, generator=g, device="cuda") * 0.05)
    ring.kg.copy_(torch.randn(ring.kg.shape, generator=g, device="cuda").to(torch.bfloat16))
    held = torch.arange(ring.length.shape[0], device="cuda", dtype=torch.int32) % size
    ring.length[:, :, 0] = held[:, None]
    return ring


BITWISE = [
    # H, B, R, T, gate_mode, ctas (None: the dispatcher's, which must pick stream)
    (12, 48, 8, 1, 3, None),
    (96, 128, 8, 1, 3, None),  # the benchmark's shape
    (3, 9, 16, 1, 3, 4),
    (6, 7, 4, 2, 0, 3),
    (3, 11, 8, 4, 1, 2),
]


@pytest.mark.parametrize("case", BITWISE, ids=lambda c: "H{}B{}R{}T{}g{}c{}".format(*c))
def test_stream_bitwise_equals_replay(case):
    """KdaReplayStream and KdaReplay from the same pools, R + 3 steps (every ring folds
    once): outputs, state and conv pools and the ring bitwise equal after every step."""
    H, B, size, T, gate_mode, ctas = case
    pages = 1 + B * T + 2
    layer = kt.make_layer(H, pages, window=T + 3, seed=5 + T, device="cuda")
    ring = filled_ring(layer, size, seed=6)
    other, other_ring = layer.clone(), copy_ring(ring)
    if ctas is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert dispatch.choose_replay(B, H, T, size, sms=sms).kernel == "stream"
    g = torch.Generator().manual_seed(9)
    scalars = SCALARS[1]
    for n in range(size + 3):
        padding = [b for b in range(B) if torch.rand(1, generator=g) < 0.2]
        step = kt.make_step(B, T, H, pages=pages, padding=padding, seed=300 + n, device="cuda")
        want = torch.full((B * T, H * 128), POISON, dtype=torch.bfloat16, device="cuda")
        run(kda.replay_decode, other, step, other_ring, scalars, gate_mode=gate_mode,
            kernel="wide", out=want)  # fmt: skip
        got = torch.full_like(want, POISON)
        if ctas is None:
            run(kda.replay_decode, layer, step, ring, scalars, gate_mode=gate_mode, out=got)
        else:
            run(stream_decode, layer, step, ring, scalars, gate_mode=gate_mode, out=got,
                ctas=ctas)  # fmt: skip
        torch.cuda.synchronize()
        assert not torch.isnan(got.float()).any(), f"step {n}: poison left in the output"
        assert torch.equal(got, want), f"step {n}: outputs differ"
        assert torch.equal(layer.state, other.state), f"step {n}: checkpoint pages differ"
        assert torch.equal(layer.conv_state, other.conv_state), f"step {n}: conv pages differ"
        for a, b, name in zip(ring, other_ring, ("v", "kg", "length"), strict=True):
            assert torch.equal(a, b), f"step {n}: ring.{name} differs"
