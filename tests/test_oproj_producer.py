"""CPU tests of the deep o-projection producer's plan and of its host-API switch."""

import pytest

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import api
from tpcomm.oproj import producer as P


@pytest.mark.parametrize(
    "d_local, k_slab, slabs, stages",
    [
        (128, 128, 1, 1),
        (768, 768, 1, 1),  # TP16: the whole tile (24 KiB) requested at once
        (1536, 1536, 1, 1),  # TP8: 48 KiB, still one request
        (3072, 768, 4, 2),  # TP4: a two-stage ring
        (6144, 768, 8, 2),  # TP2
        (12288, 768, 16, 2),  # TP1
        (1664, 128, 13, 10),  # 13 heads: only 128 divides
    ],
)
def test_deep_plan(d_local, k_slab, slabs, stages):
    plan = P.deep_plan(d_local)
    assert (plan.k_slab, plan.slabs, plan.stages) == (k_slab, slabs, stages)
    assert plan.k_slab * plan.slabs == d_local and plan.k_slab % 128 == 0
    assert 1 <= plan.stages <= plan.slabs
    assert plan.stages * plan.slab_bytes <= P.DEEP_WEIGHT_SMEM
    # the launch bound's CTAs fit in shared memory: one wave of 448 tiles on 132 SMs
    assert P.DEEP_CTAS_PER_SM * (plan.smem_bytes + P.RESERVED_SMEM) <= P.SMEM_PER_SM
    assert P.DEEP_CTAS_PER_SM * 132 >= 7168 // P.FEATURES
    # rows 16-byte aligned for the bulk copies, stride 64 mod 128: conflict-free ld.shared
    assert plan.row_stride % 16 == 0 and plan.row_stride % 128 == 64
    assert plan.copy_bytes == 16 * plan.k_slab * 2 < 1 << 20  # the mbarrier tx-count range
    if plan.stages == plan.slabs:
        assert plan.in_flight == 16 * d_local * 2  # the whole tile before the first mma


@pytest.mark.parametrize("d_local", [0, 100, 192, -128, 768.0])
def test_deep_plan_rejects(d_local):
    with pytest.raises(ValueError, match="d_local"):
        P.deep_plan(d_local)


def test_variant_names():
    assert P.VARIANTS == ("tiled", "deep")
    pytest.importorskip("cutlass")
    with pytest.raises(ValueError, match="variant"):
        P.producer_class("wide")
    tiled, deep = P.producer_class(), P.producer_class("deep")
    assert issubclass(deep, tiled)
    with pytest.raises(ValueError, match="d_local"):
        deep(4, 1024, 100)
    with pytest.raises(ValueError, match="hid"):
        deep(4, 1000, 128)
    assert deep(16, 7168, 768).plan == P.deep_plan(768)


def test_api_producer_switch():
    backend = LoopbackBackend(4, device="cpu")
    try:
        assert api.OprojAllReduce(backend, 2, 2048, 2).producer == "tiled"
        assert api.OprojAllReduce(backend, 2, 2048, 2, producer="deep").producer == "deep"
        with pytest.raises(ValueError, match="producer"):
            api.OprojAllReduce(backend, 2, 2048, 2, producer="wide")
    finally:
        backend.teardown()
