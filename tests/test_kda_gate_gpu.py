"""GPU tests of the raw gate's modes on unquantised random inputs (f_a at several scales,
model-sized heads), with test_kda_kernels_gpu's helpers and tolerances.

- The default gate (``kda.decode`` without ``gate_mode``: mode 3, the mma.sync chain with
  an error bound and an exact recompute where the bound leaves the bf16 rounding open)
  gives the reference's raw gate bit for bit (record mode's ``kg_records``), records,
  outputs and state within the per-step tolerances.
- The seed's orders (modes 0, 1) give a raw gate within 1 bf16 ulp of the exact dot (the
  SPEC's rule, a head's 128 features a row); the rest of the step, record mode and plain,
  matches the reference fed with the kernel's own raw gate (``raw_gate=``).
"""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import (
    EVERY_KERNEL,
    EVERY_KERNEL_IDS,
    SCALARS,
    bf16_ulp,
    call_kernel,
    check_output,
    check_records,
    check_state,
    make_records,
    reference,
    small_rows,
    written_pages,
)

from kda import synthetic as kt

pytestmark = pytest.mark.gpu

# The kernels with record mode (the raw gates are read from the records): KdaPipe has
# none; its raw gates are the reference's through test_kda_kernels_gpu's plain steps.
RECORDING = [kc for kc in EVERY_KERNEL if kc[0] != "pipe"]
RECORDING_IDS = [i for kc, i in zip(EVERY_KERNEL, EVERY_KERNEL_IDS, strict=True) if kc[0] != "pipe"]

# f_a scales: the raw gate's rms is ~ the scale (f_b rows have norm ~ 1).
FA_SCALES = (1.0, 0.03, 9.0)


def sizes(kernel):
    """(heads, requests): model-sized for the per-item kernels, few requests for KdaSplit."""
    return (96, 48) if kernel in ("wide", "stream") else (12, 4)


def gate_inputs(H, B, T, seed, fa_scale):
    """A layer and a step with unquantised f_a (times ``fa_scale``) and f_b, small-rms
    rows on every third request, request 1 padding, window T + 2 + seed % 2."""
    pages = 1 + B * T + 4
    layer = kt.make_layer(H, pages, window=T + 2 + seed % 2, conv_dim_first=bool(seed % 2),
                          bias=True, seed=seed, device="cuda")  # fmt: skip
    step = kt.make_step(B, T, H, pages=pages, padding=(1,), seed=seed + 1, device="cuda")
    step.f_a = (step.f_a.float() * fa_scale).to(torch.bfloat16)
    small_rows(layer, step)
    return layer, step


def raw_gate_of(kg):
    """``kg_records`` [B, H, T, 256] -> the raw gate as ``[B*T, H*128]`` bf16."""
    B, H, T, _ = kg.shape
    return kg[..., 128:].permute(0, 2, 1, 3).reshape(B * T, H * 128).contiguous()


def live_rows(step, B, T):
    """Rows of the requests whose state slot is > 0 (bool, ``[B*T]``)."""
    index = torch.arange(B, device=step.slots.device)
    live = step.slots.view(B, -1)[index, step.accepted.long() - 1] > 0
    return live.repeat_interleave(T)


def check_gate_ulp(got, exact, heads):
    """The SPEC's "within 1 bf16 ulp" over rows of a head's 128 features; returns the
    fraction of raw gates that differ."""
    g, r = (t.float().view(t.shape[0], heads, 128) for t in (got, exact))
    rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    err = (g - r).abs()
    ok = torch.where(r.abs() >= rms * 2.0**-10, err <= bf16_ulp(r), err <= rms * 2.0**-17)
    bad = (~ok).nonzero()[:4].tolist()
    assert not bad, [(i, float(r[tuple(i)]), float(g[tuple(i)])) for i in bad]
    return (err != 0).float().mean().item()


def run_step(layer, step, kernel, cluster, gate_mode, scalars, records):
    """The kernel on a copy of ``layer``: (output, the copy)."""
    copy = layer.clone()
    out = call_kernel(copy, step, kernel, records=records, gate_mode=gate_mode,
                      cluster=cluster, scalars=scalars)  # fmt: skip
    torch.cuda.synchronize()
    return out, copy


