"""GPU tests of kda.replay_decode (KdaReplay) against kda.reference.replay_decode and
against the per-step kernel kda.decode.

Against the reference, step by step over many steps, decode (T = 1) and verify (T = 2, 4,
8 with random acceptance) (ring wrap-arounds with folds, padding rows with slot -1 or 0, a
request moving to a fresh slot), and a decode step after verify steps (one pending entry
commits): outputs poisoned before each call and within the
per-step kernels' rule (``test_kda_kernels_gpu.check_output``, with the reference's sum of
|terms| of ``o`` as the bound of another fp32 order); ring counters, k and raw-gate entries
bitwise the reference's, the new ``v_new`` within its fp32 bound; conv pages bitwise;
folded checkpoint pages within 1e-5 of the page's max, every other page and ring entry
bitwise unchanged. Each step starts from the reference's pools (as the per-step tests do).
The PDL test (after an early-releasing predecessor) checks the same. Against kda.decode: a
few hundred free-running steps, outputs within 1 bf16 ulp plus one ulp of ``o`` where the
per-step reference's fp32 ``o`` lies within the paths' drift of a bf16 midpoint,
materialised state within 1e-5 of the page's max.
"""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import (
    PDL_INPUTS,
    POISON,
    SCALARS,
    bf16_ulp,
    check_output,
    gate,
    o_error_bound,
    quantize_gate_inputs,
    replay_after_predecessor,
)

import kda
from kda import reference as ref
from kda import synthetic as kt
from kda.operands import Ring, make_ring

pytestmark = pytest.mark.gpu


def run(fn, layer, step, ring, scalars, **kw):
    lower_bound, scale, eps = scalars
    return fn(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, **gate(lower_bound), scale=scale, eps=eps, accepted=step.accepted,
        conv_dim_first=layer.conv_dim_first, ring=ring, **kw,
    )  # fmt: skip


def copy_ring(ring):
    return Ring(*(t.clone() for t in ring))


def check_step(got_layer, got_ring, want_layer, want_ring, before, firsts, folded, tokens):
    """Pools after one step from identical pools ``before`` = (state, conv, ring):
    ``firsts`` maps each live slot to its first written entry, ``folded`` the slots whose
    ring was folded. Returns the mask [S, R] of written entries."""
    state0, _, ring0 = before
    assert torch.equal(got_layer.conv_state, want_layer.conv_state), "conv pages differ"
    assert torch.equal(got_ring.length, want_ring.length), "ring counters differ"
    assert torch.equal(got_ring.kg, want_ring.kg), "ring k / raw-gate entries differ"
    written = torch.zeros(got_ring.v.shape[:2], dtype=torch.bool, device="cuda")
    for s, first in firsts.items():
        written[s, first : first + tokens] = True
    assert torch.equal(got_ring.v[~written], ring0.v[~written]), "ring entries not written moved"
    assert torch.equal(got_ring.kg[~written], ring0.kg[~written])
    pages = torch.ones(state0.shape[0], dtype=torch.bool, device="cuda")
    pages[folded] = False
    assert torch.equal(got_layer.state[pages], state0[pages]), "pages not folded changed"
    for p in folded:
        scale = want_layer.state[p].abs().max().item()
        err = (got_layer.state[p] - want_layer.state[p]).abs().max().item()
        assert err <= 1e-5 * scale, f"folded page {p}: {err:.3g} vs max {scale:.3g}"
    return written


def check_v_new(got_ring, want_ring, written, v_abs_entries):
    """The new entries' v_new within another fp32 order's bound of the reference's."""
    got, want = got_ring.v[written], want_ring.v[written]
    bound = o_error_bound(want, v_abs_entries)
    assert (got - want).abs().le(bound).all(), (
        f"v_new beyond its bound: max {((got - want).abs() / bound).max().item():.2f}x"
    )


def held_entries(ring, slot, accepted, tokens):
    """Entries a step keeps before its own: committed plus the pending ones it commits."""
    committed, pending = ring.length[slot, 0].tolist()
    return committed + min(accepted, pending)  # accepted = 1 at T = 1


def plan_step(ring, step, size, tokens):
    """Before a step: {live request: its slot}, {slot: first entry the step writes} and
    the slots whose ring the step folds (``held + T > R``)."""
    slots = step.slots.view(step.slots.shape[0], -1)[:, 0].tolist()
    owners = {b: s for b, s in enumerate(slots) if s > 0}
    firsts, folded = {}, []
    for b, slot in owners.items():
        accepted = 1 if tokens == 1 else int(step.accepted[b])
        held = held_entries(ring, slot, accepted, tokens)
        firsts[slot] = 0 if held + tokens > size else held
        if held + tokens > size:
            folded.append(slot)
    return owners, firsts, folded


