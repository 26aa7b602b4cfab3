"""CPU: ``OprojGemmProducer`` (TMA + wgmma GEMM publishing from its epilogue, issue 33)
compiles for sm_90a in every publication mode, its PTX has the pieces the design names
and ptxas spills nothing; other archs, bad tiles and bad widths are refused before any
compile; the plan's tile rule and ``OprojAllReduce(producer="wgmma")``'s checks."""

import pytest
from compile_harness import ptxas_sm90a, require_dsl

from tpcomm.oproj import plan as P

CONFIGS = [  # tp, hid, d_local, tile, multicast, pdl, twoshot, ranks
    (8, 7168, 1536, (64, 64), False, True, False, 1),
    (8, 7168, 1536, (128, 256), False, False, True, 1),
    (16, 7168, 768, (128, 128), True, True, False, 1),
    (8, 7168, 768, (64, 128), False, True, False, 8),
    (16, 2304, 256, (128, 256), False, False, True, 1),  # 144-column shards straddle tiles
    (8, 5120, 640, (64, 64), True, True, False, 1),
]


@pytest.mark.parametrize("tp, hid, d_local, tile, multicast, pdl, twoshot, ranks", CONFIGS)
def test_gemm_producer_ptx(tmp_path, tp, hid, d_local, tile, multicast, pdl, twoshot, ranks):
    cute = require_dsl()
    from tpcomm.oproj.kernels.gemm import OprojGemmProducer, fake_gemm_arguments

    kernel = OprojGemmProducer(tp, hid, d_local, tile_m=tile[0], tile_n=tile[1],
                               multicast=multicast, fence=True, pdl=pdl, twoshot=twoshot,
                               ranks=ranks)  # fmt: skip
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *fake_gemm_arguments(tp, hid, d_local), options=options).__ptx__
    assert f"wgmma.mma_async.sync.aligned.m64n{tile[1]}k16.f32.bf16.bf16" in text
    assert "cp.async.bulk.tensor" in text and "mbarrier" in text
    assert "cvt.rn.bf16x2.f32" in text and "fence.acq_rel.sys" in text
    store = "multimem.st" if multicast else "st.relaxed.sys.global.v4.b32"
    assert store in text
    # one 16-byte group per thread and round; one-shot stores each group to every peer
    rounds = tile[0] * tile[1] // 8 // (tile[0] // 64 * 128)
    stores = text.count("st.relaxed.sys.global.v4.b32")
    assert stores == (0 if multicast else rounds * (1 if twoshot else tp))
    assert ("griddepcontrol.wait" in text) == pdl
    report = ptxas_sm90a(text, tmp_path / "gemm.ptx")
    assert "0 bytes spill stores" in report and "0 bytes spill loads" in report, report


def test_gemm_producer_cached_and_arch():
    require_dsl()
    from tpcomm.oproj.kernels.gemm import compiled_gemm_producer

    f = compiled_gemm_producer(8, 1024, 128, arch="sm_90a", tile_m=64, tile_n=64)
    assert f is compiled_gemm_producer(8, 1024, 128, arch="sm_90a", tile_m=64, tile_n=64)
    with pytest.raises(ValueError, match="arch"):
        compiled_gemm_producer(8, 1024, 128, arch="sm_100a")


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(tile_m=32), "tile_m"),
        (dict(tile_n=96), "tile_n"),
        (dict(d_local=96), "d_local"),
        (dict(stages=1), "stages"),
        (dict(stages=64), "stages"),
    ],
)
def test_gemm_producer_config_validation(kw, word):
    require_dsl()
    from tpcomm.oproj.kernels.gemm import OprojGemmProducer

    d_local = kw.pop("d_local", 1536)
    with pytest.raises(ValueError, match=word):
        OprojGemmProducer(8, 7168, d_local, **kw)


