"""GPU tests of kda.decode (KdaWide, KdaStream, KdaPipe, KdaSplit) against kda.reference.decode.

Outputs are poisoned before each launch; outputs must be within 1 bf16 ulp in the
SPEC's sense (one ulp of ``o`` more only where the reference's fp32 ``o`` lies within its
dot's error bound of a bf16 midpoint), state pages within 1e-5 of the page's max |ref|,
conv pages bitwise equal to the reference's, state pages not written by the step bitwise
unchanged. ``lower_bound``, ``scale`` and ``eps`` vary (``SCALARS``, by seed) on layers with
small-rms rows, and so does the gate's form: ``lower_bound`` None is the softplus gate
(Kimi-Linear's), whose layers get dt_bias values past softplus's threshold and far below
(``kt.extreme_dt_bias``). The conv window is T + 2 + seed % 3 wide. PDL runs right after an
early-releasing predecessor kernel (``tests/pdl_predecessor.py``) that writes the step's
inputs late. Each case prints its fraction of outputs at exactly 0 ulp (``-s``).
"""

from __future__ import annotations

import pytest
import torch

from kda import layer as kl
from kda import synthetic as kt

pytestmark = pytest.mark.gpu

POISON = float("nan")
# "Near a bf16 midpoint": within the fp32 dot's error bound. A summation order's error
# relative to 2^-24 sum|S q| measured at most 1.8 (4-lane tree) and 5.0 (sequential) over
# 4e5 random heads; any order is below 127. 16 keeps the allowance to ~0.5% of elements.
NEAR_FACTOR = 16
NEAR_ULPS = 4
# (lower_bound, scale, eps): the model's, and values a constant in a kernel cannot match;
# eps = 2e-3 dominates mean(o^2) of the small-rms rows (``small_rows``); lower_bound None:
# the softplus gate (``gate``).
SCALARS = [
    (kl.LOWER_BOUND, kl.SCALE, kl.EPS),
    (-2.0, 0.3, 2e-3),
    (-8.0, 0.05, 5e-4),
    (None, 0.2, 1e-3),
]


def gate(lower_bound):
    """The KDA entries' gate keywords of a ``SCALARS`` bound: None is the softplus gate."""
    form = "softplus" if lower_bound is None else "lower-bound"
    return dict(lower_bound=lower_bound, gate_form=form)


def bf16_ulp(ref):
    """One bf16 ulp of each element of ``ref`` (fp32 tensor)."""
    mag = ref.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def o_error_bound(o32, o_abs, factor=NEAR_FACTOR):
    """How far another fp32 summation order may move ``o``: ``factor`` fp32 units of
    ``sum_k |S[r, k] q^[k]|``, at least ``NEAR_ULPS`` ulps of ``o``."""
    ulp = torch.exp2(torch.floor(torch.log2(o32.abs().clamp_min(2.0**-126))) - 23)
    return torch.maximum(o_abs * factor * 2.0**-24, ulp * NEAR_ULPS)


def near_bf16_midpoint(o32, o_abs, factor=NEAR_FACTOR):
    """Where the fp32 ``o`` lies within its dot product's error bound of a bf16 rounding
    midpoint: there another fp32 summation order than the reference's may round ``o`` the
    other way (SPEC, "Intermediate bf16 roundings"). The bound is ``factor`` fp32 units of
    ``sum_k |S[r, k] q^[k]|`` (``o_abs``), at least ``NEAR_ULPS`` ulps of ``o``."""
    bits = o32.contiguous().view(torch.int32)
    mid = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # the midpoint above |o|'s bf16
    return (o32 - mid).abs() <= o_error_bound(o32, o_abs, factor)


