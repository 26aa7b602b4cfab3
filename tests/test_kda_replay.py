"""kda.reference.replay_decode / materialize against the per-step reference over long runs.

Both paths see the same inputs; the replay path keeps each slot's state as a checkpoint page
plus a ring of records. ``o`` is a bf16 rounding of an fp32 reduction that the two paths
order differently, and the output row of a head is a function of its bf16 ``o`` row and the
gate only: so every head row whose replay ``o`` lies away from a bf16 rounding midpoint must
be bitwise the per-step output; the others within 1 ulp plus one ulp of ``o``.
Materialised state pages: within 1e-5 of the page's max.
"""

from __future__ import annotations

import pytest
import torch

from kda import layer as kl
from kda import reference as ref
from kda import synthetic as kt
from kda.operands import Ring, make_ring

H = 3
MARGIN = 2.0**-18  # of the head row's max |o|: how far apart the two paths' fp32 o may lie


def near_midpoint(o32):
    """Elements of head rows ``o32`` [..., 128] within MARGIN x max|row| of a bf16 midpoint."""
    bits = o32.contiguous().view(torch.int32)
    midpoint = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)
    scale = o32.abs().amax(-1, keepdim=True)
    return (o32 - midpoint).abs() <= MARGIN * scale


def bf16_ulp(x):
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


def check_outputs(got, want, o32, rows_live):
    """Rows of heads whose o has no element near a midpoint: bitwise. Others: SPEC 1 ulp plus
    one ulp of o. Returns the number of head rows that were not bitwise."""
    g = got.float().view(got.shape[0], H, 128)[rows_live]
    w = want.float().view(want.shape[0], H, 128)[rows_live]
    risky = near_midpoint(o32.view(o32.shape[0], H, 128)[rows_live]).any(-1)  # [rows, H]
    same = (g == w).all(-1)
    assert (same | risky).all(), (
        f"{int((~same & ~risky).sum())} head rows differ away from o's midpoints"
    )
    rms = w.pow(2).mean(-1, keepdim=True).sqrt()
    err = (g - w).abs()
    big = w.abs() >= rms * 2.0**-10
    ok = torch.where(big, err <= bf16_ulp(w) + w.abs() * 2.0**-7, err <= rms * 2.0**-17)
    assert ok.all(), f"max err {err.max():.3g} beyond 1 ulp + one ulp of o"
    return int((~same).sum())


def check_states(state, want, pages):
    for p in pages:
        scale = want[p].abs().max().item()
        err = (state[p] - want[p]).abs().max().item()
        assert err <= 1e-5 * scale, f"page {p}: {err:.3g} vs max {scale:.3g}"


def gate(lower_bound):
    """The entries' gate keywords: ``lower_bound`` None is the softplus gate."""
    return dict(
        lower_bound=lower_bound, gate_form="softplus" if lower_bound is None else "lower-bound"
    )


def call(fn, layer, state, conv, step, **kw):
    return fn(
        step.x, layer.conv_weight, layer.conv_bias, conv, step.f_a, step.beta, layer.a_log,
        layer.dt_bias, step.slots, state, step.gate, layer.norm_weight, layer.f_b,
        **gate(kw.pop("lower_bound", kl.LOWER_BOUND)), scale=kl.SCALE, eps=kl.EPS,
        accepted=step.accepted, conv_dim_first=layer.conv_dim_first, **kw,
    )  # fmt: skip


def materialized(layer, state, ring, lower_bound=kl.LOWER_BOUND, **kw):
    out, copy = state.clone(), Ring(*(t.clone() for t in ring))
    ref.materialize(out, copy, layer.a_log, layer.dt_bias, **gate(lower_bound), **kw)
    return out