@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("scale", range(len(FA_SCALES)))
@pytest.mark.parametrize("kernel,cluster", RECORDING, ids=RECORDING_IDS)
def test_default_gate_is_the_reference_bitwise(kernel, cluster, scale, T):
    """Record mode: raw-gate records bitwise (check_records), v records, k, outputs; then
    a plain step: state within 1e-5 of the page max, outputs within the 1-ulp rule."""
    H, B = sizes(kernel)
    seed = 40 + 3 * scale + T
    scalars = SCALARS[seed % len(SCALARS)]
    layer, step = gate_inputs(H, B, T, seed, FA_SCALES[scale])

    ref_layer, ref_records = layer.clone(), make_records(B, H, T, "cuda")
    ref, o32 = reference(ref_layer, step, records=ref_records, scalars=scalars)
    got_records = make_records(B, H, T, "cuda")
    got, got_layer = run_step(layer, step, kernel, cluster, None, scalars, got_records)
    assert torch.equal(got_layer.state, layer.state), "record mode wrote state"
    assert torch.equal(got_layer.conv_state, ref_layer.conv_state), "conv pages differ"
    check_records(step, B, ref_records, got_records)
    check_output(got, ref, H, o32)

    ref_layer = layer.clone()
    ref, o32 = reference(ref_layer, step, scalars=scalars)
    got, got_layer = run_step(layer, step, kernel, cluster, None, scalars, None)
    check_state(got_layer.state, ref_layer.state, layer.state, written_pages(step, None))
    assert torch.equal(got_layer.conv_state, ref_layer.conv_state), "conv pages differ"
    check_output(got, ref, H, o32)


@pytest.mark.parametrize("gate_mode", [0, 1])
@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("kernel,cluster", RECORDING, ids=RECORDING_IDS)
def test_seed_gate_orders_against_their_own_raw_gate(kernel, cluster, T, gate_mode):
    """The kernel's raw gate (record mode) within 1 bf16 ulp of the exact dot; the reference
    fed with it gives the kernel's records, outputs, state and conv pages (tolerances as
    every step's). The plain step recomputes the same mma chain, so the same raw gate."""
    H, B = sizes(kernel)
    seed = 60 + 2 * T + gate_mode
    fa_scale = FA_SCALES[(T + gate_mode) % len(FA_SCALES)]
    scalars = SCALARS[seed % len(SCALARS)]
    layer, step = gate_inputs(H, B, T, seed, fa_scale)
    rows = live_rows(step, B, T)

    exact_records = make_records(B, H, T, "cuda")
    reference(layer.clone(), step, records=exact_records, scalars=scalars)
    got_records = make_records(B, H, T, "cuda")
    got, got_layer = run_step(layer, step, kernel, cluster, gate_mode, scalars, got_records)
    raw = raw_gate_of(got_records[1])
    moved = check_gate_ulp(raw[rows], raw_gate_of(exact_records[1])[rows], H)
    print(f"{kernel} mode {gate_mode} T{T}: raw gates off the exact dot's rounding {moved:.2e}")

    fed_layer, fed_records = layer.clone(), make_records(B, H, T, "cuda")
    ref, o32 = reference(fed_layer, step, records=fed_records, scalars=scalars, raw_gate=raw)
    assert torch.equal(got_layer.state, layer.state), "record mode wrote state"
    assert torch.equal(got_layer.conv_state, fed_layer.conv_state), "conv pages differ"
    check_records(step, B, fed_records, got_records)
    check_output(got, ref, H, o32)

    fed_layer = layer.clone()
    ref, o32 = reference(fed_layer, step, scalars=scalars, raw_gate=raw)
    got, got_layer = run_step(layer, step, kernel, cluster, gate_mode, scalars, None)
    check_state(got_layer.state, fed_layer.state, layer.state, written_pages(step, None))
    assert torch.equal(got_layer.conv_state, fed_layer.conv_state), "conv pages differ"
    check_output(got, ref, H, o32)