def check_output(got, ref, heads, o32):
    """SPEC: |ref| >= 2^-10 rms(row) -> within 1 ulp; else within 2^-17 rms(row); rows
    are a head's 128 channels. Only where the reference's fp32 ``o`` (``o32``, from
    ``kda.reference.decode(..., o_fp32=)``) lies within a few fp32 ulps of a bf16 midpoint
    may ``o`` round the other way: there one ulp of ``o`` carried through the gated norm
    (2^-7 of the value) and the two sides' roundings are allowed on top, small elements too.
    ``o32``: (fp32 o, sum |S q|) from ``reference``.
    Returns the fraction of elements exactly equal."""
    g = got.float().view(got.shape[0], heads, 128)
    r = ref.float().view(ref.shape[0], heads, 128)
    near = near_bf16_midpoint(*o32).view(r.shape)
    # Where o may round the other way, bf16 o moves by one of its ulps plus twice the fp32
    # bound (a cancelling sum's bound can exceed the ulp): that fraction of o, carried
    # through the gated norm, is the output's extra allowance.
    o_val, o_abs = (t.view(r.shape) for t in o32)
    moved = bf16_ulp(o_val) + 2 * o_error_bound(o_val, o_abs)
    rel = torch.maximum(moved / o_val.abs().clamp_min(2.0**-126), torch.full_like(r, 2.0**-7))
    assert not torch.isnan(g).any(), "NaN in output (poison not overwritten?)"
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    err = (g - r).abs()
    big = r.abs() >= rms * 2.0**-10
    # A moved o moves the exact output by <= rel of it; both sides then round (<= 1 ulp
    # together), on top of the fp32 noise the small-element rule already allows.
    flip = torch.where(near, r.abs() * rel * 1.01, torch.zeros_like(r))
    small = rms * 2.0**-17 + torch.where(near, bf16_ulp(r), torch.zeros_like(r))
    ok = torch.where(big, err <= bf16_ulp(r) + flip, err <= small + flip)
    exact = (err == 0).float().mean().item()
    worst = (err / bf16_ulp(r))[big].max().item() if big.any() else 0.0
    bad = (~ok).nonzero()[:4].tolist()
    detail = [(i, float(r[tuple(i)]), float(g[tuple(i)]), float(rms[i[0], i[1], 0]),
               bool(near[tuple(i)])) for i in bad]  # fmt: skip
    assert not bad, f"max {worst:.1f} ulp; beyond the bound (index, ref, got, rms, near): {detail}"
    print(f"  outputs: exact {exact:.5f}, max {worst:.2f} ulp, near a midpoint "
          f"{near.float().mean().item():.5f}")  # fmt: skip
    return exact


def check_state(got, ref, before, pages):
    """Pages in ``pages`` within 1e-5 x max|ref| per page; every other page bitwise equal
    to ``before``."""
    pages = sorted(set(int(p) for p in pages))
    for p in pages:
        scale = ref[p].abs().max().item()
        err = (got[p] - ref[p]).abs().max().item()
        assert err <= 1e-5 * scale, f"state page {p}: max err {err:.3g} vs max |ref| {scale:.3g}"
    other = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    if pages:
        other[torch.tensor(pages, device=got.device)] = False
    assert torch.equal(got[other], before[other]), "state pages outside the step changed"


def written_pages(step, records):
    """State pages a step writes (kernel and reference agree on this set)."""
    if records is not None:
        return []
    s = step.slots.cpu().to(torch.int64)
    B = s.shape[0]
    if s.dim() == 1:
        return [int(v) for v in s if v > 0]
    T = step.x.shape[0] // B
    offset = step.accepted.cpu().to(torch.int64) - 1
    pages = []
    for b in range(B):
        if s[b, offset[b]] > 0:
            pages += [int(v) for v in s[b, :T] if v > 0]
    return pages