@pytest.mark.parametrize("size, lower_bound", [(4, -5.0), (16, -1.5), (8, None)])
def test_decode_matches_per_step(size, lower_bound):
    """T = 1 for 64 steps: padding rows, requests leaving and joining (a fresh slot: zero
    page, empty ring, zero conv page), ring wrap-arounds. ``lower_bound`` None: the
    softplus gate, some raw gates past its threshold."""
    B, pages = 3, 7
    layer = kt.make_layer(H, pages, window=3, seed=size)
    if lower_bound is None:
        kt.extreme_dt_bias(layer, seed=size)
    state, conv = layer.state.clone(), layer.conv_state.clone()  # the replay path's pools
    ring = make_ring(state, size)
    g = torch.Generator().manual_seed(size)
    owner = list(range(1, B + 1))  # slot of each request
    free = list(range(B + 1, pages))
    not_bitwise = 0
    for n in range(64):
        if n % 11 == 7:  # a request leaves, a new one joins on a fresh slot
            b = int(torch.randint(B, (1,), generator=g))
            free.append(owner[b])
            owner[b] = free.pop(0)
            for pool in (layer.state, state, layer.conv_state, conv):
                pool[owner[b]] = 0
            ring.length[owner[b]] = 0
        padding = [b for b in range(B) if torch.rand(1, generator=g) < 0.25]
        table = torch.tensor(owner, dtype=torch.int32)[:, None]
        step = kt.make_step(B, 1, H, pages=pages, slot_table=table, padding=padding, seed=n)
        want = call(ref.decode, layer, layer.state, layer.conv_state, step, lower_bound=lower_bound)
        o32 = torch.full((B, H * 128), float("nan"))
        got = call(ref.replay_decode, layer, state, conv, step, ring=ring, o_out=o32,
                   lower_bound=lower_bound)  # fmt: skip
        live = step.slots > 0
        assert torch.equal(got[~live], torch.zeros_like(got[~live])), "padding rows written"
        not_bitwise += check_outputs(got, want, o32, live)
        assert torch.equal(conv, layer.conv_state), "conv pages differ"
        if n % 21 == 20:
            check_states(materialized(layer, state, ring, lower_bound), layer.state, owner)
    assert (ring.length[..., 0] <= size).all() and (ring.length[..., 1] == 0).all()
    assert not_bitwise <= 0.01 * 64 * B * H, f"{not_bitwise} head rows not bitwise"


def test_verify_steps_match_per_step():
    """Verify steps (T = 3) with random acceptance: pending entries committed by the next
    step's ``accepted``, rejected ones dropped; ring R = 5 forces folds mid-run."""
    B, T, size = 3, 3, 5
    pages = 1 + B * T
    layer = kt.make_layer(H, pages, window=T + 3, seed=5, conv_dim_first=False)
    state, conv = layer.state.clone(), layer.conv_state.clone()
    ring = make_ring(state, size)
    table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    first = kt.make_step(B, 1, H, pages=pages, slot_table=table, seed=100)
    call(ref.decode, layer, layer.state, layer.conv_state, first)
    call(ref.replay_decode, layer, state, conv, first, ring=ring)
    g = torch.Generator().manual_seed(1)
    accepted = torch.ones(B, dtype=torch.int32)
    for n in range(16):
        padding = [b for b in range(B) if torch.rand(1, generator=g) < 0.25]
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, accepted=accepted,
                            padding=padding, seed=n)  # fmt: skip
        want = call(ref.decode, layer, layer.state, layer.conv_state, step)
        o32 = torch.full((B * T, H * 128), float("nan"))
        got = call(ref.replay_decode, layer, state, conv, step, ring=ring, o_out=o32)
        live = (step.slots[:, 0] > 0).repeat_interleave(T)
        check_outputs(got, want, o32, live)
        assert torch.equal(conv, layer.conv_state), "conv pages differ"
        # A padding request keeps its pages, pending entries and acceptance.
        fresh = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32)
        accepted = torch.where(step.slots[:, 0] > 0, fresh, accepted)
    # Commit the last step's accepted tokens and compare with where the per-step path
    # left each request's state (slots[b, accepted - 1]).
    base = table[:, 0].contiguous()
    out = materialized(layer, state, ring, slots=base, accepted=accepted)
    for b in range(B):
        want_page = int(table[b, accepted[b] - 1])
        scale = layer.state[want_page].abs().max().item()
        err = (out[int(base[b])] - layer.state[want_page]).abs().max().item()
        assert err <= 1e-5 * scale, f"request {b}: {err:.3g} vs {scale:.3g}"


def test_decode_step_after_verify_matches_per_step():
    """A T = 1 step right after a verify step reads the conv window after the verify step's
    token 0 (offset 0) and, on the per-step path, the state in ``slots[b, 0]``: token 0
    accepted. The replay step commits that one pending entry (not all T), so both paths
    agree, and the ring keeps no pending entry."""
    B, T, size = 3, 3, 8
    pages = 1 + B * T
    layer = kt.make_layer(H, pages, window=T + 2, seed=6)
    state, conv = layer.state.clone(), layer.conv_state.clone()
    ring = make_ring(state, size)
    table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    accepted = torch.ones(B, dtype=torch.int32)
    for n in range(3):
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, accepted=accepted, seed=n)
        call(ref.decode, layer, layer.state, layer.conv_state, step)
        call(ref.replay_decode, layer, state, conv, step, ring=ring)
        accepted = torch.tensor([3, 2, 3], dtype=torch.int32)
    step = kt.make_step(B, 1, H, pages=pages, slot_table=table, seed=9)  # slots[b, 0]
    want = call(ref.decode, layer, layer.state, layer.conv_state, step)
    o32 = torch.full((B, H * 128), float("nan"))
    got = call(ref.replay_decode, layer, state, conv, step, ring=ring, o_out=o32)
    check_outputs(got, want, o32, step.slots > 0)
    assert torch.equal(conv, layer.conv_state), "conv pages differ"
    assert (ring.length[table[:, 0], :, 1] == 0).all()
    base = table[:, 0].contiguous()
    check_states(materialized(layer, state, ring, slots=base), layer.state, base.tolist())


