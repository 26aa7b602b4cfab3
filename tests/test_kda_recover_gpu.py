"""GPU tests of kda.recover (KdaRecover) against kda.reference.recover.

A verify step is recorded with the reference (records poisoned first), then both
``recover`` implementations commit it on copies of the same state pool. Written pages
within 1e-5 of the page's max |ref|, every other page (padding requests' included)
bitwise unchanged; the records of tokens past ``accepted`` are poisoned, so a kernel
that read them would fail.
"""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import POISON, check_state, gate, make_records

from kda import layer as kl
from kda import synthetic as kt

pytestmark = pytest.mark.gpu
LOWER_BOUNDS = (kl.LOWER_BOUND, -2.0, -8.0, None)  # None: the softplus gate


def recorded_step(H, B, T, *, padding=(), seed=0, extra_columns=0, holes=False):
    """A layer, a verify step with ``extra_columns`` more slot columns than T, and the
    step's records made by the reference in record mode."""
    pages = 1 + B * (T + extra_columns) + 3
    layer = kt.make_layer(H, pages, window=T + 2, seed=seed, device="cuda")
    table = 1 + torch.arange(B * (T + extra_columns), dtype=torch.int32).view(B, -1)
    step = kt.make_step(B, T, H, pages=pages, slot_table=table, padding=padding,
                        seed=seed + 1, device="cuda")  # fmt: skip
    if holes:
        # Some tokens' states are not kept (slot 0) while the checkpoint slot and the
        # conv page (column 0) stay live.
        s = step.slots.clone()
        for b in range(B):
            c = int(step.accepted[b]) - 1
            for t in range(T):
                if t not in (0, c) and (b + t) % 3 == 0 and b not in padding:
                    s[b, t] = 0
        step.slots = s
    records = make_records(B, H, T, "cuda")
    kt.run_reference(layer.clone(), step, records=records)
    return layer, step, records


def commit_pages(slots, checkpoint, accepted):
    """Pages a recover writes: slots[b, t] > 0 for t < accepted[b] of live requests."""
    s = slots.cpu().to(torch.int64)
    pages = []
    for b in range(s.shape[0]):
        if s[b, int(checkpoint[b]) - 1] > 0:
            pages += [int(v) for v in s[b, : int(accepted[b])] if v > 0]
    return pages


def poison_past_accepted(records, accepted):
    """NaN into the records of tokens t >= accepted[b] (recover must not use them)."""
    v, kg = records
    for b, n in enumerate(accepted.tolist()):
        v[b, :, n:] = POISON
        kg[b, :, n:] = POISON


def run_recover(H, B, T, accepted, *, padding=(), seed=0, extra_columns=0, holes=False):
    import kda
    from kda import reference

    layer, step, records = recorded_step(H, B, T, padding=padding, seed=seed,
                                         extra_columns=extra_columns, holes=holes)  # fmt: skip
    accepted = torch.as_tensor(accepted, dtype=torch.int32, device="cuda")
    poison_past_accepted(records, accepted)
    before = layer.state.clone()
    ref_state = layer.state.clone()
    args = (step.slots, *records, layer.a_log, layer.dt_bias, accepted, step.accepted)
    lower_bound = LOWER_BOUNDS[seed % len(LOWER_BOUNDS)]  # a constant in the kernel fails
    reference.recover(ref_state, *args, **gate(lower_bound))
    kda.recover(layer.state, *args, **gate(lower_bound))
    torch.cuda.synchronize()
    written = commit_pages(step.slots, step.accepted.cpu(), accepted.cpu())
    check_state(layer.state, ref_state, before, written)
    return written