def call_kernel(layer, step, kernel, records=None, gate_mode=3, pdl=False, cluster=None,
                scalars=SCALARS[0], out=None):  # fmt: skip
    """``kda.decode`` on a layer and a step into a poisoned (or the given) output;
    ``gate_mode=None`` leaves ``kda.decode``'s default."""
    import kda

    rows, dim = step.x.shape[0], layer.heads * 128
    if out is None:
        out = torch.full((rows, dim), POISON, dtype=torch.bfloat16, device=step.x.device)
    lower_bound, scale, eps = scalars
    kda.decode(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, **gate(lower_bound), scale=scale, eps=eps,
        accepted=step.accepted, conv_dim_first=layer.conv_dim_first, records=records,
        kernel=kernel, cluster=cluster, pdl=pdl, out=out,
        **({} if gate_mode is None else {"gate_mode": gate_mode}),
    )  # fmt: skip
    return out


def reference(layer, step, records=None, scalars=SCALARS[0], raw_gate=None):
    """``kt.run_reference`` with ``scalars`` (and ``raw_gate``: a kernel's own raw gate fed
    in place of the dot); returns (output, (fp32 o, sum |S q|))."""
    o32 = torch.zeros(step.x.shape[0], layer.heads * 128, device=step.x.device)
    o_abs = torch.zeros_like(o32)
    lower_bound, scale, eps = scalars
    out = kt.run_reference(layer, step, records=records, **gate(lower_bound), scale=scale,
                           eps=eps, o_fp32=o32, o_abs=o_abs, raw_gate=raw_gate)  # fmt: skip
    return out, (o32, o_abs)


def small_rows(layer, step, every=3):
    """Scale the state pages of every ``every``-th request (from request 1) by 2^-10: their
    ``o`` has mean(o^2) ~ 1e-9, where the norm's ``eps`` decides the output."""
    s = step.slots.view(step.slots.shape[0], -1)
    for b in range(1, s.shape[0], every):
        for page in s[b].tolist():
            if page > 0:
                layer.state[page] *= 2.0**-10


def make_records(B, H, T, device):
    v = torch.full((B, H, T, 128), POISON, dtype=torch.float32, device=device)
    kg = torch.full((B, H, T, 256), POISON, dtype=torch.bfloat16, device=device)
    return v, kg


def quantize_gate_inputs(layer, step):
    """f_a on a 1/8 grid in [-4, 4], f_b on a 1/64 grid: every partial sum of f_a . f_b
    is a multiple of 2^-9 below 2^8, exact in fp32, so mma.sync's order gives the
    reference's raw gate bit for bit and the gate_mode tests see the fragment mapping."""
    step.f_a = ((step.f_a.float() * 8).round().clamp(-32, 32) / 8).to(torch.bfloat16)
    layer.f_b = ((layer.f_b.float() * 64).round() / 64).to(torch.bfloat16)


def check_records(step, B, ref_records, got_records):
    """Live requests' records as the reference's (v_new 1e-5, raw gate bitwise, k 1 ulp);
    padding requests' records still poison."""
    live = step.slots.view(B, -1)[torch.arange(B), step.accepted.long() - 1] > 0
    rv, rkg = ref_records
    gv, gkg = got_records
    assert torch.isnan(gv[~live]).all() and torch.isnan(gkg[~live].float()).all()
    rv, gv = rv[live], gv[live]
    scale = rv.abs().amax(dim=(-1, -2), keepdim=True)
    assert ((gv - rv).abs() <= 1e-5 * scale).all(), "v_records differ"
    # raw gate: the exact dot in every gate mode here -> bitwise; k (SiLU): 1 ulp.
    assert torch.equal(gkg[live][..., 128:], rkg[live][..., 128:]), "raw-gate records"
    k_ref, k_got = rkg[live][..., :128].float(), gkg[live][..., :128].float()
    k_err = (k_got - k_ref).abs()
    assert (k_err <= bf16_ulp(k_ref)).all(), "k records beyond 1 bf16 ulp"
    print(f"k records exact fraction {(k_err == 0).float().mean().item():.6f}")