def check_ring_v(got_ring, want_ring, written, owners, firsts, v_abs, tokens):
    """The written entries' v_new against the reference's, with ``v_abs`` [B*T, H*128]:
    request b's token t went to entry ``firsts[slot] + t``."""
    rows = torch.zeros(got_ring.v.shape[:2] + (v_abs.shape[1],), device=v_abs.device)
    for b, slot in owners.items():
        for t in range(tokens):
            rows[slot, firsts[slot] + t] = v_abs[b * tokens + t]
    check_v_new(got_ring, want_ring, written, rows[written].view(-1, *got_ring.v.shape[2:]))


CASES = [
    # H, R, T, conv_dim_first, bias, gate_mode, pdl, scalars (mode 3, the default, on
    # unquantised inputs; modes 0 / 1 on gate inputs whose dot is exact in any order)
    (3, 2, 1, True, True, 3, False, 0),
    (6, 4, 1, False, False, 3, True, 1),
    (3, 8, 1, False, True, 0, False, 2),
    (6, 16, 1, True, False, 3, True, 0),
    (12, 8, 1, True, True, 1, False, 1),
    (3, 4, 2, True, True, 3, False, 0),
    (6, 8, 4, False, True, 0, True, 1),
    (3, 16, 8, True, False, 3, False, 2),
    (6, 8, 8, False, True, 3, True, 0),
    (6, 8, 1, True, True, 3, True, 1),
    (12, 16, 1, False, False, 3, False, 2),
    (3, 4, 4, False, True, 3, True, 0),
    # the softplus gate (SCALARS[3]), past its threshold on some channels
    (6, 4, 1, True, True, 3, False, 3),
    (3, 8, 4, False, True, 3, True, 3),
]


def step_against_reference(layer, ring, step, scalars, size, padding, **kernel):
    """One step of ``kda.replay_decode`` (``kernel``: its options) against the reference
    from the same pools: the output poisoned first, the ``padding`` requests' rows zero,
    outputs, pools and ring checked; then the kernel's pools continue from the reference's
    (as the per-step tests do). Returns (owners, folded) of ``plan_step``."""
    B = step.slots.shape[0]
    T, H = step.x.shape[0] // B, layer.state.shape[1]
    owners, firsts, folded = plan_step(ring, step, size, T)
    before = (layer.state.clone(), layer.conv_state.clone(), copy_ring(ring))
    want_layer, want_ring = layer.clone(), copy_ring(ring)
    o32, o_abs, v_abs = (torch.zeros(B * T, H * 128, device=step.x.device) for _ in range(3))
    want = run(ref.replay_decode, want_layer, step, want_ring, scalars, o_out=o32,
               o_abs=o_abs, v_abs=v_abs)  # fmt: skip
    out = torch.full((B * T, H * 128), POISON, dtype=torch.bfloat16, device=step.x.device)
    got = run(kda.replay_decode, layer, step, ring, scalars, out=out, **kernel)
    torch.cuda.synchronize()
    assert got is out
    padded = torch.tensor([b in padding for b in range(B)], device=out.device)
    padded = padded.repeat_interleave(T)
    assert torch.equal(got[padded], torch.zeros_like(got[padded])), "padding rows"
    check_output(got, want, H, (o32, o_abs))
    written = check_step(layer, ring, want_layer, want_ring, before, firsts, folded, T)
    check_ring_v(ring, want_ring, written, owners, firsts, v_abs, T)
    layer.state.copy_(want_layer.state)
    ring.v.copy_(want_ring.v)
    return owners, folded


