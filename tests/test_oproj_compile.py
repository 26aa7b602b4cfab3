"""CPU compile tests: OprojConsumer and the partial publisher for sm_90a and sm_100a."""

import pytest
from compile_harness import ARCHS, require_dsl

pytestmark = pytest.mark.compile

CONFIGS = [  # tp, hid, nb, has_delta, groups, xmoe_reps
    (16, 7168, 8, True, 4, 1),
    (8, 7168, 3, False, 2, 0),
    (2, 1024, 0, True, 1, 0),
    (4, 8192, 1, True, 3, 2),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, hid, nb, has_delta, groups, xmoe", CONFIGS)
def test_consumer_compiles(arch, tp, hid, nb, has_delta, groups, xmoe):
    require_dsl()
    from tpcomm.oproj.kernels.consumer import compiled

    assert compiled(tp, hid, nb, has_delta, groups, xmoe, False, arch) is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_consumer_compiles_with_pdl(arch):
    require_dsl()
    from tpcomm.oproj.kernels.consumer import compiled

    assert compiled(16, 7168, 8, True, 4, 0, True, arch) is not None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, multicast", [(2, False), (16, False), (16, True)])
def test_publisher_compiles(arch, tp, multicast):
    require_dsl()
    from tpcomm.oproj.kernels.producer import compiled_publisher

    assert compiled_publisher(tp, 2048, multicast, multicast, False, arch) is not None


def test_consumer_ptx_protocol(tmp_path):
    """The scoped accesses, DSMEM exchanges, bounded polls and launch bounds are there."""
    cute = require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel, fake_arguments

    kernel = OprojConsumerKernel(8, 7168, 8, groups=2, xmoe_reps=1)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *fake_arguments(8, 7168, 8, 1), options=options).__ptx__
    for needle in (
        "ld.relaxed.sys.global.v4.b32",  # polls
        "st.relaxed.sys.global.v4.b32",  # re-arms
        "st.async",  # cluster exchanges
        "complete_tx",
        "%globaltimer",  # bounded spin
        "atom.global.sys.or.b32",  # error word
        "red.release.gpu",  # hints
        "st.relaxed.gpu.global.v4.b32",  # xmoe copies, then the fence before the hint
        "fence.acq_rel.gpu",
        "barrier.cluster.arrive",
        "cp.async.cg.shared.global",
        ".reqntid 256",
        ".minnctapersm 4",
    ):
        assert needle in text, needle


def test_kernel_config_validation():
    require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel

    with pytest.raises(ValueError, match="nb"):
        OprojConsumerKernel(4, 1024, 9)
    with pytest.raises(ValueError, match="groups"):
        OprojConsumerKernel(4, 1024, 1, groups=5)
    with pytest.raises(ValueError, match="hid"):
        OprojConsumerKernel(4, 9216, 1)
    with pytest.raises(ValueError, match="tp"):
        OprojConsumerKernel(17, 1024, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "tp, hid, d_local, multicast, pdl", [(16, 7168, 768, False, True), (2, 1024, 128, True, False)]
)
def test_producer_compiles(arch, tp, hid, d_local, multicast, pdl):
    require_dsl()
    from tpcomm.oproj.kernels.producer import compiled_producer

    f = compiled_producer(tp, hid, d_local, multicast, multicast, pdl, arch)
    assert f is not None
    assert f is compiled_producer(tp, hid, d_local, multicast, multicast, pdl, arch)


def test_producer_ptx_uses_mma_and_scoped_stores(tmp_path):
    cute = require_dsl()
    from tpcomm.oproj.kernels.producer import OprojProducer, fake_producer_arguments

    kernel = OprojProducer(16, 7168, 768)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *fake_producer_arguments(16, 7168, 768), options=options).__ptx__
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "st.relaxed.sys.global.v4.b32" in text
    assert "cvt.rn.bf16x2.f32" in text


def test_producer_config_validation():
    require_dsl()
    from tpcomm.oproj.kernels.producer import OprojProducer

    with pytest.raises(ValueError, match="d_local"):
        OprojProducer(4, 1024, 100)
    with pytest.raises(ValueError, match="hid"):
        OprojProducer(4, 1000, 128)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, hid, nb, groups", [(16, 2048, 8, 1), (8, 7168, 0, 2)])
def test_twoshot_compiles(arch, tp, hid, nb, groups):
    require_dsl()
    from tpcomm.oproj.kernels.consumer import compiled
    from tpcomm.oproj.kernels.producer import compiled_producer, compiled_publisher

    assert compiled(tp, hid, nb, True, groups, 1, False, arch, twoshot=True, fence=True)
    assert compiled_publisher(tp, hid, False, True, False, arch, twoshot=True)
    assert compiled_producer(tp, hid, 768, False, False, True, arch, twoshot=True)


