"""CPU compile tests: OprojConsumer and the partial publisher for sm_90a and sm_100a."""

import pytest
from compile_harness import ARCHS, require_dsl

pytestmark = pytest.mark.compile

CONFIGS = [  # tp, hid, nb, has_delta, groups, xmoe_reps
    (16, 7168, 8, True, 4, 1),
    (8, 7168, 3, False, 2, 0),
    (2, 1024, 0, True, 1, 0),
    (4, 8192, 1, True, 3, 2),
    # other multiples of 256 (plan.slicing): 3 x 768, 5 x 1024, 1 x 256, 5 x 256 (more
    # (value, peer) pairs than lead threads: several pushes each), 1 x 2816 (352 threads)
    (8, 2304, 8, True, 4, 1),
    (16, 5120, 3, True, 4, 0),
    (2, 256, 2, True, 1, 0),
    (5, 1280, 8, False, 2, 1),
    (4, 2816, 2, True, 2, 0),
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
        "st.relaxed.gpu.global.v4.b32",  # xmoe copies
        "barrier.cluster.arrive",
        "cp.async.cg.shared.global",
        ".reqntid 256",
        ".minnctapersm 4",
    ):
        assert needle in text, needle
    # the copies, the lead group's barrier, then one release increment (per CTA)
    copies = text.rfind("st.relaxed.gpu.global.v4.b32")
    barrier = text.find("bar.sync \t1, 128;", copies)
    assert -1 < copies < barrier < text.find("red.release.gpu", barrier)
    assert text.count("red.release.gpu") == 1 and "fence.acq_rel.gpu" not in text


def _hint_after_lead_barrier(text, threads=128):
    """The hint's order in a compiled consumer: the last copy store, then the lead group's
    ``bar.sync 1, threads`` (every lead thread reaches it: it sits at the join of the stored
    and the failed paths), then the only release increment, under thread 0 and the flag."""
    copies = text.rfind("st.relaxed.gpu.global.v4.b32")
    release = text.find("red.release.gpu")
    barrier = text.rfind(f"bar.sync \t1, {threads};", 0, release)
    assert -1 < copies < barrier < release, (copies, barrier, release)
    assert text.count("red.release.gpu") == 1 and "fence.acq_rel.gpu" not in text
    between = text[barrier:release]
    assert "bar." not in between.split("\n", 1)[1] and "st.relaxed.gpu" not in between
    assert "ld.shared.b32" in between, "thread 0 reads the failure flag after the barrier"


