"""GPU tests of the kernels on bf16 state pages against ``kda.reference`` on the same bf16
pool (docs/contract.md "bf16 state pages").

The tolerance on a stored bf16 page: the reference's page is its fp32 value ``pre`` rounded
once (``pre`` comes from the reference run on an fp32 copy of the pool: within a step
nothing else is rounded, so it is the bf16 run's value before its store). The kernel's fp32
value lies within the fp32 tests' state tolerance (1e-5 of the page's max) of ``pre``, and
rounding is monotone, so its stored bf16 lies in ``[bf16(pre - tol), bf16(pre + tol)]``:
bitwise the reference's except where ``pre`` is within ``tol`` of a rounding midpoint, one
bf16 ulp there. Outputs, conv pages, records and ring entries as the fp32 tests check them
(both sides read the same bf16 pages). Unquantised inputs, gate mode 3 (the default).
"""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import (
    POISON,
    SCALARS,
    call_kernel,
    check_output,
    check_records,
    make_records,
    reference,
    replay_after_predecessor,
    small_rows,
    written_pages,
)

from kda import synthetic as kt

pytestmark = pytest.mark.gpu
STATE_TOL = 1e-5  # the fp32 tests' state tolerance, of the page's max


def to_bf16(layer):
    """``layer`` with its state pool as bf16 pages (rounded once here)."""
    layer.state = layer.state.to(torch.bfloat16)
    return layer


def widened(layer):
    """A copy of ``layer`` with an fp32 pool holding the bf16 pages widened (exact)."""
    copy = layer.clone()
    copy.state = layer.state.float()
    return copy


def check_bf16_pages(got, want, pre, before, pages, tol=STATE_TOL):
    """bf16 pages ``pages`` of ``got``: the reference's (``want``: ``pre`` rounded once)
    bitwise, or within the rounding of ``pre +- tol * max|pre|`` (module docstring); every
    other page bitwise ``before``. Returns the fraction of written elements not bitwise."""
    assert got.dtype == want.dtype == torch.bfloat16 and pre.dtype == torch.float32
    pages = sorted(set(int(p) for p in pages))
    flipped, total = 0, 0
    for p in pages:
        assert torch.equal(want[p], pre[p].to(torch.bfloat16)), "the reference's one rounding"
        margin = tol * pre[p].abs().max()
        low = (pre[p] - margin).to(torch.bfloat16).float()
        high = (pre[p] + margin).to(torch.bfloat16).float()
        g = got[p].float()
        bad = ~((g >= low) & (g <= high))
        assert not bad.any(), (
            f"state page {p}: {int(bad.sum())} elements beyond the rounding of the "
            f"reference's fp32 +- {margin:.3g}; first at {bad.nonzero()[0].tolist()}"
        )
        flipped += int((got[p] != want[p]).sum())
        total += got[p].numel()
    other = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    if pages:
        other[torch.tensor(pages, device=got.device)] = False
    assert torch.equal(got[other], before[other]), "state pages outside the step changed"
    fraction = flipped / max(total, 1)
    print(f"  bf16 pages: {fraction:.2e} of written elements 1 ulp off the reference's")
    return fraction


def run_case(H, B, T, *, dim_first, padding, kernel, cluster=None, record=False, holes=False,
             seed=0):  # fmt: skip
    """One step on bf16 pages, kernel against the reference (and the fp32 ``pre``)."""
    pages = 1 + B * T + 4
    scalars = SCALARS[seed % len(SCALARS)]
    layer = kt.make_layer(H, pages, window=T + 2 + seed % 3, conv_dim_first=dim_first,
                          seed=seed, device="cuda")  # fmt: skip
    step = kt.make_step(B, T, H, pages=pages, padding=padding, seed=seed + 1, device="cuda")
    small_rows(layer, step)
    to_bf16(layer)
    if holes and T > 1:  # a token whose state is not kept
        s = step.slots.clone()
        for b in range(B):
            if int(step.accepted[b]) < T and b not in padding:
                s[b, T - 1] = 0
        step.slots = s
    want, wide, before = layer.clone(), widened(layer), layer.state.clone()
    ref_records = make_records(B, H, T, "cuda") if record else None
    got_records = make_records(B, H, T, "cuda") if record else None
    ref, o32 = reference(want, step, records=ref_records, scalars=scalars)
    reference(wide, step, records=make_records(B, H, T, "cuda") if record else None,
              scalars=scalars)  # fmt: skip
    got = call_kernel(layer, step, kernel, records=got_records, cluster=cluster, scalars=scalars)
    torch.cuda.synchronize()
    check_bf16_pages(layer.state, want.state, wide.state, before, written_pages(step, ref_records))
    assert torch.equal(layer.conv_state, want.conv_state), "conv pages differ"
    if record:
        check_records(step, B, ref_records, got_records)
    check_output(got, ref, H, o32)