def _pattern(kind, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "ones":
        return [1] * B
    if kind == "all":
        return [T] * B
    return torch.randint(1, T + 1, (B,), generator=g).tolist()


CASES = [
    # H, B, T, accepted pattern, padding, extra slot columns, holes
    (1, 1, 2, "all", (), 0, False),
    (6, 3, 2, "ones", (1,), 0, False),
    (6, 8, 3, "random", (0, 5), 1, False),
    (12, 5, 4, "all", (), 0, True),
    (2, 16, 5, "random", (3,), 0, True),
    (6, 1, 8, "all", (), 2, False),
    (96, 3, 8, "random", (2,), 0, False),
    (12, 40, 8, "ones", (), 0, True),
    (4, 130, 2, "random", (7, 100), 0, False),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "H{}B{}T{}-{}-p{}-x{}-h{}".format(*c[:4], len(c[4]), *c[5:])
)
def test_recover_matches_reference(case):
    H, B, T, kind, padding, extra, holes = case
    written = run_recover(H, B, T, _pattern(kind, B, T, seed=B + T), padding=padding,
                          seed=H + B, extra_columns=extra, holes=holes)  # fmt: skip
    assert written or len(padding) == B


def test_all_padding_touches_nothing():
    run_recover(6, 3, 4, [4, 2, 1], padding=(0, 1, 2), seed=9)


def test_cuda_graph_replay():
    """Capture one recover in a CUDA graph; replay it on fresh records, counts and state."""
    import kda
    from kda import reference

    H, B, T = 6, 8, 4
    layer, step, records = recorded_step(H, B, T, padding=(2,), seed=11)
    accepted = torch.full((B,), T, dtype=torch.int32, device="cuda")
    checkpoint = step.accepted.clone()
    pool = layer.state.clone()
    args = (step.slots, *records, layer.a_log, layer.dt_bias, accepted, checkpoint)

    kda.recover(pool, *args, lower_bound=kl.LOWER_BOUND)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        kda.recover(pool, *args, lower_bound=kl.LOWER_BOUND)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(7):
        fresh_layer, fresh_step, fresh_records = recorded_step(H, B, T, padding=(2,), seed=20 + i)
        for dst, src in zip(records, fresh_records, strict=True):
            dst.copy_(src)
        counts = _pattern("random", B, T, seed=30 + i)
        accepted.copy_(torch.tensor(counts, dtype=torch.int32))
        checkpoint.copy_(fresh_step.accepted)
        poison_past_accepted(records, accepted)
        pool.copy_(fresh_layer.state)
        ref_state = fresh_layer.state.clone()
        reference.recover(ref_state, *args, lower_bound=kl.LOWER_BOUND)
        graph.replay()
        torch.cuda.synchronize()
        written = commit_pages(step.slots, checkpoint.cpu(), accepted.cpu())
        check_state(pool, ref_state, fresh_layer.state, written)


def test_pdl_waits_for_an_early_releasing_predecessor():
    """KdaRecover with PDL reads everything after griddepcontrol.wait: its predecessor
    releases it first, spins, then writes the records (poisoned before)."""
    from test_kda_kernels_gpu import replay_after_predecessor

    import kda
    from kda import reference

    H, B, T = 6, 8, 4
    layer, step, records = recorded_step(H, B, T, padding=(2,), seed=13)
    accepted = torch.tensor(_pattern("random", B, T, seed=14), dtype=torch.int32, device="cuda")
    poison_past_accepted(records, accepted)
    clean = [r.clone() for r in records]
    pool = layer.state.clone()
    args = (step.slots, *records, layer.a_log, layer.dt_bias, accepted, step.accepted)
    ref_state = layer.state.clone()
    reference.recover(ref_state, *args, lower_bound=-2.0)

    def launch():
        kda.recover(pool, *args, lower_bound=-2.0, pdl=True)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    pool.copy_(layer.state)
    replay_after_predecessor(launch, clean, list(records))
    written = commit_pages(step.slots, step.accepted.cpu(), accepted.cpu())
    check_state(pool, ref_state, layer.state, written)


def test_bad_input_launches_nothing():
    import kda

    layer, step, records = recorded_step(2, 2, 3, seed=3)
    state0 = layer.state.clone()
    bad = torch.tensor([1, 4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="accepted"):
        kda.recover(layer.state, step.slots, *records, layer.a_log, layer.dt_bias, bad,
                    step.accepted, lower_bound=kl.LOWER_BOUND)  # fmt: skip
    with pytest.raises(ValueError, match="kg_records"):
        kda.recover(layer.state, step.slots, records[0], records[1].float(), layer.a_log,
                    layer.dt_bias, step.accepted, step.accepted,
                    lower_bound=kl.LOWER_BOUND)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(layer.state, state0)


@pytest.mark.parametrize("T", [2, 5, 8])
def test_wide_record_then_recover_is_wide_verify_bitwise(T):
    """KdaRecover repeats KdaWide's per-token update call for call (same decay function,
    k^ with the same warp sums, mul then fma), so committing a KdaWide record step gives
    the pages a direct KdaWide verify step writes, bit for bit."""
    import kda

    H, B = 6, 5
    pages = 1 + B * T + 2
    layer = kt.make_layer(H, pages, window=T + 2, seed=40 + T, device="cuda")
    step = kt.make_step(B, T, H, pages=pages, padding=(3,), seed=41 + T, device="cuda")
    counts = _pattern("random", B, T, seed=42 + T)
    counts[0] = T
    direct, recorded = layer.clone(), layer.clone()
    records = make_records(B, H, T, "cuda")

    def step_call(target, records=None):
        kda.decode(
            step.x, target.conv_weight, target.conv_bias, target.conv_state, step.f_a,
            step.beta, target.a_log, target.dt_bias, step.slots, target.state, step.gate,
            target.norm_weight, target.f_b, lower_bound=kl.LOWER_BOUND, scale=kl.SCALE,
            eps=kl.EPS, accepted=step.accepted, records=records, kernel="wide",
        )  # fmt: skip

    step_call(direct)
    step_call(recorded, records)
    accepted = torch.tensor(counts, dtype=torch.int32, device="cuda")
    kda.recover(recorded.state, step.slots, *records, layer.a_log, layer.dt_bias, accepted,
                step.accepted, lower_bound=kl.LOWER_BOUND)  # fmt: skip
    torch.cuda.synchronize()
    written = commit_pages(step.slots, step.accepted.cpu(), counts)
    assert written
    for page in written:
        assert torch.equal(recorded.state[page], direct.state[page]), f"page {page}"
    untouched = [p for p in range(pages) if p not in set(written)]
    assert torch.equal(recorded.state[untouched], layer.state[untouched])
