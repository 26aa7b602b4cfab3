"""bf16 state pages in the reference (docs/contract.md "bf16 state pages").

The contract under test: a run on a bf16 pool equals, bit for bit, the fp32 run from the
same (widened) pages with the pool rounded to bf16 after each stored step; that is, the
arithmetic is the fp32 path's and each stored page is rounded to nearest-even exactly once.
Padding requests keep their pages; other pool dtypes, and rings in the pool's dtype, are
refused; the GPU launchers refuse a bf16 pool (on CPU, before the device check). CPU only.
"""

import pytest
import torch

import kda
from kda import layer as kl
from kda import reference as R
from kda import synthetic as kt
from kda.kernels.launch import launch_fold
from kda.operands import Ring, make_ring

H = 2


def bits(t):
    return t.detach().contiguous().view(torch.uint8).clone()


def pair(layer):
    """(bf16 layer, fp32 layer) with the same pages: the fp32 one holds the widened bf16."""
    low = layer.clone()
    low.state = layer.state.to(torch.bfloat16)
    high = layer.clone()
    high.state = low.state.float()
    return low, high


def rec_start(layer):
    """The bf16 pool a run starts from."""
    return layer.state.to(torch.bfloat16)


def rounded(state):
    """The fp32 pool after the single rounding of every stored page."""
    return state.to(torch.bfloat16)


def call(fn, layer, step, **kw):
    return fn(**kl.step_operands(layer, step), **kw)


def test_single_token_steps_round_once_per_stored_page():
    B, pages = 3, 6
    low, high = pair(kt.make_layer(H, pages, window=3, seed=11))
    rounding_seen = False
    for n in range(6):
        padding = (n % B,) if n % 2 else ()
        step = kt.make_step(B, 1, H, pages=pages, padding=padding, seed=100 + n)
        before = low.state.clone()
        out_low = kt.run_reference(low, step)
        out_high = kt.run_reference(high, step)
        assert torch.equal(out_low, out_high)
        assert torch.equal(low.conv_state, high.conv_state)
        want = rounded(high.state)
        rounding_seen |= not torch.equal(want.float(), high.state)
        assert torch.equal(bits(low.state), bits(want))
        for b in padding:  # a padding row: zero output, its page untouched
            assert torch.equal(out_low[b], torch.zeros_like(out_low[b]))
            page = 1 + b
            assert torch.equal(bits(low.state[page]), bits(before[page]))
        for page in (0, pages - 2, pages - 1):  # pages no request names
            assert torch.equal(bits(low.state[page]), bits(before[page]))
        high.state = want.float()  # the next step starts from the rounded pages
    assert rounding_seen, "the fp32 steps stored bf16-representable pages: nothing tested"


@pytest.mark.parametrize("T", [4])
def test_verify_records_and_recover(T):
    """T = 4: the direct verify (one rounding per token page, the fp32 state carried between
    tokens), record mode (no page written, records as the fp32 pool's) and recover (the
    committed pages, rounded once, equal to the direct verify's)."""
    B = 3
    pages = 1 + B * T + 2
    layer = kt.make_layer(H, pages, seed=21)
    step = kt.make_step(B, T, H, pages=pages, padding=(1,), seed=22)
    low, high = pair(layer)
    out_low, out_high = kt.run_reference(low, step), kt.run_reference(high, step)
    assert torch.equal(out_low, out_high)
    assert torch.equal(bits(low.state), bits(rounded(high.state)))
    padding_pages = slice(1 + T, 1 + 2 * T)  # request 1's: untouched
    assert torch.equal(bits(low.state[padding_pages]), bits(rec_start(layer)[padding_pages]))

    rec_low, rec_high = pair(layer)
    start = rec_low.state.clone()
    records = []
    for lay in (rec_low, rec_high):
        v = torch.full((B, H, T, 128), float("nan"))
        kg = torch.full((B, H, T, 256), float("nan"), dtype=torch.bfloat16)
        assert torch.equal(kt.run_reference(lay, step, records=(v, kg)), out_low)
        records.append((v, kg))
    assert torch.equal(bits(rec_low.state), bits(start)), "record mode wrote a page"
    (v_low, kg_low), (v_high, kg_high) = records
    assert torch.equal(bits(v_low), bits(v_high)) and torch.equal(bits(kg_low), bits(kg_high))

    n = torch.tensor([T, 2, 3], dtype=torch.int32)
    for lay, (v, kg) in zip((rec_low, rec_high), records, strict=True):
        R.recover(
            lay.state,
            step.slots,
            v,
            kg,
            layer.a_log,
            layer.dt_bias,
            n,
            step.accepted,
            lower_bound=kl.LOWER_BOUND,
        )
    assert torch.equal(bits(rec_low.state), bits(rounded(rec_high.state)))
    touched = {int(step.slots[b, t]) for b in (0, 2) for t in range(int(n[b]))}
    for page in range(pages):
        want = low.state[page] if page in touched else start[page]
        assert torch.equal(bits(rec_low.state[page]), bits(want)), f"page {page}"