def test_gemm_stages_fit_shared_memory():
    from tpcomm.oproj.kernels.gemm import K_TILE, PAD_WORDS, SMEM_BYTES, gemm_stages

    for tile_m in (64, 128):
        for tile_n in (64, 128, 256):
            s = gemm_stages(tile_m, tile_n, 1536)
            ring = s * (tile_m + tile_n) * K_TILE * 2
            assert 2 <= s <= 1536 // K_TILE and ring + 1024 <= SMEM_BYTES
            assert tile_m * (tile_n // 2 + PAD_WORDS) * 4 <= ring  # the epilogue tile fits
    assert gemm_stages(64, 64, 128) == 2  # never more stages than k tiles (but two)


def test_gemm_tile_rule():
    assert P.gemm_tile(9) == (64, 64) and P.gemm_tile(64) == (64, 64)
    assert P.gemm_tile(65) == (64, 128) and P.gemm_tile(128) == (64, 128)
    assert P.gemm_tile(129) == (128, 128) and P.gemm_tile(256) == (128, 128)
    assert P.gemm_tile(257) == (128, 256) and P.gemm_tile(P.MAX_ROWS) == (128, 256)
    for bad in (0, P.MAX_ROWS + 1, 1.5):
        with pytest.raises(ValueError, match="rows"):
            P.gemm_tile(bad)


def test_allreduce_takes_the_wgmma_producer():
    from tpcomm.backends.loopback import LoopbackBackend
    from tpcomm.oproj.allreduce import OprojAllReduce

    backend = LoopbackBackend(8, device="cpu")
    comm = OprojAllReduce(backend, 300, 7168, 2, producer="wgmma", one_launch=True)
    assert comm.producer == "wgmma" and comm.gemm_tile == (128, 256)
    assert OprojAllReduce(backend, 300, 7168, 2, one_launch=True).gemm_tile is None
    with pytest.raises(ValueError, match="producer"):
        OprojAllReduce(backend, 300, 7168, 2, producer="tiled", one_launch=True)


@pytest.mark.parametrize("tile_m, tile_n", [(64, 64), (128, 128), (128, 256)])
def test_every_thread_publishes_its_own_accumulators(tile_m, tile_n):
    """The epilogue's (row, feature) for each thread's accumulator pairs, traced for every
    thread: it is the wgmma m64nNk16 C layout (thread t of warp w in warp group g holds
    rows 64g + 16w + t/4 (+8), features 2(t%4) (+1) + 8j), pairs are adjacent features,
    and the tile is covered once."""
    cute = require_dsl()
    from tpcomm.oproj.kernels.gemm import accumulator_coords, make_tiled_mma

    threads = tile_m // 64 * 128
    tids, values = tuple(range(threads)), tuple(range(tile_n // 2))  # traced, not looped
    traced = {}

    @cute.jit
    def trace():
        mma = make_tiled_mma(tile_m // 64, tile_n)
        for tid in tids:
            c = accumulator_coords(mma, tid, tile_m, tile_n)
            assert cute.size(c) == len(values)
            traced[tid] = [c[i] for i in values]

    cute.compile(trace, options="--gpu-arch sm_90a")
    cover = set()
    for tid, coords in traced.items():
        g, w, t = tid // 128, tid % 128 // 32, tid % 32
        assert len(coords) == tile_n // 2
        for i in range(0, len(coords), 2):
            m, n = coords[i]
            assert coords[i + 1] == (m, n + 1)  # one packed bf16 pair
            assert m == 64 * g + 16 * w + t // 4 + 8 * (i // 2 % 2)
            assert n == 2 * (t % 4) + 8 * (i // 4)
        cover.update(coords)
    assert len(cover) == tile_m * tile_n


def test_plan_picks_wgmma_above_mma_rows_on_sm90_only():
    for rows in (1, P.MAX_TOKENS):
        assert P.choose(8, rows, 7168, wgmma=True).producer == "mma"
    for rows in (P.MAX_TOKENS + 1, 128, P.MAX_ROWS):
        plan = P.choose(8, rows, 7168, wgmma=True, one_launch=True)
        assert plan.producer == "wgmma" and "x".join(map(str, P.gemm_tile(rows))) in plan.reason
        assert P.choose(8, rows, 7168, one_launch=True).producer == "cublas"
    assert P.choose(16, 300, 7168, wgmma=True, twoshot=True).producer == "wgmma"