def test_twoshot_needs_whole_groups_per_shard():
    require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel

    with pytest.raises(ValueError, match="twoshot"):
        OprojConsumerKernel(3, 1024, 1, twoshot=True)  # 1024 % 24 != 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pdl", [False, True])
def test_one_launch_kernels_compile(arch, pdl):
    """Every rank in one launch (ranks = TP): consumer, publisher, producer."""
    require_dsl()
    from tpcomm.oproj.kernels.consumer import compiled
    from tpcomm.oproj.kernels.producer import compiled_producer, compiled_publisher

    assert compiled(16, 7168, 8, True, 4, 1, pdl, arch, ranks=16) is not None
    assert compiled_publisher(16, 7168, False, False, pdl, arch, ranks=16) is not None
    assert compiled_producer(16, 7168, 768, False, False, pdl, arch, ranks=16) is not None


def test_one_launch_grid_and_offsets_in_ptx(tmp_path):
    """ranks = TP reads the grid's rank index (consumer: z, producer: y); ranks = 1 not."""
    cute = require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel, fake_arguments
    from tpcomm.oproj.kernels.producer import OprojProducer, fake_producer_arguments

    def ptx(kernel, args):
        options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
        return cute.compile(kernel, *args, options=options).__ptx__

    one = ptx(OprojConsumerKernel(16, 7168, 8, ranks=16), fake_arguments(16, 7168, 8))
    alone = ptx(OprojConsumerKernel(16, 7168, 8), fake_arguments(16, 7168, 8))
    assert "%ctaid.z" in one and "%ctaid.z" not in alone
    one = ptx(OprojProducer(16, 7168, 768, ranks=16), fake_producer_arguments(16, 7168, 768))
    alone = ptx(OprojProducer(16, 7168, 768), fake_producer_arguments(16, 7168, 768))
    assert "%ctaid.y" in one and "%ctaid.y" not in alone


def test_one_launch_config_validation():
    require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel
    from tpcomm.oproj.kernels.producer import OprojProducer, PartialPublisher

    with pytest.raises(ValueError, match="ranks"):
        OprojConsumerKernel(16, 7168, 8, ranks=4)
    with pytest.raises(ValueError, match="twoshot"):
        OprojConsumerKernel(16, 2048, 8, groups=1, twoshot=True, ranks=16)
    with pytest.raises(ValueError, match="ranks"):
        OprojProducer(8, 7168, 1536, ranks=2)
    with pytest.raises(ValueError, match="ranks"):
        PartialPublisher(8, 7168, ranks=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hid, reps, ranks", [(7168, 1, 1), (2048, 2, 8)])
def test_hint_waiter_compiles(arch, hid, reps, ranks):
    require_dsl()
    from tpcomm.oproj.hints import compiled

    assert compiled(hid, reps, None, ranks, arch) is not None


def test_hint_waiter_ptx_order(tmp_path):
    """Acquire of the hint counter (bounded), plain coherent loads of the copies (never
    ld.global.nc), the done count and the quota taken back."""
    cute = require_dsl()
    from tpcomm.oproj.hints import HintWaiter, fake_arguments

    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(HintWaiter(7168, 2), *fake_arguments(7168, 2), options=options).__ptx__
    for needle in ("ld.acquire.gpu", "%globaltimer", "atom.global.acq_rel.add", "bar.sync",
                   "ld.global.v4.b32", "atom.global.sys.or.b32", "red.relaxed.gpu"):  # fmt: skip
        assert needle in text, needle
    assert "ld.global.nc" not in text


def test_hint_waiter_validation():
    require_dsl()
    from tpcomm.oproj.hints import HintWaiter, hint_quota

    assert hint_quota(7168, 64) == 4 * 7 * 64
    for kw, match in ((dict(hid=1000, reps=1), "1024"), (dict(hid=1024, reps=0), "reps"),
                      (dict(hid=1024, reps=1, ctas=0), "ctas"),
                      (dict(hid=1024, reps=1, ranks=17), "ranks")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            HintWaiter(**kw)


def test_hint_waiter_ctas_per_gpu():
    """At most ``WAITER_GPU_CTAS`` spinning waiter CTAs on a GPU, whatever ranks it hosts
    (at least one per rank); an explicit ``ctas`` is kept."""
    require_dsl()
    from tpcomm.oproj.hints import WAITER_GPU_CTAS, HintWaiter, waiter_ctas

    assert WAITER_GPU_CTAS == 8
    assert [waiter_ctas(r) for r in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    for ranks in (1, 2, 8, 16):
        w = HintWaiter(7168, 2, ranks=ranks)
        assert w.ctas * ranks <= max(WAITER_GPU_CTAS, ranks)
    assert HintWaiter(7168, 2, ctas=3, ranks=8).ctas == 3