def test_materialize_then_per_step_continues():
    """An engine that needs the plain state materialises; the per-step path continues from it."""
    B, pages = 2, 4
    layer = kt.make_layer(H, pages, window=3, seed=9)
    state, conv = layer.state.clone(), layer.conv_state.clone()
    ring = make_ring(state, 8)
    for n in range(5):
        step = kt.make_step(B, 1, H, pages=pages, seed=n)
        call(ref.decode, layer, layer.state, layer.conv_state, step)
        call(ref.replay_decode, layer, state, conv, step, ring=ring)
    assert ring.length[1:3, :, 0].tolist() == [[5] * H] * 2
    ref.materialize(state, ring, layer.a_log, layer.dt_bias, lower_bound=kl.LOWER_BOUND)
    assert ring.length.abs().sum() == 0
    check_states(state, layer.state, [1, 2])


def test_bad_ring_refused_nothing_written():
    B, pages = 2, 4
    layer = kt.make_layer(H, pages, window=3, seed=2)
    step = kt.make_step(B, 1, H, pages=pages, seed=0)
    state, conv = layer.state.clone(), layer.conv_state.clone()
    ring = make_ring(state, 4)
    before = [t.clone() for t in (state, conv, *ring)]

    def refused(match, **kw):
        with pytest.raises(ValueError, match=match):
            call(ref.replay_decode, layer, state, conv, step, **kw)
        for a, b in zip(before, (state, conv, *ring), strict=True):
            assert torch.equal(a, b)

    refused("ring must be", ring=tuple(ring))
    refused("ring.v", ring=Ring(ring.v[:, :, :2].contiguous(), ring.kg, ring.length))
    refused("ring.kg", ring=Ring(ring.v, ring.kg.float(), ring.length))
    refused("ring.length", ring=Ring(ring.v, ring.kg, ring.length[:2]))
    refused("ring.v must hold", ring=make_ring(state, 4)._replace(v=torch.zeros(pages, 17, H, 128)))
    bad = Ring(ring.v, ring.kg, ring.length.clone())
    bad.length[1] = torch.tensor([4, 1])
    refused(r"ring.length\[1\]", ring=bad)
    bad.length[1] = torch.tensor([1, 0])
    bad.length[1, 2, 0] = 2
    refused(r"ring.length\[1\]: the heads' counters differ", ring=bad)
    step.slots[1] = step.slots[0]
    refused("live slots must be unique", ring=ring)
    with pytest.raises(ValueError, match="size"):
        make_ring(state, 1)
    with pytest.raises(ValueError, match="slots must be in"):
        ref.materialize(state, ring, layer.a_log, layer.dt_bias, lower_bound=-5.0,
                        slots=torch.tensor([0]))  # fmt: skip


def test_checked_mode_scans_the_ring():
    """``validate="full"``: a NaN in a held ring entry, the checkpoint page or a live row's
    input is refused before anything is written; the fast mode gives the same bits."""
    B, pages = 2, 4
    layer = kt.make_layer(H, pages, window=3, seed=3)
    state, conv = layer.state.clone(), layer.conv_state.clone()
    ring = make_ring(state, 4)
    call(ref.replay_decode, layer, state, conv, kt.make_step(B, 1, H, pages=pages, seed=0),
         ring=ring)  # fmt: skip
    step = kt.make_step(B, 1, H, pages=pages, seed=1)
    slot = int(step.slots[0])
    pools = (state, conv, *ring)

    def refused(name, edit):
        saved = [t.clone() for t in pools]
        undo = edit()
        with pytest.raises(ValueError, match=name):
            call(ref.replay_decode, layer, state, conv, step, ring=ring, validate="full")
        undo()
        for a, b in zip(saved, pools, strict=True):
            assert torch.equal(a, b)

    def nan_at(t, index):
        def edit():
            old = t[index].clone()
            t[index] = float("nan")
            return lambda: t.__setitem__(index, old)

        return edit

    refused("ring.v", nan_at(ring.v, (slot, 0, 0, 0)))
    refused("state", nan_at(state, (slot, 0, 0, 0)))
    refused("x", nan_at(step.x, (0, 0)))
    fast = [t.clone() for t in pools]
    out_fast = call(ref.replay_decode, layer, fast[0], fast[1], step, ring=Ring(*fast[2:]))
    out_full = call(ref.replay_decode, layer, state, conv, step, ring=ring, validate="full")
    assert torch.equal(out_fast, out_full)
    assert all(torch.equal(a, b) for a, b in zip(fast, pools, strict=True))