def test_replay_with_a_ring_rounds_only_its_folds():
    """Replay T = 1 steps through ring wrap-arounds (folds), then a verify step and a
    materialize: the bf16 checkpoint pool equals the fp32 one rounded after each fold, the
    ring (v fp32, kg bf16 whatever the pool) and the outputs are bitwise the fp32 run's.
    A fold inside a step is a store: the step then reads the folded page as stored (rounded),
    so the fp32 run folds (``materialize``) and rounds before such a step."""
    B, pages, size = 2, 5, 4
    layer = kt.make_layer(H, pages, window=4, seed=31)
    low, high = pair(layer)
    rings = [make_ring(low.state, size), make_ring(high.state, size)]
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    for n in range(11):
        T = 2 if n == 10 else 1
        step = kt.make_step(B, T, H, pages=pages, slot_table=table[:, :T], seed=200 + n)
        if n == 10:
            step.accepted = torch.tensor([2, 1], dtype=torch.int32)
        full = rings[1].length[:, 0, 0] + T > size  # the step folds these slots first
        if full.any():
            slots = full.nonzero()[:, 0].int()
            R.materialize(
                high.state,
                rings[1],
                layer.a_log,
                layer.dt_bias,
                lower_bound=kl.LOWER_BOUND,
                slots=slots,
            )
            high.state = rounded(high.state).float()
        pairs = zip((low, high), rings, strict=True)
        outs = [call(R.replay_decode, x, step, ring=r) for x, r in pairs]
        assert torch.equal(outs[0], outs[1])
        for a, b in zip(*rings, strict=True):
            assert torch.equal(bits(a), bits(b))
        assert torch.equal(bits(low.state), bits(rounded(high.state)))
        high.state = rounded(high.state).float()
    assert not torch.equal(low.state, layer.state.to(torch.bfloat16)), "no fold happened"
    accepted = torch.tensor([1, 2], dtype=torch.int32)
    for lay, ring in zip((low, high), rings, strict=True):
        slots = torch.tensor([1, 3], dtype=torch.int32)
        R.materialize(
            lay.state,
            ring,
            layer.a_log,
            layer.dt_bias,
            lower_bound=kl.LOWER_BOUND,
            slots=slots,
            accepted=accepted,
        )
    assert torch.equal(bits(low.state), bits(rounded(high.state)))
    assert (rings[0].length == 0).all()


