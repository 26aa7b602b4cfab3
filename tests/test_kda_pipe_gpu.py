"""KdaPipe against KdaStream bit for bit (GPU): the same raw gates, q, k, v, decays, state
pages, conv pages and outputs, on unquantised inputs at model-like scales with padded
rows, fp32 and bf16 pages, T = 1, 2, 4 (the prep group writes the output at T >= 3),
several items per CTA and ranges that start and end inside a head. KdaPipe's docstring
promises this (per item KdaWide's arithmetic call for call); against the reference each
kernel is checked in ``test_kda_kernels_gpu.py`` / ``test_kda_bf16_gpu.py`` at the SPEC's
tolerance, so here any difference is a KdaPipe defect (a slot, a row, a batch column or a
page stage mixed up), never a rounding order."""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import SCALARS, call_kernel, small_rows

from kda import synthetic as kt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "H,B,T,dtype,padding,gate_mode",
    [
        (12, 130, 1, "fp32", (0, 9, 129), 3),
        (6, 67, 2, "fp32", (5,), 3),
        (12, 61, 4, "fp32", (3, 60), 3),
        (96, 33, 1, "bf16", (1,), 3),
        (12, 130, 2, "bf16", (7,), 3),
        (12, 45, 4, "bf16", (), 3),
        (6, 130, 1, "fp32", (2,), 0),
    ],
)
def test_pipe_is_stream_bit_for_bit(H, B, T, dtype, padding, gate_mode):
    device = "cuda"
    pages = 1 + B * T + 4
    layer = kt.make_layer(H, pages, window=T + 3, bias=True, seed=T + H, device=device)
    layer.state = layer.state.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    step = kt.make_step(B, T, H, pages=pages, padding=padding, seed=B, device=device)
    small_rows(layer, step)
    outs, layers = {}, {}
    for kernel in ("stream", "pipe"):
        copy = layer.clone()
        outs[kernel] = call_kernel(copy, step, kernel, gate_mode=gate_mode, scalars=SCALARS[1])
        layers[kernel] = copy
    torch.cuda.synchronize()
    assert not torch.isnan(outs["pipe"].float()).any(), "an output row left unwritten"
    assert torch.equal(outs["pipe"], outs["stream"]), "outputs differ"
    assert torch.equal(layers["pipe"].state, layers["stream"].state), "state pages differ"
    assert torch.equal(layers["pipe"].conv_state, layers["stream"].conv_state), "conv pages"