@pytest.mark.parametrize("case", CASES, ids=lambda c: "H{}R{}T{}d{}b{}g{}p{}s{}".format(*c))
def test_replay_matches_reference(case):
    """Step by step against the reference. Decode: requests move to fresh slots now and
    then. Verify: random acceptance (the next step commits that many pending entries)."""
    H, size, T, dim_first, bias, gate_mode, pdl, which = case
    scalars = SCALARS[which]
    B = 5
    pages = 1 + B * T + 3
    layer = kt.make_layer(H, pages, window=T + 2 + which, conv_dim_first=dim_first, bias=bias,
                          seed=size + T, device="cuda")  # fmt: skip
    if scalars[0] is None:  # the softplus gate: some raw gates past its threshold
        kt.extreme_dt_bias(layer, seed=size)
    ring = make_ring(layer.state, size)
    g = torch.Generator().manual_seed(size + T)
    table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    free = list(range(1 + B * T, pages))
    steps, folds = 2 * size + 9, 0
    for n in range(steps):
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
                            seed=100 + n, device="cuda")  # fmt: skip
        if padding and n % 2:  # slot 0 is padding too (page 0 is never live)
            step.slots.view(B, -1)[padding[0]] = 0
        if gate_mode in (0, 1):  # the seed's mma orders bitwise the reference's raw gate
            quantize_gate_inputs(layer, step)  # (mode 3 rounds it exactly on any input)
        owners, folded = step_against_reference(layer, ring, step, scalars, size, padding,
                                                gate_mode=gate_mode, pdl=pdl)  # fmt: skip
        assert sorted(owners) == [b for b in range(B) if b not in padding]
        folds += len(folded)
    assert folds >= 2, f"only {folds} folds in {steps} steps"


@pytest.mark.parametrize("tokens", [1, 4])
def test_model_scale_default_against_reference(tokens):
    """The default configuration at Kimi-like scale: 96 heads, 64 requests (6144 items,
    about 16 waves of three CTAs per SM on an H200), unquantised inputs, gate mode 3, PDL,
    ring size 8; R + 2 steps from empty rings (each ring folds), each step against the
    reference (outputs poisoned, pools and ring as in the other cases)."""
    H, B, T, size = 96, 64, tokens, 8
    pages = 1 + B * T
    scalars = SCALARS[0]
    layer = kt.make_layer(H, pages, window=T + 2, seed=21, device="cuda")
    ring = make_ring(layer.state, size)
    table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    folds = 0
    for n in range(size + 2):
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, padding=(n % B,),
                            seed=60 + n, device="cuda")  # fmt: skip
        _, folded = step_against_reference(layer, ring, step, scalars, size, (n % B,),
                                           gate_mode=3, pdl=True)  # fmt: skip
        folds += len(folded)
    assert folds >= B - 1, f"only {folds} folds"


def test_decode_step_after_verify_steps():
    """A T = 1 step right after verify steps (rings with pending entries): one pending entry
    commits (token 0: the conv window's offset 0), the rest are dropped, as the reference."""
    H, B, T, size = 6, 6, 3, 4
    pages = 1 + B * T
    scalars = SCALARS[1]
    layer = kt.make_layer(H, pages, window=T + 2, seed=3, device="cuda")
    ring = make_ring(layer.state, size)
    table = 1 + torch.arange(B * T, dtype=torch.int32).view(B, T)
    for n in range(2):
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, padding=(n,), seed=40 + n,
                            device="cuda")  # fmt: skip
        run(ref.replay_decode, layer, step, ring, scalars)
    assert (ring.length[table[:, 0], :, 1] == T).all()
    step = kt.make_step(B, 1, H, pages=pages, slot_table=table, padding=(5,), seed=50,
                        device="cuda")  # fmt: skip
    owners, firsts, folded = plan_step(ring, step, size, 1)
    before = (layer.state.clone(), layer.conv_state.clone(), copy_ring(ring))
    want_layer, want_ring = layer.clone(), copy_ring(ring)
    o32, o_abs, v_abs = (torch.zeros(B, H * 128, device="cuda") for _ in range(3))
    want = run(ref.replay_decode, want_layer, step, want_ring, scalars, o_out=o32, o_abs=o_abs,
               v_abs=v_abs)  # fmt: skip
    out = torch.full((B, H * 128), POISON, dtype=torch.bfloat16, device="cuda")
    run(kda.replay_decode, layer, step, ring, scalars, gate_mode=3, out=out)
    torch.cuda.synchronize()
    written = check_step(layer, ring, want_layer, want_ring, before, firsts, folded, 1)
    check_ring_v(ring, want_ring, written, owners, firsts, v_abs, 1)
    check_output(out, want, H, (o32, o_abs))
    live = torch.tensor(list(owners.values()), device="cuda")
    assert (ring.length[live, :, 1] == 0).all() and (ring.length[table[5, 0], :, 1] == T).all()