def run_case(H, B, T, *, dim_first, bias, record, padding, kernel, gate_mode=0,
             conv_dtype=torch.bfloat16, seed=0, holes=False, cluster=None,
             scalars=None):  # fmt: skip
    """One step, kernel against reference. The conv window is ``T + 2 + seed % 3`` wide (so
    positions past T + 1 exist and must stay untouched); ``scalars`` defaults to
    ``SCALARS[seed % 4]`` (4: the softplus gate, with extreme dt_bias values); requests 1,
    4, ... have small-rms rows."""
    device = "cuda"
    pages = 1 + B * T + 4
    scalars = SCALARS[seed % len(SCALARS)] if scalars is None else scalars
    layer = kt.make_layer(H, pages, window=T + 2 + (seed % 3), conv_dim_first=dim_first,
                          bias=bias, conv_dtype=conv_dtype, seed=seed, device=device)  # fmt: skip
    step = kt.make_step(B, T, H, pages=pages, padding=padding, seed=seed + 1, device=device)
    small_rows(layer, step)
    if scalars[0] is None:
        kt.extreme_dt_bias(layer, seed)
    if gate_mode in (0, 1):  # the seed orders on unquantised inputs: test_kda_gate_gpu.py
        quantize_gate_inputs(layer, step)
    if holes and T > 1:
        # A token whose state is not kept: the last slot of requests that accept < T.
        s = step.slots.clone()
        for b in range(B):
            if int(step.accepted[b]) < T and b not in padding:
                s[b, T - 1] = 0
        step.slots = s
    ref_layer = layer.clone()
    before = layer.state.clone()
    ref_records = make_records(B, H, T, device) if record else None
    got_records = make_records(B, H, T, device) if record else None
    ref, o32 = reference(ref_layer, step, records=ref_records, scalars=scalars)
    conv_before = layer.conv_state.clone()
    try:
        got = call_kernel(layer, step, kernel, records=got_records, gate_mode=gate_mode,
                          cluster=cluster, scalars=scalars)  # fmt: skip
    except ValueError as e:  # a window past KdaStream's shared memory: refused, untouched
        if kernel not in ("stream", "pipe") or "shared memory" not in str(e):
            raise
        assert torch.equal(layer.state, before) and torch.equal(layer.conv_state, conv_before)
        print(f"H{H} B{B} T{T} stream: refused ({e})")
        return None
    torch.cuda.synchronize()
    check_state(layer.state, ref_layer.state, before, written_pages(step, ref_records))
    assert torch.equal(layer.conv_state, ref_layer.conv_state), "conv pages differ"
    if record:
        check_records(step, B, ref_records, got_records)
    exact = check_output(got, ref, H, o32)  # last: the state, conv and record checks ran
    label = kernel if cluster is None else f"{kernel} C{cluster}"
    print(f"H{H} B{B} T{T} {label}: outputs at 0 ulp {exact:.4%}")
    return exact


