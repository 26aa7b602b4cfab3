"""CPU compile tests: OprojFused (producer + consumer in one launch) for sm_90a and sm_100a."""

import pytest
from compile_harness import ARCHS, compile_for, ptxas_sm90a, require_dsl

pytestmark = pytest.mark.compile

CONFIGS = [  # tp, hid, nb, d_local, keyword configuration
    (16, 7168, 8, 768, dict(groups=4, xmoe_reps=1, pdl=True)),  # TP16, T = 1
    (16, 7168, 8, 512, dict(groups=1, tiles=16, pdl=True)),  # loopback-sized TP16
    (8, 7168, 0, 1536, dict(groups=2, has_delta=False, twoshot=False)),
    (8, 2048, 3, 1536, dict(groups=1, tiles=2, twoshot=True, fence=True)),
    (16, 7168, 1, 768, dict(groups=3, multicast=True, fence=True)),  # idle tiles
    (2, 1024, 0, 128, dict(groups=1, tiles=64)),
    (16, 2304, 8, 256, dict(groups=4, tiles=2, xmoe_reps=1, pdl=True)),  # 3 producer teams
    (8, 5120, 2, 512, dict(groups=2, twoshot=True, fence=True)),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, hid, nb, d_local, kw", CONFIGS)
def test_fused_compiles(arch, tp, hid, nb, d_local, kw):
    require_dsl()
    from tpcomm.oproj.kernels.fused import OprojFused, fake_fused_arguments
    from tpcomm.oproj.plan import fused_smem_bytes

    kernel = OprojFused(tp, hid, nb, d_local, **kw)
    args = fake_fused_arguments(tp, hid, nb, d_local, kw.get("xmoe_reps", 0),
                                kw.get("twoshot", False))  # fmt: skip
    f = compile_for(arch, kernel, *args)
    # the co-residency rule's shared-memory figure is what the launch asks for
    want = fused_smem_bytes(hid, nb, kw["groups"])
    assert f"llvm.mlir.constant({want} : i64)" in str(f.ir_module)


def test_fused_cached_compile():
    require_dsl()
    from tpcomm.oproj.kernels.fused import compiled_fused

    config = dict(tiles=1, has_delta=True, groups=4, xmoe_reps=0, multicast=False, fence=False)
    a = compiled_fused(16, 7168, 8, 768, "sm_90a", pdl=True, twoshot=False, **config)
    assert a is compiled_fused(16, 7168, 8, 768, "sm_90a", pdl=True, twoshot=False, **config)


def _ptx(tmp_path, tp, hid, nb, d_local, **kw):
    cute = require_dsl()
    from tpcomm.oproj.kernels.fused import OprojFused, fake_fused_arguments

    kernel = OprojFused(tp, hid, nb, d_local, **kw)
    args = fake_fused_arguments(tp, hid, nb, d_local, kw.get("xmoe_reps", 0))
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    return cute.compile(kernel, *args, options=options).__ptx__


def test_fused_ptx_has_both_halves(tmp_path):
    text = _ptx(tmp_path, 16, 7168, 8, 768, groups=4, xmoe_reps=1, pdl=True)
    for needle in (
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",  # producer GEMM
        "ld.global.nc.L1::no_allocate.v4.b32",  # weights
        "cvt.rn.bf16x2.f32",
        "st.relaxed.sys.global.v4.b32",  # publish + re-arm
        "ld.relaxed.sys.global.v4.b32",  # polls
        "st.async",  # cluster exchanges
        "barrier.cluster.arrive",
        "%globaltimer",  # bounded polls
        "atom.global.sys.or.b32",  # error word
        "red.release.gpu",  # hints
        "griddepcontrol.wait",
        "griddepcontrol.launch_dependents",
        "bar.sync \t4, 128;",  # producer group 3's named barrier
        ".reqntid 512",
        ".minnctapersm 2",
    ):
        assert needle in text, needle


def test_fused_consumer_waits_before_polling(tmp_path):
    """PDL: in the consumer part, the prefix prefetch and every mailbox poll come after a
    griddepcontrol.wait; the block snapshots are prefetched before it."""
    text = _ptx(tmp_path, 8, 7168, 8, 1536, groups=2, pdl=True)
    lines = text.splitlines()
    first_poll = next(i for i, x in enumerate(lines) if "ld.relaxed.sys.global" in x)
    waits = [i for i, x in enumerate(lines) if "griddepcontrol.wait" in x]
    copies = [i for i, x in enumerate(lines) if "cp.async.cg.shared.global" in x]
    assert any(w < first_poll for w in waits)
    # consumer prefetch: norm, query, out_norm, 8 blocks before the wait; the prefix after
    consumer_wait = max(w for w in waits if w < first_poll)
    assert sum(c < consumer_wait for c in copies) == 3 + 8
    assert sum(c > consumer_wait for c in copies) == 1


@pytest.mark.parametrize("groups, tiles", [(4, 1), (2, 8), (1, 16)])
def test_fused_fits_its_launch_bound(tmp_path, groups, tiles):
    """ptxas keeps the registers under the launch bound's cap without spilling, so the
    co-residency rule's CTAs per SM hold."""
    from tpcomm.oproj.plan import min_blocks_per_sm

    tp = {1: 4, 2: 8, 4: 16}[groups]
    text = _ptx(tmp_path, tp, 7168, 8, 768, groups=groups, tiles=tiles, pdl=True)
    out = ptxas_sm90a(text, tmp_path / "fused.ptx")
    registers = int(out.split("Used ")[1].split(" registers")[0])
    cap = 65536 // (128 * groups * min_blocks_per_sm(groups))
    assert registers <= cap, out
    assert "0 bytes spill stores" in out, out