EVERY = [
    ("wide", None), ("stream", None), ("pipe", None), ("split", 2), ("split", 4), ("split", 8)
]  # fmt: skip
EVERY_IDS = ["wide", "stream", "pipe", "split2", "split4", "split8"]
CASES = [
    # H, B, T, dim_first, padding, record, holes
    (7, 33, 1, True, (0, 5), False, False),
    (5, 20, 3, False, (2,), False, True),
    (3, 17, 4, True, (), True, False),
    (9, 12, 2, False, (11,), False, False),
]


@pytest.mark.parametrize("kernel,cluster", EVERY, ids=EVERY_IDS)
@pytest.mark.parametrize("seed,case", list(enumerate(CASES)),
                         ids=["H{}B{}T{}".format(*c[:3]) for c in CASES])  # fmt: skip
def test_bf16_decode_matches_reference(kernel, cluster, seed, case):
    H, B, T, dim_first, padding, record, holes = case
    record = record and kernel != "pipe"  # KdaPipe has no record mode: the step alone
    run_case(H, B, T, dim_first=dim_first, padding=padding, kernel=kernel, cluster=cluster,
             record=record, holes=holes, seed=seed)  # fmt: skip


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("dim_first", [True, False], ids=["df", "wf"])
def test_bf16_pipe_many_items_per_cta(T, dim_first):
    """KdaPipe on bf16 pages with ~12 items per CTA (H 12, B 130 on an H200: every one of
    its four 32 KB stages re-staged several times), padded rows among them."""
    run_case(12, 130, T, dim_first=dim_first, padding=(0, 7, 129), kernel="pipe", seed=T)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("dim_first", [True, False], ids=["df", "wf"])
def test_bf16_model_scale_auto(T, dim_first):
    """H 96, B 64 (6144 items: KdaPipe at T 1, KdaStream at T 4 on an H200), the
    dispatcher's choice."""
    run_case(96, 64, T, dim_first=dim_first, padding=(3, 40), kernel="auto", seed=T)


@pytest.mark.parametrize("kernel,cluster", EVERY, ids=EVERY_IDS)
def test_bf16_cuda_graph_replay(kernel, cluster):
    """One verify step captured in a CUDA graph on bf16 pages, replayed with new inputs."""
    H, B, T, pages = 11, 16, 2, 40
    scalars = SCALARS[1]
    layer = to_bf16(kt.make_layer(H, pages, window=6, seed=5, device="cuda"))
    step = kt.make_step(B, T, H, pages=pages, padding=(2,), seed=6, device="cuda")
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16, device="cuda")
    start = layer.clone()

    def launch():
        call_kernel(layer, step, kernel, cluster=cluster, scalars=scalars, out=out)

    launch()  # compile outside the capture
    layer.state.copy_(start.state)
    layer.conv_state.copy_(start.conv_state)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(5):
        fresh = kt.make_step(B, T, H, pages=pages, padding=(2,), seed=20 + i, device="cuda")
        for name in ("x", "f_a", "beta", "gate", "accepted"):
            getattr(step, name).copy_(getattr(fresh, name))
        want, wide, before = layer.clone(), widened(layer), layer.state.clone()
        out.fill_(POISON)
        graph.replay()
        ref, o32 = reference(want, step, scalars=scalars)
        reference(wide, step, scalars=scalars)
        torch.cuda.synchronize()
        check_bf16_pages(layer.state, want.state, wide.state, before, written_pages(step, None))
        assert torch.equal(layer.conv_state, want.conv_state)
        check_output(out, ref, H, o32)
        layer.state.copy_(want.state)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kernel,cluster", EVERY, ids=EVERY_IDS)
def test_bf16_pdl_waits_for_an_early_releasing_predecessor(kernel, cluster, T):
    """PDL behind a predecessor that writes x, f_a, beta and gate late, on bf16 pages."""
    import pdl_predecessor

    H, B = 13, 40
    pages = 1 + B * T + 2
    scalars = SCALARS[2]
    layer = to_bf16(kt.make_layer(H, pages, window=T + 3, seed=7, device="cuda"))
    step = kt.make_step(B, T, H, pages=pages, padding=(4,), seed=8, device="cuda")
    names = ("x", "f_a", "beta", "gate")
    clean = [getattr(step, n).clone() for n in names]
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16, device="cuda")
    start, want, wide = layer.clone(), layer.clone(), widened(layer)
    ref, o32 = reference(want, step, scalars=scalars)
    reference(wide, step, scalars=scalars)

    def launch():
        call_kernel(layer, step, kernel, cluster=cluster, pdl=True, scalars=scalars, out=out)

    pdl_predecessor.run([(clean[0], step.x)], spin_ns=100_000)  # compile both
    launch()
    torch.cuda.synchronize()
    layer.state.copy_(start.state)
    layer.conv_state.copy_(start.conv_state)
    out.fill_(POISON)
    replay_after_predecessor(launch, clean, [getattr(step, n) for n in names])
    check_bf16_pages(layer.state, want.state, wide.state, start.state, written_pages(step, None))
    assert torch.equal(layer.conv_state, want.conv_state), "conv pages differ"
    check_output(out, ref, H, o32)