def test_cpu_fold_and_copy_take_bf16_pages():
    """``kda.fold`` / ``kda.copy_state`` on a CPU pool run the references: bf16 pages work."""
    layer = kt.make_layer(H, 4, window=3, seed=41)
    low, _ = pair(layer)
    ring = make_ring(low.state, 4)
    step = kt.make_step(1, 1, H, pages=4, seed=42)
    call(R.replay_decode, low, step, ring=ring)
    want, want_ring = low.state.clone(), Ring(*(t.clone() for t in ring))
    R.materialize(want, want_ring, layer.a_log, layer.dt_bias, lower_bound=kl.LOWER_BOUND)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32)
    kda.fold(low.state, ring, layer.a_log, layer.dt_bias, slots, lower_bound=kl.LOWER_BOUND)
    assert torch.equal(bits(low.state), bits(want))
    src, dst = torch.tensor([1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    kda.copy_state(low.state, low.conv_state, src, dst, ring=ring)
    assert torch.equal(bits(low.state[3]), bits(low.state[1]))


# --- refusals -------------------------------------------------------------------------------
def refused(fn, name, tensors, match=None):
    before = [bits(t) for t in tensors]
    with pytest.raises(ValueError) as info:
        fn()
    assert name in str(info.value), f"{name!r} not in: {info.value}"
    if match is not None:
        assert match in str(info.value), f"{match!r} not in: {info.value}"
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(bits(t), b), "a refused call changed an input"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_other_pool_dtypes_refused(dtype):
    T, B = 2, 2
    layer = kt.make_layer(H, 1 + B * T, seed=51)
    layer.state = layer.state.to(dtype)
    step = kt.make_step(B, T, H, pages=1 + B * T, seed=52)
    pools = [layer.state, layer.conv_state]
    refused(lambda: kt.run_reference(layer, step), "state", pools, "bfloat16")
    v, kg = torch.zeros(B, H, T, 128), torch.zeros(B, H, T, 256, dtype=torch.bfloat16)
    args = (layer.state, step.slots, v, kg, layer.a_log, layer.dt_bias, step.accepted)
    refused(lambda: R.recover(*args, step.accepted, lower_bound=-5.0), "state", pools)
    ring = Ring(
        torch.zeros(1 + B * T, 4, H, 128),
        torch.zeros(1 + B * T, 4, H, 256, dtype=torch.bfloat16),
        torch.zeros(1 + B * T, H, 2, dtype=torch.int32),
    )
    fold = (layer.state, ring, layer.a_log, layer.dt_bias)
    refused(lambda: R.materialize(*fold, lower_bound=-5.0), "state", pools)


@pytest.mark.parametrize(
    "name, edit",
    [
        ("ring.v", lambda r: r._replace(v=r.v.to(torch.bfloat16))),  # the pool's dtype: no
        ("ring.kg", lambda r: r._replace(kg=r.kg.float())),
    ],
)
def test_ring_dtypes_do_not_follow_the_pool(name, edit):
    layer = kt.make_layer(H, 3, window=3, seed=61)
    low, _ = pair(layer)
    ring = edit(make_ring(low.state, 4))
    step = kt.make_step(2, 1, H, pages=3, seed=62)
    tensors = [low.state, low.conv_state, *ring]
    refused(lambda: call(R.replay_decode, low, step, ring=ring), name, tensors)
    fold = (low.state, ring, layer.a_log, layer.dt_bias)
    refused(lambda: R.materialize(*fold, lower_bound=-5.0), name, tensors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_launchers_take_bf16_pools_and_refuse_others(dtype):
    """The kernels' launchers take fp32 and bf16 pools: a bf16 CPU pool passes the dtype
    check and reaches the device check ("must be a CUDA tensor"); an fp16 pool is refused
    naming ``state`` before it. Nothing written either way."""
    T, B = 2, 2
    pages = 1 + B * T
    low, _ = pair(kt.make_layer(H, pages, seed=71))
    low.state = low.state.to(dtype)
    step = kt.make_step(B, T, H, pages=pages, seed=72)
    tensors = [low.state, low.conv_state]
    match = "CUDA" if dtype == torch.bfloat16 else "(float32, bfloat16)"
    refused(lambda: call(kda.decode, low, step), "state", tensors, match)
    single = kt.make_step(B, 1, H, pages=pages, seed=73)
    ring = make_ring(low.state, 4)
    fn = lambda: call(kda.replay_decode, low, single, ring=ring)  # noqa: E731
    refused(fn, "state", tensors + list(ring), match)
    v, kg = torch.zeros(B, H, T, 128), torch.zeros(B, H, T, 256, dtype=torch.bfloat16)
    args = (low.state, step.slots, v, kg, low.a_log, low.dt_bias, step.accepted, step.accepted)
    refused(lambda: kda.recover(*args, lower_bound=-5.0), "state", tensors, match)
    slots = torch.tensor([1], dtype=torch.int32)
    fold = (low.state, ring, low.a_log, low.dt_bias, slots, None, -5.0)
    refused(lambda: launch_fold(*fold), "state", tensors + list(ring), match)
    assert not torch.cuda.is_initialized()
