"""CPU tests of ``engine.state`` and ``kda.copy_state`` / ``kda.fold`` (their CPU path: the
references): slot copies bit for bit in both state modes and conv layouts, bad input
refused before anything is written, the fold op as ``materialize``, export / import
through host blobs (a blob of another layout refused), the prefill hand-off as
``admit_prefill`` for many slots, and the prefix-cache scenario: requests that start from
a snapshot give bitwise the outputs of requests that decoded the prefix themselves. The
kernels: test_engine_state_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kda
from engine import DecodeLayer, admit_prefill
from engine import state as es
from kda import layer as kl
from kda import reference as ref
from kda import synthetic as kt
from kda.operands import Ring

H, PAGES = 2, 10
SCALARS = dict(lower_bound=-5.0, scale=128**-0.5, eps=1e-6)


def make_layer(
    kda_state="per-step",
    *,
    heads=H,
    pages=PAGES,
    window=5,
    conv_dim_first=True,
    conv_dtype=torch.bfloat16,
    ring_size=4,
    device="cpu",
    seed=1,
):
    """A ``DecodeLayer`` over a random shard (no all-reduces: the state functions need none)
    with random pools and, in replay mode, random ring entries and counters."""
    shard = kt.make_layer(
        heads,
        pages,
        window=window,
        conv_dim_first=conv_dim_first,
        conv_dtype=conv_dtype,
        seed=seed,
        device=device,
    )
    ones = torch.ones(1024, dtype=torch.bfloat16, device=device)
    w_o = torch.zeros(1024, heads * 128, dtype=torch.bfloat16, device=device)
    layer = DecodeLayer(
        shard,
        w_o,
        {},
        rank=0,
        norm=ones,
        query=ones,
        out_norm=ones,
        sms=132,
        kda_state=kda_state,
        ring_size=ring_size,
    )
    if layer.ring is not None:
        g = torch.Generator(device=device).manual_seed(seed)
        layer.ring.v.normal_(generator=g)
        layer.ring.kg.copy_(torch.randn(layer.ring.kg.shape, generator=g, device=device))
        counts = torch.randint(0, ring_size // 2 + 1, (pages, 1, 2), generator=g, device=device)
        layer.ring.length.copy_(counts.expand(-1, heads, 2).int())
    return layer


def pools(layer):
    return [layer.shard.state, layer.shard.conv_state] + list(layer.ring or ())


def snapshot(layer):
    return [p.clone() for p in pools(layer)]


def i32(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
@pytest.mark.parametrize(
    "conv_dim_first, conv_dtype", [(True, torch.bfloat16), (False, torch.float32)]
)
def test_copy_state_copies_whole_slots(kda_state, conv_dim_first, conv_dtype):
    """Pairs (1 -> 4), (2 -> 5), (1 -> 6) and two padding pairs: every pool's destination
    page is its source's, bit for bit; every other page (sources included) unchanged."""
    layer = make_layer(kda_state, conv_dim_first=conv_dim_first, conv_dtype=conv_dtype)
    before = snapshot(layer)
    src, dst = i32(1, 2, 0, 1, 3), i32(4, 5, 7, 6, -1)
    layer.copy_state(src, dst)
    moved = {4: 1, 5: 2, 6: 1}
    for pool, old in zip(pools(layer), before, strict=True):
        for page in range(PAGES):
            want = old[moved.get(page, page)]
            assert torch.equal(pool[page], want), f"page {page}"


