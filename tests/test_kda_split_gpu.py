"""GPU tests of kda.decode(kernel="split") (KdaSplit, clusters 2, 4, 8) against the
reference, with test_kda_kernels_gpu's helpers and tolerances: outputs poisoned and within
1 bf16 ulp in the SPEC's sense (plus o's own bf16 flip), state pages within 1e-5 of the
page's max |ref|, conv pages bitwise the reference's, untouched pages bitwise unchanged,
records as KdaWide's.
"""

from __future__ import annotations

import pytest
import torch
from test_kda_kernels_gpu import (
    POISON,
    check_output,
    check_state,
    reference,
    run_case,
    written_pages,
)

from kda import layer as kl
from kda import synthetic as kt

pytestmark = pytest.mark.gpu

CLUSTERS = [2, 4, 8]


CASES = [
    # H, B, T, dim_first, bias, record, padding, gate_mode, conv dtype, holes
    (6, 1, 1, True, True, False, (), 3, torch.bfloat16, False),
    (6, 1, 4, False, False, True, (), 3, torch.bfloat16, False),
    (6, 1, 8, True, True, False, (), 3, torch.float32, True),
    (6, 3, 2, False, False, True, (1,), 3, torch.bfloat16, False),
    (12, 8, 5, True, True, False, (0, 7), 3, torch.float32, True),
    (6, 8, 8, False, True, True, (3,), 3, torch.bfloat16, False),
    (1, 2, 3, True, False, False, (), 3, torch.bfloat16, True),
    (12, 4, 1, False, True, False, (2,), 3, torch.float32, False),
    (6, 1, 1, True, True, False, (0,), 3, torch.bfloat16, False),  # all padding
    # The seed's mma.sync gate orders, on gate inputs whose dot is exact in any order.
    (6, 2, 1, True, True, False, (), 0, torch.bfloat16, False),
    (6, 4, 4, False, False, True, (1,), 1, torch.bfloat16, False),
    (12, 1, 8, True, True, False, (), 0, torch.float32, True),
    # The default gate (mode 3) on unquantised inputs: raw gate records bitwise.
    (96, 2, 1, True, True, False, (), 3, torch.bfloat16, False),
    (12, 4, 4, False, False, True, (1,), 3, torch.bfloat16, False),
    (6, 3, 8, True, True, True, (), 3, torch.float32, False),
]


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: "H{}B{}T{}-{}-b{}-r{}-g{}".format(
        *c[:3], "df" if c[3] else "wf", int(c[4]), int(c[5]), c[7]
    ),
)
def test_split_matches_reference(cluster, case):
    H, B, T, dim_first, bias, record, padding, gate_mode, conv_dtype, holes = case
    run_case(H, B, T, dim_first=dim_first, bias=bias, record=record, padding=padding,
             kernel="split", gate_mode=gate_mode, conv_dtype=conv_dtype, seed=B + T,
             holes=holes, cluster=cluster)  # fmt: skip


def test_auto_picks_split_for_one_request():
    """B = 1, H = 6 through kernel="auto": the dispatcher's split, checked like the rest."""
    import kda
    from kda.decode import plan

    choice = plan(1, 6, 1, "cuda")
    assert choice.kernel == "split", choice.reason
    layer = kt.make_layer(6, 4, window=3, seed=31, device="cuda")
    step = kt.make_step(1, 1, 6, pages=4, seed=32, device="cuda")
    ref_layer = layer.clone()
    before = layer.state.clone()
    ref, o32 = reference(ref_layer, step)
    out = torch.full((1, 6 * 128), POISON, dtype=torch.bfloat16, device="cuda")
    kda.decode(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, lower_bound=kl.LOWER_BOUND, scale=kl.SCALE, eps=kl.EPS, out=out,
    )  # fmt: skip
    torch.cuda.synchronize()
    check_state(layer.state, ref_layer.state, before, written_pages(step, None))
    assert torch.equal(layer.conv_state, ref_layer.conv_state)
    check_output(out, ref, 6, o32)


# Steps in a row, CUDA-graph replay and PDL run for every kernel (each cluster size) in
# tests/test_kda_kernels_gpu.py.