HINT_PATHS = [  # tp, hid, nb, the kernel's keywords: every path a GPU test runs with xmoe
    (8, 7168, 8, dict(groups=4, xmoe_reps=1, pdl=True, ranks=8)),  # rows tests: one launch
    (8, 7168, 3, dict(groups=4, xmoe_reps=2, ranks=8)),  # hints-gate test, the bench
    (8, 2048, 3, dict(groups=1, xmoe_reps=2, twoshot=True)),  # twoshot: shard, then gather
    (3, 2048, 2, dict(groups=2, xmoe_reps=1)),  # odd TP
    (8, 2304, 3, dict(groups=4, xmoe_reps=2, ranks=8)),  # 96-thread groups
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, hid, nb, kw", HINT_PATHS)
def test_consumer_hint_order_every_path(tmp_path, tp, hid, nb, kw, arch):
    """One launch for every rank (grid z = rank), twoshot, one and several helper groups:
    the same copies, barrier, one release per CTA (``hint_quota`` = C x rows)."""
    cute = require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel, fake_arguments

    kernel = OprojConsumerKernel(tp, hid, nb, **kw)
    args = fake_arguments(tp, hid, nb, kw["xmoe_reps"], kw.get("twoshot", False))
    options = f"--gpu-arch {arch} --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *args, options=options).__ptx__
    _hint_after_lead_barrier(text, kernel.group_threads)


def test_fused_consumer_hint_order(tmp_path):
    """The fused kernel's consumer CTAs: the same order (its producer CTAs' named barrier 1
    is another CTA's)."""
    cute = require_dsl()
    from tpcomm.oproj.kernels.fused import OprojFused, fake_fused_arguments

    kernel = OprojFused(16, 7168, 8, 768, groups=4, xmoe_reps=1, pdl=True)
    args = fake_fused_arguments(16, 7168, 8, 768, 1)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    _hint_after_lead_barrier(cute.compile(kernel, *args, options=options).__ptx__)


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
    "tp, hid, d_local, multicast, pdl",
    [(16, 7168, 768, False, True), (2, 1024, 128, True, False), (8, 2304, 512, False, True)],
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
@pytest.mark.parametrize(
    "tp, hid, nb, groups", [(16, 2048, 8, 1), (8, 7168, 0, 2), (16, 2304, 8, 1), (10, 5120, 2, 3)]
)
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
    from tpcomm.oproj.hints import compiled, compiled_waiter

    assert compiled_waiter(ranks, arch) is not None
    assert compiled(hid, reps, ranks, arch) is not None


def test_hint_waiter_ptx_order(tmp_path):
    """The waiter: acquire of the hint counter (bounded, backing off), the quota taken
    back, then the dependent launch triggered; the reader: the PDL wait before the error
    word and the copies, plain coherent loads (never ld.global.nc), UNROLL of them before
    the first store."""
    cute = require_dsl()
    from tpcomm.oproj.hints import (
        UNROLL,
        HintReader,
        HintWaiter,
        fake_arguments,
        fake_waiter_arguments,
    )

    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(HintWaiter(), *fake_waiter_arguments(), options=options).__ptx__
    order = ("ld.acquire.gpu", "%globaltimer", "nanosleep.u32", "atom.global.sys.or.b32",
             "red.relaxed.gpu.global.add", "griddepcontrol.launch_dependents")  # fmt: skip
    at = [text.find(needle) for needle in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    text = cute.compile(HintReader(7168, 2), *fake_arguments(7168, 2), options=options).__ptx__
    wait, error = text.find("griddepcontrol.wait"), text.find("ld.relaxed.gpu.global.b32")
    loads = [i for i in range(len(text)) if text.startswith("ld.global.v4.b32", i)]
    first_store = text.find("st.global.v4.b32")
    assert -1 < wait < error < loads[0], (wait, error, loads[:1])
    assert len(loads) == UNROLL and loads[-1] < first_store
    assert "ld.global.nc" not in text


def test_hint_waiter_validation():
    require_dsl()
    from tpcomm.oproj.hints import HintReader, HintWaiter, hint_quota

    assert hint_quota(7168, 64) == 7 * 64
    for kw, match in ((dict(hid=1000, reps=1), "256"), (dict(hid=1024, reps=0), "reps"),
                      (dict(hid=1024, reps=1, ranks=17), "ranks")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            HintReader(**kw)
    with pytest.raises(ValueError, match="ranks"):
        HintWaiter(ranks=0)


def test_hint_reader_ctas():
    """One pass of ``UNROLL`` groups a thread where it fits, at most ``READER_CTAS_PER_SM``
    a SM over every rank of the GPU, at least one per rank."""
    require_dsl()
    from tpcomm.oproj.hints import READER_CTAS_PER_SM, READER_THREADS, UNROLL, reader_ctas

    per_cta = READER_THREADS * UNROLL * 8  # elements of one CTA's pass
    assert reader_ctas(1, 1, 1024, 1, 132) == 1
    assert reader_ctas(8, 2, 7168, 1, 132) == -(-8 * 2 * 7168 // per_cta) == 14
    for rows, ranks in ((128, 8), (1024, 8), (1024, 16), (1024, 1)):
        ctas = reader_ctas(rows, 2, 7168, ranks, 132)
        assert ctas >= 1 and ctas * ranks <= READER_CTAS_PER_SM * 132
    assert reader_ctas(1024, 8, 7168, 16, 132) == READER_CTAS_PER_SM * 132 // 16


@pytest.mark.parametrize(
    "tp, hid, nb, groups, twoshot",
    [
        (16, 7168, 8, 1, True),
        (8, 7168, 8, 2, False),
        (16, 2304, 8, 1, True),
        (4, 2816, 3, 2, False),
    ],
)
def test_consumer_shared_memory_is_the_plans(tp, hid, nb, groups, twoshot):
    """The launch asks for ``plan.smem_bytes`` (the residency figure), and one group
    allocates no helper sums: the twoshot consumer at nb 8 fits 8 CTAs per SM (7 with them)."""
    cute = require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel, fake_arguments
    from tpcomm.oproj.plan import RESERVED_SMEM, min_blocks_per_sm, smem_bytes

    kernel = OprojConsumerKernel(tp, hid, nb, groups=groups, twoshot=twoshot)
    f = cute.compile(kernel, *fake_arguments(tp, hid, nb, 0, twoshot), options="--gpu-arch sm_90a")
    want = smem_bytes(hid, nb, groups)
    assert f"llvm.mlir.constant({want} : i64)" in str(f.ir_module)
    if groups == 1:  # 8 CTAs per SM at 1024 columns, 10 at 2304's 768
        bound = min_blocks_per_sm(1, kernel.group_threads)
        assert 228 * 1024 // (want + RESERVED_SMEM) >= bound == {7168: 8, 2304: 10}[hid]


@pytest.mark.parametrize(
    "tp, hid, nb, groups",
    [(8, 2304, 8, 4), (2, 256, 2, 1), (5, 1280, 8, 2), (4, 2816, 8, 2)],
)
def test_consumer_slices_spill_nothing(tmp_path, tp, hid, nb, groups):
    """Slices of 96, 32 (5 CTAs: 80 exchange values over 32 lead threads) and 352 threads a
    group assemble within their launch bound's registers without spilling. (992 threads,
    7936 = 31 x 256 in one CTA, hold 64 registers and spill 4 bytes with xmoe copies.)"""
    cute = require_dsl()
    from compile_harness import ptxas_sm90a

    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel, fake_arguments

    kernel = OprojConsumerKernel(tp, hid, nb, groups=groups, xmoe_reps=1)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *fake_arguments(tp, hid, nb, 1), options=options).__ptx__
    assert f".reqntid {kernel.threads}" in text
    report = ptxas_sm90a(text, tmp_path / "consumer.ptx")
    assert "0 bytes spill stores" in report and "0 bytes spill loads" in report, report