def test_copy_state_refuses_bad_input_before_writing():
    layer = make_layer("replay")
    before = snapshot(layer)
    S = layer.shard
    bad = [
        (dict(src=i32(1), dst=i32(PAGES)), "dst must be < 10"),
        (dict(src=i32(PAGES + 3), dst=i32(2)), "src must be < 10"),
        (dict(src=i32(1, 2), dst=i32(3, 3)), "dst: slot 3 is a destination twice"),
        (dict(src=i32(1, 2), dst=i32(2, 3)), "dst: slot 2 is also a source"),
        (dict(src=i32(1), dst=i32(2), live=i32(5, 2)), "dst: slot 2 is live"),
        (dict(src=i32(1).long(), dst=i32(2)), "src must have dtype"),
        (dict(src=i32(1, 2), dst=i32(2)), "dst must have shape"),
        (dict(src=[1], dst=i32(2)), "src must be a torch.Tensor"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            layer.copy_state(args["src"], args["dst"], live=args.get("live"))
    with pytest.raises(ValueError, match="conv_state must be"):
        kda.copy_state(S.state, S.conv_state[:, :4], i32(1), i32(2))
    with pytest.raises(ValueError, match="ring.v"):
        ring = Ring(layer.ring.v[:, :1].contiguous(), layer.ring.kg, layer.ring.length)
        kda.copy_state(S.state, S.conv_state, i32(1), i32(2), ring=ring)
    with pytest.raises(ValueError, match="state must have dtype"):
        kda.copy_state(S.state.double(), S.conv_state, i32(1), i32(2))
    for pool, old in zip(pools(layer), before, strict=True):
        assert torch.equal(pool, old)


def test_copy_state_fake_checks_shapes():
    """The op's fake implementation runs the shape checks (values unread) under fake
    tensors, as ``torch.compile`` traces it."""
    layer = make_layer("replay")
    S = layer.shard
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        f = mode.from_tensor
        ring = Ring(*(f(t) for t in layer.ring))
        kda.copy_state(f(S.state), f(S.conv_state), f(i32(1)), f(i32(PAGES + 5)), ring=ring)
        with pytest.raises(ValueError, match="dst must have shape"):
            kda.copy_state(f(S.state), f(S.conv_state), f(i32(1)), f(i32(2, 3)), ring=ring)


@pytest.mark.parametrize("with_accepted", [False, True])
def test_fold_op_is_materialize(with_accepted):
    """``DecodeLayer.fold`` (``kda.fold``, the CPU path) with a padding entry: the listed
    slots' rings folded as ``kda.reference.materialize`` folds them, their counters zero."""
    layer = make_layer("replay", ring_size=4)
    want_state, want_ring = layer.shard.state.clone(), Ring(*(t.clone() for t in layer.ring))
    S = layer.shard
    accepted = i32(1, 2) if with_accepted else None
    ref.materialize(
        want_state,
        want_ring,
        S.a_log,
        S.dt_bias,
        lower_bound=layer.lower_bound,
        slots=i32(3, 5),
        accepted=accepted,
    )
    layer.fold(i32(3, 0, 5), None if accepted is None else i32(1, 7, 2))
    assert torch.equal(S.state, want_state)
    assert all(torch.equal(a, b) for a, b in zip(layer.ring, want_ring, strict=True))
    assert not layer.ring.length[[3, 5]].any()
    with pytest.raises(ValueError, match="twice"):
        layer.fold(i32(3, 3))
    with pytest.raises(ValueError, match="accepted must be >= 0"):
        layer.fold(i32(3), i32(-1))
    with pytest.raises(ValueError, match="per-step"):
        make_layer("per-step").fold(i32(3))


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_export_import_round_trip(kda_state):
    """Slots exported to a blob come back bitwise into other slots; a reused ``out`` blob
    gives the same; the blob records the layout, so a layer of another layout (window, conv
    layout or dtype, ring size, heads) refuses it before writing."""
    layer = make_layer(kda_state)
    blob = layer.export_state(i32(2, 7, 2))
    assert blob.ready is None and blob.count == 3 and blob.layout == es.layout_of(layer)
    again = layer.export_state(i32(2, 7, 2), out=es.empty_blob(layer, 3, pin=False))
    assert all(torch.equal(a, b) for a, b in zip(blob.tensors(), again.tensors(), strict=True))
    before = snapshot(layer)
    layer.import_state(i32(1, 4, 9), blob)
    moved = {1: 2, 4: 7, 9: 2}
    for pool, old in zip(pools(layer), before, strict=True):
        for page in range(PAGES):
            assert torch.equal(pool[page], old[moved.get(page, page)]), f"page {page}"
    others = [
        dict(window=6),
        dict(conv_dim_first=False),
        dict(conv_dtype=torch.float32),
        dict(heads=3),
        dict(kda_state="replay" if kda_state == "per-step" else "per-step"),
        dict(ring_size=8) if kda_state == "replay" else dict(kda_state="replay"),
    ]
    for options in others:
        other = make_layer(**{"kda_state": kda_state, **options})
        kept = snapshot(other)
        with pytest.raises(ValueError, match="blob: its"):
            other.import_state(i32(1, 4, 9), blob)
        assert all(torch.equal(p, k) for p, k in zip(pools(other), kept, strict=True))
    for slots, match in (
        (i32(1, 4), "holds 3 slots"),
        (i32(1, 4, 4), "twice"),
        (i32(1, 4, PAGES), "1..9"),
        (i32(0, 4, 5), "1..9"),
    ):
        with pytest.raises(ValueError, match=match):
            layer.import_state(slots, blob)
    with pytest.raises(ValueError, match="live"):
        layer.import_state(i32(1, 4, 5), blob, live=i32(5))
    with pytest.raises(ValueError, match="out: its window"):
        make_layer(kda_state, window=6).export_state(i32(1, 2, 3), out=blob)


@pytest.mark.parametrize("state_v_first", [True, False])
@pytest.mark.parametrize("conv_dim_first", [True, False])
def test_handoff_is_admit_prefill_for_many_slots(state_v_first, conv_dim_first):
    """Three prefilled requests of a 4-head layer, rank 1 of TP 2: ``engine.state.handoff``
    writes bitwise what ``admit_prefill`` writes request by request (state transposed from
    fla's [key, value] when ``state_v_first=False``; the conv windows' last three inputs);
    ``prefill_state`` hands the pages back in the prefill's layout; a replay ring's counters
    are emptied."""
    N, W = 3, 6
    g = torch.Generator().manual_seed(4)
    recurrent = torch.randn(N, 2 * H, 128, 128, generator=g)
    windows = tuple(torch.randn(N, 2 * H * 128, W, generator=g).bfloat16() for _ in range(3))
    one = make_layer("replay", conv_dim_first=conv_dim_first)
    many = make_layer("replay", conv_dim_first=conv_dim_first)
    slots = i32(6, 2, 8)
    for i, s in enumerate(slots.tolist()):
        admit_prefill(
            one.shard, s, recurrent, windows, rank=1, tp=2, index=i, state_v_first=state_v_first
        )
    es.handoff(
        many.shard,
        slots,
        recurrent,
        windows,
        rank=1,
        tp=2,
        state_v_first=state_v_first,
        ring=many.ring,
    )
    assert torch.equal(one.shard.state, many.shard.state)
    assert torch.equal(one.shard.conv_state, many.shard.conv_state)
    assert not many.ring.length[slots.long()].any()
    back = es.prefill_state(many, slots, state_v_first=state_v_first)
    assert torch.equal(back, recurrent[:, H:])
    with pytest.raises(ValueError, match="slots must be \\[N\\]"):
        es.handoff(many.shard, slots[:2], recurrent, windows, rank=1, tp=2)
    with pytest.raises(ValueError, match="rank 2 of TP 2"):
        es.handoff(many.shard, slots, recurrent, windows, rank=2, tp=2)
    with pytest.raises(ValueError, match="conv_state \\(k\\)"):
        es.handoff(
            many.shard, slots, recurrent, (windows[0], windows[1][:2], windows[2]), rank=1, tp=2
        )


# --- the prefix-cache scenario ---------------------------------------------------------------


def replicate(step, order, slots, T):
    """A step whose request i carries the rows of ``step``'s request ``order[i]``."""
    index = torch.tensor(order, device=step.x.device)
    rows = lambda t: t.view(step.slots.shape[0], T, -1)[index].reshape(len(order) * T, -1)
    accepted = None if step.accepted is None else step.accepted[index].contiguous()
    return kl.Step(
        x=rows(step.x),
        f_a=rows(step.f_a),
        beta=rows(step.beta).contiguous(),
        gate=rows(step.gate),
        slots=slots,
        accepted=accepted,
    )


def run_step(layer, step, attend):
    """One KDA step of ``layer`` on ``step``: the references (``attend`` False, the host
    backend's route) or ``DecodeLayer.attend`` (the kernels)."""
    if attend:
        return layer.attend(
            step.x, step.f_a, step.beta, step.gate, step.slots, accepted=step.accepted
        )
    S = layer.shard
    fn = ref.decode if layer.ring is None else ref.replay_decode
    extra = {} if layer.ring is None else dict(ring=layer.ring)
    return fn(**kl.step_operands(S, step, **SCALARS), **extra)


def prefix_cache_scenario(kda_state, device="cpu", attend=False, heads=H):
    """Request A (slot 1) and two requests that will not use the cache (slots 2, 3) decode
    the same prefix (replay: ending in a verify step, whose entries stay pending); A's state
    is snapshotted into cache slot 4; two forks start from it (slots 5, 6). Then the forks
    and the two self-prefixed requests decode two continuations, X (5 and 2) and Y (6 and
    3), in the same steps: their outputs, pages and rings must be bitwise equal."""
    layer = make_layer(kda_state, heads=heads, device=device, ring_size=4)
    layer.admit(i32(1, 2, 3, 4, 5, 6, device=device))
    prefix = [1, 1, 2] if kda_state == "replay" else [1, 1, 1]
    continuation = [1, 2, 1, 2, 1] if kda_state == "replay" else [1] * 5
    for n, T in enumerate(prefix):
        step = kt.make_step(1, T, heads, pages=PAGES, seed=30 + n, device=device)
        slots = i32(1, 2, 3, device=device)
        slots = slots if T == 1 else torch.stack([slots, slots * 0], 1).contiguous()
        run_step(layer, replicate(step, [0, 0, 0], slots, T), attend)
    layer.copy_state(i32(1, device=device), i32(4, device=device))  # the snapshot
    layer.copy_state(i32(4, 4, device=device), i32(5, 6, device=device))  # two forks
    checked = 0
    for n, T in enumerate(continuation):
        step = kt.make_step(2, T, heads, pages=PAGES, seed=60 + n, device=device)
        slots = i32(5, 6, 2, 3, device=device)
        slots = slots if T == 1 else torch.stack([slots, slots * 0], 1).contiguous()
        out = run_step(layer, replicate(step, [0, 1, 0, 1], slots, T), attend)
        rows = out.view(4, T, -1)
        assert torch.equal(rows[0], rows[2]) and torch.equal(rows[1], rows[3]), f"step {n}"
        checked += 1
    for fork, own in ((5, 2), (6, 3)):
        for pool in pools(layer):
            assert torch.equal(pool[fork], pool[own]), f"slot {fork} vs {own}"
    return checked


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_prefix_cache_snapshot_matches_own_prefix(kda_state):
    assert prefix_cache_scenario(kda_state) == 5


OPCHECK_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_state_ops_pass_opcheck(kda_state):
    """``kimi::kda_copy_state`` and ``kimi::kda_fold`` (their CPU implementations, the
    references) through ``torch.library.opcheck``: schema, mutations, fake implementation."""
    layer = make_layer(kda_state)
    S = layer.shard
    ring = tuple(layer.ring) if layer.ring is not None else (None,) * 3
    args = (S.state, S.conv_state, i32(1, 2), i32(4, 5), *ring, None)
    torch.library.opcheck(torch.ops.kimi.kda_copy_state.default, args, test_utils=OPCHECK_UTILS)
    if layer.ring is not None:
        args = (S.state, *layer.ring, S.a_log, S.dt_bias, i32(1, 3), i32(1, 1), -5.0)
        torch.library.opcheck(torch.ops.kimi.kda_fold.default, args, test_utils=OPCHECK_UTILS)