CASES = [
    # H, B, T, dim_first, bias, record, padding, gate_mode, conv dtype, holes
    (1, 1, 1, True, True, False, (), 3, torch.bfloat16, False),
    (6, 3, 2, False, False, True, (1,), 3, torch.bfloat16, False),
    (12, 64, 5, True, True, False, (0, 63), 3, torch.float32, True),
    (96, 130, 8, False, True, False, (5,), 3, torch.bfloat16, True),
    (96, 130, 1, True, False, False, (7, 100), 3, torch.bfloat16, False),
    (6, 130, 8, True, True, True, (3,), 3, torch.float32, False),
    (12, 3, 1, False, True, False, (), 3, torch.float32, False),
    (1, 64, 2, True, False, False, (), 3, torch.bfloat16, True),
    (96, 1, 5, False, False, True, (), 3, torch.bfloat16, False),
    (12, 130, 2, False, True, False, (0,), 3, torch.bfloat16, True),
    # The seed's mma.sync gate orders, on gate inputs whose dot is exact in any order.
    (6, 64, 1, True, True, False, (9,), 0, torch.bfloat16, False),
    (12, 130, 4, False, False, True, (2,), 1, torch.bfloat16, False),
    (96, 3, 8, True, True, False, (), 0, torch.float32, True),
    (1, 130, 3, False, True, False, (1,), 1, torch.bfloat16, True),
    # The default gate (mode 3, bounded mma + exact recompute) on unquantised inputs: the
    # raw gate records bitwise the reference's (check_records), state within 1e-5.
    (96, 130, 1, True, True, False, (7,), 3, torch.bfloat16, False),
    (96, 130, 4, False, True, True, (5,), 3, torch.bfloat16, False),
    (12, 64, 8, True, False, True, (0,), 3, torch.float32, False),
    (6, 130, 2, False, True, False, (3,), 3, torch.bfloat16, True),
    # T = 6, 7 (with 2..5 and 8 above: every verify length), several items per stream CTA.
    (12, 130, 6, True, True, True, (4, 129), 3, torch.bfloat16, False),
    (12, 130, 7, False, False, False, (0,), 3, torch.bfloat16, True),
    (6, 130, 6, False, True, False, (), 3, torch.float32, False),
    (6, 130, 7, True, False, True, (2,), 3, torch.bfloat16, False),
]
KERNELS = ["wide", "stream", "pipe"]
# (kernel, cluster) for the tests that every kernel must pass (KdaSplit at each cluster size)
EVERY_KERNEL = [
    ("wide", None), ("stream", None), ("pipe", None), ("split", 2), ("split", 4), ("split", 8)
]  # fmt: skip
EVERY_KERNEL_IDS = ["wide", "stream", "pipe", "split2", "split4", "split8"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "seed,case",
    list(enumerate(CASES)),
    ids=["s{}-H{}B{}T{}-{}-b{}-r{}".format(i, *c[:3], "df" if c[3] else "wf", int(c[4]),
                                           int(c[5])) for i, c in enumerate(CASES)],
)  # fmt: skip
def test_decode_matches_reference(kernel, seed, case):
    """The case's index is its seed: window T + 2 + seed % 3, scalars SCALARS[seed % 4]
    (seeds 3, 7, ...: the softplus gate)."""
    H, B, T, dim_first, bias, record, padding, gate_mode, conv_dtype, holes = case
    record = record and kernel != "pipe"  # KdaPipe has no record mode: the step alone
    run_case(H, B, T, dim_first=dim_first, bias=bias, record=record, padding=padding,
             kernel=kernel, gate_mode=gate_mode, conv_dtype=conv_dtype, holes=holes,
             seed=seed)  # fmt: skip


@pytest.mark.parametrize("kernel,cluster", EVERY_KERNEL, ids=EVERY_KERNEL_IDS)
def test_steps_in_a_row(kernel, cluster):
    """Three decode steps then two verify steps on the same pools, kernel vs reference,
    the scalars changing from step to step."""
    H, B, pages = 6, 8, 40
    layer = kt.make_layer(H, pages, window=8, seed=3, device="cuda")
    ref_layer = layer.clone()
    for i in range(5):
        T = 1 if i < 3 else 3
        scalars = SCALARS[i % len(SCALARS)]
        table = (1 + torch.arange(B * T, dtype=torch.int32).view(B, T)) % pages
        step = kt.make_step(B, T, H, pages=pages, slot_table=table, padding=(i % B,),
                            seed=10 + i, device="cuda")  # fmt: skip
        before = layer.state.clone()
        ref, o32 = reference(ref_layer, step, scalars=scalars)
        got = call_kernel(layer, step, kernel, cluster=cluster, scalars=scalars)
        check_state(layer.state, ref_layer.state, before, written_pages(step, None))
        assert torch.equal(layer.conv_state, ref_layer.conv_state)
        check_output(got, ref, H, o32)
        layer.state.copy_(ref_layer.state)  # the next step starts from the same state