def test_cuda_graph_replay_matches_eager():
    """One step captured in a CUDA graph (validation reads no values while capturing),
    replayed with new inputs: bitwise the eager launches' pools and outputs."""
    H, B, size, pages = 6, 8, 4, 10
    layer = kt.make_layer(H, pages, window=4, seed=7, device="cuda")
    ring = make_ring(layer.state, size)
    step = kt.make_step(B, 1, H, pages=pages, padding=(3,), seed=8, device="cuda")
    eager_layer, eager_ring = layer.clone(), copy_ring(ring)
    out = torch.empty(B, H * 128, dtype=torch.bfloat16, device="cuda")
    scalars = SCALARS[0]

    def launch(lyr, rg, o):
        run(kda.replay_decode, lyr, step, rg, scalars, gate_mode=3, pdl=True, out=o)

    scratch = layer.clone()
    launch(scratch, copy_ring(ring), torch.empty_like(out))  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch(layer, ring, out)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(2 * size + 3):
        fresh = kt.make_step(B, 1, H, pages=pages, padding=(3,), seed=20 + i, device="cuda")
        for name in ("x", "f_a", "beta", "gate"):
            getattr(step, name).copy_(getattr(fresh, name))
        out.fill_(POISON)
        graph.replay()
        eager = torch.full_like(out, POISON)
        launch(eager_layer, eager_ring, eager)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert torch.equal(layer.state, eager_layer.state)
        assert torch.equal(layer.conv_state, eager_layer.conv_state)
        for a, b in zip(ring, eager_ring, strict=True):
            assert torch.equal(a, b)
    # From an empty ring: size entries, a fold, size more, a fold, three: 3 held.
    assert ring.length[1].tolist() == [[3, 0]] * H
    assert ring.length[4].tolist() == [[0, 0]] * H  # the padding request's slot


@pytest.mark.parametrize("T", [1, 3])
def test_pdl_waits_for_an_early_releasing_predecessor(T):
    """With PDL the step starts while its predecessor spins and must wait for the
    predecessor's writes of x, f_a, beta and gate (poisoned before); rings hold entries
    (a few reference steps first) and some fold: outputs, pools and rings as the
    reference's on the clean inputs."""
    import pdl_predecessor

    H, B, size = 12, 40, 3  # requests with three entries fold (T = 1), most do at T = 3
    pages = 1 + B * T + 2
    scalars = SCALARS[1]
    layer = kt.make_layer(H, pages, window=T + 3, seed=7, device="cuda")
    ring = make_ring(layer.state, size)
    for n in range(3):  # fill levels 2-3 (T = 1) / pending verify tokens (T = 3)
        step = kt.make_step(B, T, H, pages=pages, padding=(n,), seed=30 + n, device="cuda")
        run(ref.replay_decode, layer, step, ring, scalars)
    step = kt.make_step(B, T, H, pages=pages, padding=(4,), seed=8, device="cuda")
    clean = [getattr(step, n).clone() for n in PDL_INPUTS]
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16, device="cuda")
    start, start_ring = layer.clone(), copy_ring(ring)
    owners, firsts, folded = plan_step(ring, step, size, T)
    assert folded, "no ring folds in the step"
    assert T > 1 or len(folded) < len(owners), "every ring folds (T = 1)"
    want_layer, want_ring = layer.clone(), copy_ring(ring)
    o32, o_abs, v_abs = (torch.zeros(B * T, H * 128, device="cuda") for _ in range(3))
    want = run(ref.replay_decode, want_layer, step, want_ring, scalars, o_out=o32, o_abs=o_abs,
               v_abs=v_abs)  # fmt: skip

    def launch():
        run(kda.replay_decode, layer, step, ring, scalars, gate_mode=3, pdl=True, out=out)

    pdl_predecessor.run([(clean[0], step.x)], spin_ns=100_000)  # compile both
    launch()
    torch.cuda.synchronize()
    for pool, saved in ((layer.state, start.state), (layer.conv_state, start.conv_state),
                        *zip(ring, start_ring, strict=True)):  # fmt: skip
        pool.copy_(saved)
    out.fill_(POISON)
    replay_after_predecessor(launch, clean, [getattr(step, n) for n in PDL_INPUTS])
    before = (start.state, start.conv_state, start_ring)
    written = check_step(layer, ring, want_layer, want_ring, before, firsts, folded, T)
    check_ring_v(ring, want_ring, written, owners, firsts, v_abs, T)
    check_output(out, want, H, (o32, o_abs))


# How far the two paths' fp32 ``o`` may drift apart over 300 free-running steps, of the
# head row's max |o|: the two references (fp64 sums) drift to 2^-20 (measured on the CPU);
# the kernels' fp32 orders add a few 2^-24 per step, ~2^-15 at most. Only that close to a
# bf16 midpoint may ``o`` round the other way (SPEC's rule, the drift as the error bound).
DRIFT = 2.0**-12


