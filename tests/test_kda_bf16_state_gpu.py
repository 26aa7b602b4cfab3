"""GPU tests of KdaRecover, KdaReplay and KdaFold on bf16 pages against ``kda.reference`` on
the same bf16 pool; stored pages checked as ``test_kda_bf16_gpu.check_bf16_pages`` (the
reference's fp32 value ``pre`` from an fp32 copy of the pool: a recover's pages, a fold's)."""

from __future__ import annotations

import pytest
import torch
from test_kda_bf16_gpu import check_bf16_pages, to_bf16
from test_kda_kernels_gpu import POISON, SCALARS, check_output, gate
from test_kda_recover_gpu import LOWER_BOUNDS, commit_pages, poison_past_accepted, recorded_step
from test_kda_replay_gpu import copy_ring, run

import kda
from kda import reference as ref
from kda import synthetic as kt
from kda.operands import make_ring

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("H,B,T,pdl", [(7, 9, 3, False), (5, 33, 4, True), (3, 4, 2, True)])
def test_bf16_recover_matches_reference(H, B, T, pdl):
    """A recorded verify step committed by ``kda.recover`` into a bf16 pool, padding and
    holes included; ``pre``: the reference's recover on the widened pool."""
    layer, step, records = recorded_step(H, B, T, padding=(1,), seed=H, holes=True)
    to_bf16(layer)
    accepted = ((torch.arange(B, device="cuda") % T) + 1).to(torch.int32)
    poison_past_accepted(records, accepted)
    before, want, pre = layer.state.clone(), layer.state.clone(), layer.state.float()
    args = (step.slots, *records, layer.a_log, layer.dt_bias, accepted, step.accepted)
    lower_bound = LOWER_BOUNDS[H % len(LOWER_BOUNDS)]
    ref.recover(want, *args, **gate(lower_bound))
    ref.recover(pre, *args, **gate(lower_bound))
    kda.recover(layer.state, *args, **gate(lower_bound), pdl=pdl)
    torch.cuda.synchronize()
    written = commit_pages(step.slots, step.accepted.cpu(), accepted.cpu())
    assert written, "nothing committed"
    check_bf16_pages(layer.state, want, pre, before, written)


def replay_steps(H, B, T, size, steps, *, dim_first, seed):
    """``steps`` replay steps on a bf16 pool, kernel against the reference from the same
    pools each step (outputs poisoned; pages a fold wrote checked against the fold's fp32
    value; ring and conv pages as the fp32 tests); the kernel's pools then continue from
    the reference's. Returns (layer, ring, folds)."""
    pages = 1 + B * T
    scalars = SCALARS[seed % len(SCALARS)]
    layer = to_bf16(kt.make_layer(H, pages, window=T + 2, conv_dim_first=dim_first,
                                  seed=seed, device="cuda"))  # fmt: skip
    ring = make_ring(layer.state, size)
    table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    folds = 0
    for n in range(steps):
        padding = (n % B,)
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, padding=padding,
                            seed=seed + 10 + n, device="cuda")  # fmt: skip
        before = layer.state.clone()
        want, want_ring = layer.clone(), copy_ring(ring)
        wide, wide_ring = layer.clone(), copy_ring(ring)
        wide.state = layer.state.float()
        o32, o_abs = (torch.zeros(B * T, H * 128, device="cuda") for _ in range(2))
        expect = run(ref.replay_decode, want, step, want_ring, scalars, o_out=o32, o_abs=o_abs)
        run(ref.replay_decode, wide, step, wide_ring, scalars)
        out = torch.full((B * T, H * 128), POISON, dtype=torch.bfloat16, device="cuda")
        run(kda.replay_decode, layer, step, ring, scalars, out=out, pdl=n % 2 == 1)
        torch.cuda.synchronize()
        folded = (want.state != before).flatten(1).any(-1).nonzero()[:, 0].tolist()
        folds += len(folded)
        check_bf16_pages(layer.state, want.state, wide.state, before, folded)
        assert torch.equal(layer.conv_state, want.conv_state), "conv pages differ"
        assert torch.equal(ring.length, want_ring.length) and torch.equal(ring.kg, want_ring.kg)
        # A fold whose page rounded the other way at a midpoint (check_bf16_pages allows it:
        # ~5e-5 of the elements, so about half the folded pages hold one) feeds that page to
        # the step's tokens: those items' outputs come from a state one bf16 ulp apart, not
        # the reference's, and are left out here; every other item's outputs are checked
        flipped = (layer.state != want.state).flatten(2).any(-1)  # [pages, H]
        moved = flipped[table[:, 0].to(flipped.device).long()]  # [B, H]: on a flipped page
        rows = moved.repeat_interleave(T, 0).repeat_interleave(128, 1)  # [B*T, H*128]
        print(f"step {n}: {int(moved.sum())} of {B * H} items read a flipped fold page")
        check_output(torch.where(rows, expect, out), expect, H, (o32, o_abs))
        layer.state.copy_(want.state)
        ring.v.copy_(want_ring.v)
    return layer, ring, folds


@pytest.mark.parametrize(
    "H,B,T,size,dim_first",
    [(7, 9, 1, 2, True), (5, 12, 2, 4, False), (96, 64, 1, 4, True), (3, 20, 4, 4, False)],
)
def test_bf16_replay_matches_reference(H, B, T, size, dim_first):
    """Replay steps over more than a ring's worth, so every live ring folds at least once:
    the fold rounds the page once, and the step's tokens read it back as stored."""
    steps = size // T + 2
    _, _, folds = replay_steps(H, B, T, size, steps, dim_first=dim_first, seed=H + T)
    assert folds >= B - 1, f"only {folds} folds"


@pytest.mark.parametrize("has_accepted", [False, True])
def test_bf16_fold_matches_materialize(has_accepted):
    """``kda.fold`` (KdaFold) of partly filled rings into bf16 pages: the reference's
    ``materialize`` bit for bit except at the fp32 fold's rounding midpoints (its per-entry
    scalars are the reference's, so in practice bitwise)."""
    H, B, T, size = 6, 10, 1, 8
    layer, ring, _ = replay_steps(H, B, T, size, 3, dim_first=True, seed=31)
    slots = torch.tensor([1, 0, 3, 4, 7, -1], dtype=torch.int32, device="cuda")
    accepted = torch.tensor([1, 0, 2, 1, 0, 0], dtype=torch.int32, device="cuda")
    keep = slots > 0
    want, want_ring = layer.state.clone(), copy_ring(ring)
    pre, pre_ring = layer.state.float(), copy_ring(ring)
    options = dict(lower_bound=SCALARS[0][0], slots=slots[keep])
    if has_accepted:
        options["accepted"] = accepted[keep]
    ref.materialize(want, want_ring, layer.a_log, layer.dt_bias, **options)
    ref.materialize(pre, pre_ring, layer.a_log, layer.dt_bias, **options)
    before = layer.state.clone()
    kda.fold(layer.state, ring, layer.a_log, layer.dt_bias, slots, lower_bound=SCALARS[0][0],
             accepted=accepted if has_accepted else None)  # fmt: skip
    torch.cuda.synchronize()
    pages = slots[keep].tolist()
    check_bf16_pages(layer.state, want, pre, before, pages)
    assert torch.equal(ring.length, want_ring.length)