@pytest.mark.parametrize("kernel,cluster", EVERY_KERNEL, ids=EVERY_KERNEL_IDS)
def test_cuda_graph_replay(kernel, cluster):
    """Capture one step in a CUDA graph, replay it with new inputs many times."""
    H, B, T, pages = 12, 16, 2, 40
    scalars = SCALARS[1]
    layer = kt.make_layer(H, pages, window=6, seed=5, device="cuda")
    step = kt.make_step(B, T, H, pages=pages, padding=(2,), seed=6, device="cuda")
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16, device="cuda")
    ref_layer = layer.clone()

    def launch():
        call_kernel(layer, step, kernel, cluster=cluster, scalars=scalars, out=out)

    launch()  # compile outside the capture
    layer.state.copy_(ref_layer.state)
    layer.conv_state.copy_(ref_layer.conv_state)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(7):
        fresh = kt.make_step(B, T, H, pages=pages, padding=(2,), seed=20 + i, device="cuda")
        for name in ("x", "f_a", "beta", "gate", "accepted"):
            getattr(step, name).copy_(getattr(fresh, name))
        before = layer.state.clone()
        out.fill_(POISON)
        graph.replay()
        ref, o32 = reference(ref_layer, step, scalars=scalars)
        torch.cuda.synchronize()
        check_state(layer.state, ref_layer.state, before, written_pages(step, None))
        assert torch.equal(layer.conv_state, ref_layer.conv_state)
        check_output(out, ref, H, o32)
        layer.state.copy_(ref_layer.state)


# What a decode step's predecessor may write (the kernels read everything else, the state
# and conv pages, slots and weights, before griddepcontrol.wait: kda.kernels.wide's contract).
PDL_INPUTS = ("x", "f_a", "beta", "gate")
SPIN_NS = 100_000


def replay_after_predecessor(launch, sources, targets):
    """Capture ``predecessor (sources -> targets), launch()`` in a CUDA graph (PDL edges
    are kept; no host work between the two launches), poison ``targets`` and replay once.
    The predecessor releases its dependents first and writes ``targets`` only after a
    ``SPIN_NS`` spin: a dependent that reads them before its griddepcontrol.wait reads
    poison."""
    import pdl_predecessor

    def both():
        pdl_predecessor.run(list(zip(sources, targets, strict=True)), spin_ns=SPIN_NS)
        launch()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        both()
    torch.cuda.current_stream().wait_stream(stream)
    for t in targets:
        t.view(torch.int16 if t.element_size() == 2 else torch.int32).fill_(-1)  # NaN / -1
    graph.replay()
    torch.cuda.synchronize()
    return graph


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kernel,cluster", EVERY_KERNEL, ids=EVERY_KERNEL_IDS)
def test_pdl_waits_for_an_early_releasing_predecessor(kernel, cluster, T):
    """With PDL the step starts while its predecessor spins (the predecessor released it
    first) and must wait for the predecessor's writes of x, f_a, beta and gate (poisoned
    before): outputs, state and conv pages as the reference's on the clean inputs."""
    import pdl_predecessor

    H, B = 12, 40
    pages = 1 + B * T + 2
    scalars = SCALARS[2]
    layer = kt.make_layer(H, pages, window=T + 3, seed=7, device="cuda")
    step = kt.make_step(B, T, H, pages=pages, padding=(4,), seed=8, device="cuda")
    clean = [getattr(step, n).clone() for n in PDL_INPUTS]
    out = torch.empty(B * T, H * 128, dtype=torch.bfloat16, device="cuda")
    start = layer.clone()
    ref_layer = layer.clone()
    ref, o32 = reference(ref_layer, step, scalars=scalars)

    def launch():
        call_kernel(layer, step, kernel, cluster=cluster, pdl=True, scalars=scalars, out=out)

    pdl_predecessor.run([(clean[0], step.x)], spin_ns=SPIN_NS)  # compile both
    launch()
    torch.cuda.synchronize()
    layer.state.copy_(start.state)
    layer.conv_state.copy_(start.conv_state)
    out.fill_(POISON)
    replay_after_predecessor(launch, clean, [getattr(step, n) for n in PDL_INPUTS])
    check_state(layer.state, ref_layer.state, start.state, written_pages(step, None))
    assert torch.equal(layer.conv_state, ref_layer.conv_state), "conv pages differ"
    check_output(out, ref, H, o32)