def check_close_outputs(got, want, o32):
    """SPEC's 1 ulp; where the per-step reference's fp32 ``o`` (``o32``, on the per-step
    pools) lies within ``DRIFT`` of the row's max |o| of a bf16 midpoint, one ulp of ``o``
    (2^-7 of the value) more; small elements within 2^-17 of the row's rms.
    Returns the fraction of elements not bitwise equal."""
    g, w = got.float(), want.float()
    rows = w.view(w.shape[0], -1, 128)
    rms = rows.pow(2).mean(-1, keepdim=True).sqrt().expand_as(rows).reshape(w.shape)
    o_rows = o32.view(rows.shape)
    top = o_rows.abs().amax(-1, keepdim=True).expand_as(o_rows).reshape(w.shape)
    bits = o32.contiguous().view(torch.int32)
    mid = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # the midpoint above |o|'s bf16
    near = (o32.abs() - mid.abs()).abs() <= top * DRIFT
    flip = torch.where(near, w.abs() * 2.0**-7 * 1.01, torch.zeros_like(w))
    err = (g - w).abs()
    big = w.abs() >= rms * 2.0**-10
    ok = torch.where(big, err <= bf16_ulp(w) + flip, err <= rms * 2.0**-17 + flip)
    assert not torch.isnan(g).any(), "NaN in output (poison not overwritten?)"
    assert ok.all(), f"{int((~ok).sum())} elements beyond 1 ulp (+ one ulp of o near a midpoint)"
    return (err != 0).float().mean().item()


@pytest.mark.parametrize("size, dim_first, which", [(8, True, 0), (4, False, 0), (4, True, 3)])
def test_replay_tracks_per_step_kernel(size, dim_first, which):
    """300 free-running steps of the replay kernel beside kda.decode (KdaWide) on the same
    inputs; every 50 steps the replay pools are materialised (``kda.reference.materialize``
    on a copy) and compared with the per-step state. ``which``: the ``SCALARS`` (3: the
    softplus gate)."""
    H, B, pages = 3, 4, 6
    scalars = SCALARS[which]
    per_step = kt.make_layer(H, pages, window=3, conv_dim_first=dim_first, seed=11, device="cuda")
    layer = per_step.clone()
    ring = make_ring(layer.state, size)
    g = torch.Generator().manual_seed(12)
    flipped = []
    for n in range(300):
        padding = [b for b in range(B) if torch.rand(1, generator=g) < 0.2]
        step = kt.make_step(B, 1, H, pages=pages, padding=padding, seed=n, device="cuda")
        want = torch.full((B, H * 128), POISON, dtype=torch.bfloat16, device="cuda")
        lower_bound, scale, eps = scalars
        # The per-step reference's fp32 o on the per-step pools before the step.
        probe, o32 = per_step.clone(), torch.zeros(B, H * 128, device="cuda")
        kt.run_reference(probe, step, **gate(lower_bound), scale=scale, eps=eps, o_fp32=o32)
        kda.decode(
            step.x, per_step.conv_weight, per_step.conv_bias, per_step.conv_state, step.f_a,
            step.beta, per_step.a_log, per_step.dt_bias, step.slots, per_step.state, step.gate,
            per_step.norm_weight, per_step.f_b, **gate(lower_bound), scale=scale, eps=eps,
            conv_dim_first=dim_first, kernel="wide", gate_mode=3, out=want,
        )  # fmt: skip
        got = torch.full_like(want, POISON)
        run(kda.replay_decode, layer, step, ring, scalars, gate_mode=3, out=got)
        flipped.append(check_close_outputs(got, want, o32))
        assert torch.equal(layer.conv_state, per_step.conv_state), "conv pages differ"
        if n % 50 == 49:
            state = layer.state.clone()
            ref.materialize(state, copy_ring(ring), layer.a_log, layer.dt_bias,
                            **gate(lower_bound))  # fmt: skip
            for p in range(1, B + 1):
                top = per_step.state[p].abs().max().item()
                err = (state[p] - per_step.state[p]).abs().max().item()
                assert err <= 1e-5 * top, f"step {n} page {p}: {err:.3g} vs max {top:.3g}"
    print(f"  outputs not bitwise: mean {sum(flipped) / len(flipped):.5f}, max {max(flipped):.5f}")