def _misaligned(t):
    """A contiguous copy of ``t`` starting 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    view = flat[1 : 1 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


HOST_BAD = [  # message, change of kda.decode's keyword arguments
    (r"out must be a contiguous \[4, 256\] bf16", lambda k: k.update(out=k["out"].float())),
    (r"out must be a contiguous", lambda k: k.update(out=k["out"][:3])),
    (r"out must be a contiguous", lambda k: k.update(out=torch.empty(256, 8, dtype=torch.bfloat16,
                                                     device="cuda").t())),
    ("x must be 16-byte aligned", lambda k: k.update(x=_misaligned(k["x"]))),
    ("gate must be 16-byte aligned", lambda k: k.update(gate=_misaligned(k["gate"]))),
    ("f_a must be 16-byte aligned", lambda k: k.update(f_a=_misaligned(k["f_a"]))),
    ("out must be 16-byte aligned", lambda k: k.update(out=_misaligned(k["out"]))),
    ("kernel must be one of", lambda k: k.update(kernel="fast")),
    ("cluster must be None or one of", lambda k: k.update(kernel="wide", cluster=2)),
    ("cluster must be None or one of", lambda k: k.update(kernel="split", cluster=3)),
    ("gate_mode must be 0, 1 or 3", lambda k: k.update(gate_mode=4)),
    ("gate_mode must be 0, 1 or 3", lambda k: k.update(gate_mode=2)),
    (r"accepted\[0\] = 3 is outside", lambda k: k["accepted"].__setitem__(0, 3)),
    ("past the state pool", lambda k: k["slots"].__setitem__((1, 1), 99)),
]  # fmt: skip


@pytest.mark.parametrize("message,change", HOST_BAD, ids=[str(i) for i in range(len(HOST_BAD))])
def test_bad_input_launches_nothing(message, change):
    """Each refusal of kda.decode's host entry, reached by its own input: ValueError
    before any launch, nothing written (out stays poisoned)."""
    import kda

    layer = kt.make_layer(2, 8, seed=1, device="cuda")
    step = kt.make_step(2, 2, 2, pages=8, seed=2, device="cuda")
    out = torch.full((4, 256), POISON, dtype=torch.bfloat16, device="cuda")
    kw = dict(x=step.x, conv_weight=layer.conv_weight, conv_bias=layer.conv_bias,
              conv_state=layer.conv_state, f_a=step.f_a, beta=step.beta, a_log=layer.a_log,
              dt_bias=layer.dt_bias, slots=step.slots.clone(), state=layer.state,
              gate=step.gate, norm_weight=layer.norm_weight, f_b=layer.f_b,
              lower_bound=kl.LOWER_BOUND, scale=kl.SCALE, eps=kl.EPS,
              accepted=step.accepted.clone(), out=out)  # fmt: skip
    kda.decode(**kw)  # valid as given
    torch.cuda.synchronize()
    out.fill_(POISON)
    change(kw)
    state0, conv0 = layer.state.clone(), layer.conv_state.clone()
    with pytest.raises(ValueError, match=message):
        kda.decode(**kw)
    torch.cuda.synchronize()
    assert torch.equal(layer.state, state0) and torch.equal(layer.conv_state, conv0)
    assert torch.isnan(out.float()).all()
